"""The gateway's HTTP routes, one module per resource; `gateway.app` includes them all."""

from gateway.routes import chat, health, models, streams

ROUTERS = (health.router, models.router, chat.router, streams.router)

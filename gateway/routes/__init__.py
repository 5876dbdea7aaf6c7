"""The gateway's HTTP routes, one module per resource; `gateway.app` includes them all."""

from gateway.routes import chat, health, models, responses, streams

ROUTERS = (health.router, models.router, chat.router, streams.router, responses.router)

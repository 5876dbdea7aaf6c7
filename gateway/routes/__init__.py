"""The gateway's HTTP routes, one module per resource; `gateway.app` includes them all."""

from gateway.routes import audio, chat, containers, files, health, models, responses, streams, vector_stores

ROUTERS = (health.router, models.router, chat.router, streams.router, responses.router, files.router,
           vector_stores.router, audio.router, containers.router)

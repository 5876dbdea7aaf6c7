"""The gateway's HTTP routes, one module per resource; `gateway.app` includes them all."""

from gateway.routes import (
    audio,
    chat,
    chat_store,
    compact,
    containers,
    conversations,
    files,
    health,
    models,
    moderations,
    response_inputs,
    responses,
    responses_ws,
    streams,
    vector_stores,
)

ROUTERS = (
    health.router,
    models.router,
    moderations.router,
    chat.router,
    chat_store.router,
    streams.router,
    compact.router,
    response_inputs.router,
    responses.router,
    responses_ws.router,
    files.router,
    vector_stores.router,
    audio.router,
    containers.router,
    conversations.router,
)

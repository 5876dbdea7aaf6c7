"""FastAPI dependencies shared by the route modules."""

from __future__ import annotations

from fastapi import Request

from gateway.pipeline import Gateway


async def pipeline(request: Request) -> Gateway:
    """The gateway instance's pipeline connections (set up by `gateway.app.create_app`); async, so
    FastAPI calls it on the loop instead of through its thread pool."""
    return request.app.state.gateway

"""FastAPI dependencies shared by the route modules."""

from __future__ import annotations

from fastapi import Request

from gateway.pipeline import Gateway


def pipeline(request: Request) -> Gateway:
    """The gateway instance's pipeline connections (set up by `gateway.app.create_app`)."""
    return request.app.state.gateway

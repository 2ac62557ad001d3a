"""The browser's address, passed on to the Gateway with every call the console makes for it.

The Gateway counts failed sign-ins and keys per source address. Every browser reaches it through
the console, so without this each failure would count against the console's own address, and a few
guessing browsers could hold everyone else's sign-ins back. The console therefore calls the
Gateway's console port as the ``console`` identity (mutual TLS) and sends each request's browser
address (the HTTP peer: the console trusts no X-Forwarded-For) in ``x-quayutec-client-address``;
the Gateway believes that entry from the console's certificate alone (services/gateway/auth.py).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import grpc
from starlette.types import ASGIApp, Receive, Scope, Send

from services.gateway.auth import CLIENT_ADDRESS_METADATA

# The address of the browser whose request is being served ("" outside a request).
_BROWSER: contextvars.ContextVar[str] = contextvars.ContextVar("quayutec_console_browser", default="")


class BrowserAddress:
    """ASGI middleware: the request's peer address is the browser's for the calls made while serving it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client = scope.get("client") if scope["type"] == "http" else None
        if not client:
            await self.app(scope, receive, send)
            return
        token = _BROWSER.set(str(client[0]))
        try:
            await self.app(scope, receive, send)
        finally:
            _BROWSER.reset(token)


def _with_browser(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    browser = _BROWSER.get()
    if not browser:
        return details
    kept = [(k, v) for k, v in (details.metadata or ()) if k != CLIENT_ADDRESS_METADATA]
    return details._replace(metadata=grpc.aio.Metadata(*kept, (CLIENT_ADDRESS_METADATA, browser)))


class ForwardBrowser(grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    """Adds the browser's address to every unary and server-streaming call of the console's channel."""

    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(_with_browser(client_call_details), request)

    async def intercept_unary_stream(
        self, continuation: Callable[..., Any], client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(_with_browser(client_call_details), request)

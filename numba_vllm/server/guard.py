"""The checks every request passes before it reaches a route (ASGI middleware), in this order:

1. `Host` among ``--allowed-hosts`` when that is set (400): against DNS rebinding, where a web page
   re-points its own name at 127.0.0.1 and so reaches a local server "same-origin";
2. on /v1, the API key when one is set (401). The header's bytes are compared with the key's UTF-8
   bytes: decoding the header as Latin-1 (as HTTP libraries do) would make a non-ASCII key unmatchable;
3. a POST to a generation endpoint must say `Content-Type: application/json` (415). A web page can
   send a cross-origin "simple" POST (text/plain, form data) without the browser asking the server
   first; requiring JSON makes the browser ask (a CORS preflight, which this server never grants);
4. while shutting down, POSTs on /v1 get 503.
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse

from numba_vllm.server.protocol import APIError

if TYPE_CHECKING:
    from numba_vllm.server.app import ServerState

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


class Guard:
    """ASGI middleware: the checks of the module docstring, answered with OpenAI-style error bodies."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state
        self.api_key = state.api_key.encode("utf-8") if state.api_key is not None else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            error = self._check(scope)
            if error is not None:
                await JSONResponse(error.body(), status_code=error.status, headers=error.headers)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _check(self, scope) -> APIError | None:
        headers = dict(scope.get("headers", ()))  # later duplicates win; the checks below need one value each
        path, method = scope["path"], scope["method"]
        if not self.state.limits.host_allowed(headers.get(b"host")):
            return APIError(400, "the Host header names a host this server does not serve (--allowed-hosts)", code="invalid_host")
        if not path.startswith("/v1"):
            return None
        if self.api_key is not None and not self._authorized(headers.get(b"authorization")):
            return APIError(
                401,
                "invalid or missing API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if method == "POST" and path in GENERATION_PATHS and not _is_json(headers.get(b"content-type")):
            message = "the request body must be JSON, sent with 'Content-Type: application/json'"
            return APIError(415, message, code="unsupported_media_type")
        if method == "POST" and self.state.draining:
            return APIError(503, "the server is shutting down", code="service_unavailable")
        return None

    def _authorized(self, value: bytes | None) -> bool:
        if value is None:
            return False
        scheme, _, token = value.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)


def _is_json(content_type: bytes | None) -> bool:
    return content_type is not None and content_type.split(b";", 1)[0].strip().lower() == b"application/json"

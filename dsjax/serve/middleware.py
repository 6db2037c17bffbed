"""Pure ASGI middleware: a request-body size limit (413) and HTTP status counting for /metrics."""

from __future__ import annotations

from dsjax.serve.errors import APIError
from dsjax.serve.metrics import ServeMetrics


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds {limit} bytes (the server's --max-body-bytes)",
                    param=None, code="request_too_large")


class BodySizeLimit:
    """Refuses bodies over max_bytes: at once when Content-Length says so, else as the bytes arrive (the
    handler reading the body gets an APIError(413), which the app's handler turns into the response)."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await body_too_large(self.max_bytes).response()(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise body_too_large(self.max_bytes)
            return message

        await self.app(scope, limited_receive, send)


class HTTPMetrics:
    """Counts responses by route and status code; unknown paths share one label (bounded cardinality)."""

    def __init__(self, app, metrics: ServeMetrics, routes: set[str]):
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500  # if the app raises before it starts a response

        async def counting_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            route = scope["path"] if scope["path"] in self.routes else "other"
            self.metrics.http_requests.labels(route, str(status)).inc()

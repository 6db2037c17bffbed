"""The FastAPI app: routes, auth, error shapes, middleware. It takes a running-or-not AsyncEngine, so tests
can hand it any engine; the lifespan starts and stops the engine thread."""

from __future__ import annotations

import contextlib
import hmac
import logging
import time

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from dsjax.serve.async_engine import AsyncEngine
from dsjax.serve.errors import APIError
from dsjax.serve.metrics import ServeMetrics
from dsjax.serve.middleware import BodySizeLimit, HTTPMetrics
from dsjax.serve.serving import OpenAIServing

log = logging.getLogger(__name__)

ROUTES = {"/health", "/metrics", "/debug/stats", "/v1/models", "/v1/completions", "/v1/chat/completions"}


def build_app(engine: AsyncEngine, serving: OpenAIServing, *, metrics: ServeMetrics, api_key: str | None = None,
              max_body_bytes: int = 4 << 20) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await engine.stop()

    app = FastAPI(title="dsjax", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    created = int(time.time())

    def require_api_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or wrong API key; send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    authorized = [Depends(require_api_key)]

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> Response:
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> Response:
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(error.status_code,
                                                                                          str(error.detail))
        return APIError(error.status_code, message, code="not_found" if error.status_code == 404 else None).response()

    @app.exception_handler(ClientDisconnect)
    async def _client_left(request: Request, error: ClientDisconnect) -> Response:
        # The client hung up while sending its body: nobody will read this response.
        return APIError(499, "the client closed the connection", code="client_closed_request").response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(error).__name__}: {error}", code="internal_error").response()

    @app.get("/health")
    async def health() -> Response:
        if engine.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not engine.is_healthy:
            return JSONResponse({"status": "unhealthy", "reason": engine.dead or "engine steps keep failing"},
                                status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/stats", dependencies=authorized)
    async def debug_stats() -> Response:
        return JSONResponse(engine.snapshot())

    @app.get("/v1/models", dependencies=authorized)
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": serving.model_name, "object": "model", "created": created, "owned_by": "dsjax",
            "max_model_len": serving.max_model_len}]})

    @app.post("/v1/completions", dependencies=authorized)
    async def completions(request: Request) -> Response:
        return await serving.completions(request)

    @app.post("/v1/chat/completions", dependencies=authorized)
    async def chat_completions(request: Request) -> Response:
        return await serving.chat(request)

    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    app.add_middleware(HTTPMetrics, metrics=metrics, routes=ROUTES)  # added last: outermost, sees every status
    return app

"""Model + engine + app + uvicorn, and the SIGTERM drain: stop taking requests (503), let the ones in
flight finish, then exit cleanly."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time

import jax
import prometheus_client
import uvicorn
from fastapi import FastAPI

from dsjax.engine.llm_engine import LLMEngine
from dsjax.loader import load_model, load_tokenizer
from dsjax.parallel.mesh import prepare_process
from dsjax.serve import fault_inject
from dsjax.serve.app import build_app
from dsjax.serve.async_engine import AsyncEngine
from dsjax.serve.config import ServeConfig
from dsjax.serve.metrics import ServeMetrics
from dsjax.serve.multihost import LockstepEngine, follow
from dsjax.serve.serving import OpenAIServing

log = logging.getLogger(__name__)

_FORCED_SHUTDOWN_S = 5  # after the drain: how long uvicorn waits for responses still being written


def build_engine(config: ServeConfig) -> LLMEngine:
    parallel = config.parallel()
    prepare_process(parallel)  # before anything touches a device
    dtype = config.dtype
    if dtype == "auto":
        dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    model = load_model(config.model, dtype=dtype, kernel_backend=config.kernel_backend, progress=False,
                       parallel=parallel)
    tokenizer = load_tokenizer(config.model)
    engine = LLMEngine(model, tokenizer, config.engine_config(), progress=False)
    log.info("engine ready: %d KV blocks, buckets %s, compiled in %.1fs", engine.num_blocks,
             list(engine.runner.buckets.sizes), engine.warmup_seconds)
    return engine


def create_app(config: ServeConfig, engine: LLMEngine) -> FastAPI:
    metrics = ServeMetrics()
    async_engine = AsyncEngine(engine, max_queue_len=config.max_queue_len, metrics=metrics)
    vocab_size = engine.runner.model_config.vocab_size
    serving = OpenAIServing(async_engine, engine.tokenizer, model_name=config.model_name,
                            max_model_len=engine.config.max_model_len, vocab_size=vocab_size, max_n=config.max_n)
    return build_app(async_engine, serving, metrics=metrics, api_key=config.api_key,
                     max_body_bytes=config.max_body_bytes)


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM/SIGINT drains: new requests get 503 while the ones in flight
    finish (up to drain_timeout seconds), then the server exits with status 0. A second signal exits now."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_timeout: float):
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout
        self._drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self._drain_deadline is None:
            self.engine.begin_drain()
            self._drain_deadline = time.monotonic() + self.drain_timeout
            log.warning("signal %d: draining %d request(s) for up to %.0fs; new requests get 503", sig,
                        self.engine.num_in_flight, self.drain_timeout)
        else:
            log.warning("signal %d again: exiting without waiting", sig)
            self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self._drain_deadline is not None and not self.should_exit:
            if self.engine.num_in_flight == 0:
                log.warning("drained; shutting down")
                self.should_exit = True
            elif time.monotonic() >= self._drain_deadline:
                log.warning("drain timeout: %d request(s) still in flight are cut off", self.engine.num_in_flight)
                self.should_exit = True
        return await super().on_tick(counter)

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn's version re-raises the signal after shutdown, so the default action would kill the process;
        # a completed drain is a clean exit.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def run_server(config: ServeConfig) -> None:
    """Loads the model, compiles the engine's steps, then serves until SIGTERM/SIGINT (blocking)."""
    # force: JAX's import may already have configured the root logger; this process is ours.
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        force=True)
    prometheus_client.disable_created_metrics()  # the *_created series only double the scrape size
    engine = build_engine(config)
    if jax.process_count() == 1:
        _serve(config, engine)
    elif jax.process_index() != 0:  # multi-host: only process 0 serves; the others mirror its engine
        log.warning("process %d of %d: following process 0's engine", jax.process_index(), jax.process_count())
        follow(engine)
    else:
        engine = LockstepEngine(engine)
        try:
            _serve(config, engine)
        finally:
            engine.shutdown()


def _serve(config: ServeConfig, engine) -> None:
    marker = os.environ.get(fault_inject.ENV_VAR)
    if marker is not None:
        fault_inject.install(engine, marker)
    app = create_app(config, engine)
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                               access_log=False, timeout_graceful_shutdown=_FORCED_SHUTDOWN_S)
    DrainingServer(uv_config, app.state.engine, config.drain_timeout).run()

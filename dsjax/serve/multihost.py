"""Serving from several hosts: process 0 runs the HTTP server and the scheduler; the others mirror it.

Each engine step is one SPMD program over every process's devices, so all processes must run the
same steps on the same host-side state. The engine is deterministic given the calls that change it,
so process 0 sends those calls (add_request, abort_request) to the others before each step, and they
replay them and step too: one small broadcast per step, no second scheduler protocol.
"""

from __future__ import annotations

import logging
import pickle
import threading

import numpy as np
from jax.experimental import multihost_utils

log = logging.getLogger(__name__)


def _broadcast(calls: list[tuple] | None) -> list[tuple]:
    """Process 0's ``calls`` on every process (the others pass None)."""
    payload = pickle.dumps(calls) if calls is not None else b""
    size = int(multihost_utils.broadcast_one_to_all(np.int64(len(payload))))
    buffer = np.zeros(1 << max(size - 1, 1).bit_length(), np.uint8)  # power-of-two sizes: few compiles
    buffer[:len(payload)] = np.frombuffer(payload, np.uint8)
    return pickle.loads(multihost_utils.broadcast_one_to_all(buffer)[:size].tobytes())


class LockstepEngine:
    """Process 0's LLMEngine, mirrored on the other processes (which run ``follow``)."""

    def __init__(self, engine):
        self.engine = engine
        self._calls: list[tuple] = []  # since the last step
        self._lock = threading.Lock()  # a step's broadcast and shutdown's never interleave
        self._stopped = False

    def add_request(self, request_id, prompt, params=None, prompt_token_ids=None, **options):
        self._calls.append(("add", request_id, prompt, params, prompt_token_ids, options))
        return self.engine.add_request(request_id, prompt, params, prompt_token_ids=prompt_token_ids, **options)

    def abort_request(self, request_id):
        self._calls.append(("abort", request_id))
        return self.engine.abort_request(request_id)

    def step(self):
        with self._lock:
            if self._stopped:
                raise RuntimeError("the multi-host engine has shut down: the other processes are gone")
            calls, self._calls = self._calls + [("step",)], []
            _broadcast(calls)
            return self.engine.step()

    def shutdown(self) -> None:
        """Lets the followers return (after the step in flight, if any)."""
        with self._lock:
            if not self._stopped:
                self._stopped = True
                _broadcast([("stop",)])

    def __getattr__(self, name):
        return getattr(self.engine, name)


def follow(engine) -> None:
    """The loop of processes other than 0: replay process 0's calls until it shuts down. A call
    that raised on process 0 raises the same here; its effects (none, or aborted requests) match."""
    while True:
        for kind, *args in _broadcast(None):
            if kind == "stop":
                return
            try:
                if kind == "add":
                    request_id, prompt, params, ids, options = args
                    engine.add_request(request_id, prompt, params, prompt_token_ids=ids, **options)
                elif kind == "abort":
                    engine.abort_request(*args)
                else:
                    engine.step()
            except Exception as e:  # process 0 saw it too and answered its client
                log.debug("replayed %s raised %s: %s", kind, type(e).__name__, e)

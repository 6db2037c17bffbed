"""TEST-ONLY: make engine steps raise, to exercise the server's failure path end to end.

Enabled only by the environment variable DSJAX_FAULT_INJECT=<marker>: any step whose batch holds a
sequence whose prompt contains <marker> raises inside the runner, after the scheduler has committed
the step (blocks allocated), which is the state a real device error leaves behind. Never set it in
production; the server logs a warning at start when it is set.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

ENV_VAR = "DSJAX_FAULT_INJECT"


class InjectedFault(RuntimeError):
    pass


def install(engine, marker: str) -> None:
    """Wraps engine.runner.dispatch (an instance attribute, the engine's code is untouched)."""
    if not marker:
        raise ValueError(f"{ENV_VAR}={marker!r}: accepted a non-empty marker string")
    log.warning("%s is set: engine steps with a prompt containing %r will raise (test-only)", ENV_VAR, marker)
    tokenizer, dispatch = engine.tokenizer, engine.runner.dispatch
    poisoned: dict[str, bool] = {}  # sequence id -> its prompt contains the marker (grows; test-only)

    def dispatch_or_raise(out, rows, pending_rows=None):
        for item in out.scheduled:
            key = item.seq.request_id
            if key not in poisoned:
                poisoned[key] = marker in tokenizer.decode(item.seq.prompt_token_ids)
            if poisoned[key]:
                raise InjectedFault(f"injected fault: request {item.seq.request_id!r} carries {marker!r}")
        return dispatch(out, rows, pending_rows)

    engine.runner.dispatch = dispatch_or_raise

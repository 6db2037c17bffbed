"""Per-request sampling settings, shaped like vLLM's ``SamplingParams``.

Frozen and validated once, at construction, so the scheduler and sampler can trust every field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

PRIORITIES = ("realtime", "default", "bulk")


def _is_int(value: Any) -> bool:
    # bool is a subclass of int; max_tokens=True is a bug, not a request for one token.
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # in (0, 1]; 1 keeps the whole distribution
    top_k: int = 0  # 0 means off (vLLM's -1); a positive k keeps the k most likely tokens
    min_tokens: int = 0  # EOS and stop_token_ids are ignored until this many tokens are generated
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str | None = ()  # normalized to a tuple of strings
    stop_token_ids: tuple[int, ...] | list[int] | None = ()  # normalized to a tuple of ints
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top log-probabilities to return per token
    priority: str = "default"  # one of PRIORITIES; the scheduler maps it to a lane

    def __post_init__(self) -> None:
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(stop))
        stop_token_ids = () if self.stop_token_ids is None else tuple(self.stop_token_ids)
        object.__setattr__(self, "stop_token_ids", stop_token_ids)
        self._validate()

    def _validate(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n={self.n!r}: accepted an int >= 1")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r}: accepted an int >= 1")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature!r}: accepted a number >= 0 (0 is greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r}: accepted a number in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r}: accepted 0 (off) or an int >= 1")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens={self.min_tokens!r}: accepted an int in [0, max_tokens={self.max_tokens}]"
            )
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed={self.seed!r}: accepted None or an int")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop={self.stop!r}: accepted non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(
                    f"stop_token_ids={self.stop_token_ids!r}: accepted ints >= 0, got {t!r}"
                )
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={self.ignore_eos!r}: accepted True or False")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs={self.logprobs!r}: accepted None or an int >= 0")
        if self.priority not in PRIORITIES:
            raise ValueError(f"priority={self.priority!r}: accepted one of {PRIORITIES}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

"""What the load test sends and when: prompt-length classes mixed by ratio, Poisson arrivals in phases.

The design notes' mixed workload: 50% short prompts (64-256 tokens), 30% medium (257-2048), 20% long
(4096). Prompts are token ids, so their lengths are exact whatever the server's tokenizer; `scale`
shrinks every length (0.1 fits a CPU server with max_model_len 512).
"""

from __future__ import annotations

import dataclasses
import random

# class -> (shortest, longest) prompt tokens at scale 1
PROMPT_CLASSES = {"short": (64, 256), "medium": (257, 2048), "long": (4096, 4096)}
MIXED = {"short": 0.5, "medium": 0.3, "long": 0.2}
WORKLOADS = {"mixed": MIXED, "short": {"short": 1.0}, "medium": {"medium": 1.0}, "long": {"long": 1.0}}


@dataclasses.dataclass(frozen=True)
class Phase:
    qps: float
    duration_s: float

    def __post_init__(self):
        if not self.qps > 0 or not self.duration_s > 0:
            raise ValueError(f"phase qps={self.qps}, duration={self.duration_s}: accepted positive numbers")


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    index: int
    send_at: float  # seconds after the start
    phase: int
    kind: str  # a PROMPT_CLASSES key
    prompt_token_ids: list[int]
    max_tokens: int


@dataclasses.dataclass(frozen=True)
class Workload:
    mix: dict[str, float]  # class -> ratio; normalized
    scale: float = 1.0
    max_tokens: tuple[int, int] = (64, 64)  # uniform in [lo, hi]
    token_ids: tuple[int, int] = (3, 258)  # uniform in [lo, hi]: the byte tokenizer's bytes, valid in any vocab

    def __post_init__(self):
        unknown = set(self.mix) - set(PROMPT_CLASSES)
        if unknown:
            raise ValueError(f"mix classes {sorted(unknown)}: accepted {sorted(PROMPT_CLASSES)}")
        if any(r < 0 for r in self.mix.values()) or not sum(self.mix.values()) > 0:
            raise ValueError(f"mix={self.mix}: accepted ratios >= 0 with a positive sum")
        if not self.scale > 0:
            raise ValueError(f"scale={self.scale}: accepted a number > 0")
        lo, hi = self.max_tokens
        if not 1 <= lo <= hi:
            raise ValueError(f"max_tokens={self.max_tokens}: accepted 1 <= lo <= hi")
        lo, hi = self.token_ids
        if not 0 <= lo <= hi:
            raise ValueError(f"token_ids={self.token_ids}: accepted 0 <= lo <= hi")
        total = sum(self.mix.values())
        object.__setattr__(self, "mix", {k: v / total for k, v in self.mix.items() if v > 0})

    def prompt_range(self, kind: str) -> tuple[int, int]:
        lo, hi = PROMPT_CLASSES[kind]
        return max(1, round(lo * self.scale)), max(1, round(hi * self.scale))

    def longest_request(self) -> int:
        """Prompt + max_tokens of the largest request this workload can send."""
        return max(self.prompt_range(kind)[1] for kind in self.mix) + self.max_tokens[1]

    def sample(self, rng: random.Random) -> tuple[str, list[int], int]:
        kind = rng.choices(list(self.mix), weights=list(self.mix.values()))[0]
        lo, hi = self.prompt_range(kind)
        length = rng.randint(lo, hi)
        ids = rng.choices(range(self.token_ids[0], self.token_ids[1] + 1), k=length)
        return kind, ids, rng.randint(*self.max_tokens)


def schedule(workload: Workload, phases: list[Phase], max_requests: int, seed: int = 0) -> list[RequestSpec]:
    """Poisson arrivals at each phase's rate, phases back to back, at most max_requests in all."""
    rng = random.Random(seed)
    specs: list[RequestSpec] = []
    start = 0.0
    for p, phase in enumerate(phases):
        t = start + rng.expovariate(phase.qps)
        while t < start + phase.duration_s and len(specs) < max_requests:
            kind, ids, max_tokens = workload.sample(rng)
            specs.append(RequestSpec(len(specs), t, p, kind, ids, max_tokens))
            t += rng.expovariate(phase.qps)
        start += phase.duration_s
    return specs


def parse_range(text: str, name: str) -> tuple[int, int]:
    """'64' -> (64, 64); '16-128' -> (16, 128)."""
    try:
        lo, _, hi = str(text).partition("-")
        return int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"{name}={text!r}: accepted N or LO-HI (integers)") from None


def parse_mix(text: str) -> dict[str, float]:
    """'short=0.5,medium=0.3,long=0.2' -> ratios."""
    try:
        return {k.strip(): float(v) for k, v in (item.split("=") for item in text.split(",") if item.strip())}
    except ValueError:
        raise ValueError(f"mix={text!r}: accepted CLASS=RATIO,... with classes {sorted(PROMPT_CLASSES)}") from None


def parse_phases(text: str) -> list[Phase]:
    """'40:20,1:15' -> 40 qps for 20 s, then 1 qps for 15 s."""
    try:
        return [Phase(float(q), float(d)) for q, d in (item.split(":") for item in text.split(",") if item.strip())]
    except ValueError as e:
        raise ValueError(f"phases={text!r}: accepted QPS:SECONDS,... with positive numbers ({e})") from None

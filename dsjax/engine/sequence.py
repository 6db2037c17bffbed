"""One request's host-side state: its tokens, its progress through the KV cache, its place in line."""

from __future__ import annotations

import dataclasses
import enum

from dsjax.engine.sampling_params import SamplingParams


# An output token already sampled on the device but not yet read back (async scheduling): the next step
# takes its value straight from the device; the host learns it one step later.
PENDING_TOKEN = -1


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = enum.auto()  # max_tokens reached
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        # Identity tests rather than a set lookup (an enum member's hash is Python code): this runs for
        # every running sequence several times a step.
        return self is not SequenceStatus.RUNNING and self is not SequenceStatus.WAITING


# OpenAI API wording for each finished status.
_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


def finish_reason_of(status: SequenceStatus) -> str:
    if status not in _FINISH_REASONS:
        raise ValueError(f"status={status}: accepted a finished status, one of {list(_FINISH_REASONS)}")
    return _FINISH_REASONS[status]


class Lane(enum.IntEnum):
    """Scheduling lanes; a lower value is served first and preempted last."""

    REALTIME = 0
    DEFAULT = 1
    BULK = 2


@dataclasses.dataclass(eq=False)  # identity equality: two requests with equal tokens are still two requests
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it; None for EOS
    # Tokens whose KV is in the cache. Everything in all_token_ids past this point is still to be
    # computed: the prompt during prefill, the last sampled token during decode.
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # tokens served by the prefix cache at the latest admission
    block_table: list[int] = dataclasses.field(default_factory=list)  # owned by the block manager
    # Set by the scheduler.
    lane: Lane = Lane.DEFAULT
    arrival_step: int = 0  # scheduler step at which it was added
    waiting_since_step: int = 0  # step at which it entered its current waiting lane (for aging)
    admission_index: int = -1  # increases with every admission; larger means admitted more recently
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def has_pending_token(self) -> bool:
        return bool(self.output_token_ids) and self.output_token_ids[-1] == PENDING_TOKEN

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose values are known: all but the trailing PENDING_TOKENs (a multi-step chunk's are several)."""
        num, outputs = len(self.output_token_ids), self.output_token_ids
        while num and outputs[num - 1] == PENDING_TOKEN:
            num -= 1
        return len(self.prompt_token_ids) + num

    @property
    def is_decoding(self) -> bool:
        """Only the last sampled token is uncomputed: the next step feeds it alone.

        A preempted sequence recomputing prompt + outputs is prefilling until that point.
        """
        return self.num_output_tokens > 0 and self.num_computed_tokens == self.num_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        """all_token_ids[start:stop] without building the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : stop - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - num_prompt]

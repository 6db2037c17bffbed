"""Continuous-batching scheduler with chunked prefill, priority lanes, aging and preemption.

Pure Python, no JAX. Each schedule() call decides one model step: which sequences run and how many
of their tokens. A sequence's uncomputed tokens are all_token_ids[num_computed_tokens:]; a decode
has one (the last sampled token), a prefill has the rest of its prompt, or after a preemption its
prompt and outputs. The runner samples a token for a sequence only when the step reaches its end.

A step's results come back in two halves: commit() once the step is dispatched (its tokens count as
computed, each sampling sequence gets a PENDING_TOKEN), resolve() once its sampled tokens are read
(the pending tokens take their values, stop conditions are checked). Synchronous engines call both
right away (update_from_output); with async scheduling the next step is scheduled in between, so a
sequence decodes its pending token, whose value the device supplies from the step before.

Multi-step decoding (num_scheduler_steps > 1): when every running sequence decodes and none waits, a step
is a chunk of up to num_scheduler_steps decode steps run by one launch. Each sequence gets room for its
chunk's tokens (fewer than the chunk near its max_tokens, or while its EOS is still masked by min_tokens),
commit() adds that many PENDING_TOKENs, and resolve() takes that many tokens, stopping at the first that
ends the sequence.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses

from dsjax.engine.sequence import PENDING_TOKEN, Lane, Sequence, SequenceStatus, finish_reason_of
from dsjax.kv.block_manager import BlockManager
from dsjax.kv.sharded import ShardedBlockManager


@dataclasses.dataclass(frozen=True)
class ScheduledSequence:
    seq: Sequence
    num_scheduled_tokens: int
    num_computed_tokens: int  # at schedule time: the position of the first scheduled token
    is_decode: bool
    do_sample: bool  # the chunk ends at the sequence's last token: sample the next one
    num_steps: int = 1  # decode steps of a multi-step chunk: tokens sampled (and cache slots written)

    @property
    def token_ids(self) -> list[int]:
        start = self.num_computed_tokens
        return self.seq.token_ids_slice(start, start + self.num_scheduled_tokens)


@dataclasses.dataclass
class SchedulerOutput:
    step: int
    scheduled: list[ScheduledSequence]  # decodes first, then prefill chunks; the runner relies on it
    num_decodes: int
    num_batched_tokens: int  # sum of num_scheduled_tokens
    preempted: list[Sequence]  # preempted during this step; their blocks are already freed
    num_steps: int = 1  # decode steps the launch runs (> 1: a multi-step chunk, every item a decode)

    @property
    def decodes(self) -> list[ScheduledSequence]:
        return self.scheduled[: self.num_decodes]

    @property
    def prefills(self) -> list[ScheduledSequence]:
        return self.scheduled[self.num_decodes :]

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def _priority_key(seq: Sequence) -> tuple[int, int]:
    # Ascending: the first is served first, the last is the next preemption victim.
    return (seq.lane, seq.admission_index)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager | ShardedBlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] | list[int] = (),
        enable_chunked_prefill: bool = True,
        realtime_max_prompt_tokens: int = 512,
        bulk_min_prompt_tokens: int = 2048,
        aging_steps: int = 64,
        num_scheduler_steps: int = 1,
    ):
        for name, value in [
            ("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", max_model_len), ("aging_steps", aging_steps),
            ("num_scheduler_steps", num_scheduler_steps),
        ]:
            if value < 1:
                raise ValueError(f"{name}={value}: accepted an int >= 1")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens}: accepted >= "
                f"max_num_seqs={max_num_seqs}, so every running sequence can decode in one step"
            )
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens}: without chunked prefill, accepted >= "
                f"max_model_len={max_model_len}, or a long prompt could never be scheduled"
            )
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.enable_chunked_prefill = enable_chunked_prefill
        self.realtime_max_prompt_tokens = realtime_max_prompt_tokens
        self.bulk_min_prompt_tokens = bulk_min_prompt_tokens
        self.aging_steps = aging_steps
        self.num_scheduler_steps = num_scheduler_steps

        self.waiting: dict[Lane, collections.deque[Sequence]] = {lane: collections.deque() for lane in Lane}
        self.running: list[Sequence] = []  # sorted by _priority_key
        self._requests: dict[str, Sequence] = {}  # unfinished, by request_id
        self.step = 0  # number of schedule() calls so far
        self._num_admissions = 0
        self.num_preemptions = 0
        self.num_finished = 0  # including aborted
        self.num_aborted = 0

    # ---- queue state ----------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return sum(len(queue) for queue in self.waiting.values())

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def waiting_seqs(self) -> list[Sequence]:
        """Waiting sequences in the order they would be admitted."""
        return [seq for lane in Lane for seq in self.waiting[lane]]

    def get(self, request_id: str) -> Sequence | None:
        return self._requests.get(request_id)

    # ---- requests in --------------------------------------------------------------------------

    def lane_for(self, seq: Sequence) -> Lane:
        priority, num_prompt = seq.sampling_params.priority, seq.num_prompt_tokens
        if priority == "realtime" and num_prompt <= self.realtime_max_prompt_tokens:
            return Lane.REALTIME
        if priority == "bulk" or num_prompt > self.bulk_min_prompt_tokens:
            return Lane.BULK
        return Lane.DEFAULT

    def add(self, seq: Sequence) -> None:
        rid = seq.request_id
        if rid in self._requests:
            raise ValueError(f"request_id={rid!r}: already scheduled; accepted a new id")
        if seq.status is not SequenceStatus.WAITING or seq.output_token_ids or seq.block_table:
            raise ValueError(f"request {rid!r}: accepted a fresh WAITING sequence, got status={seq.status}")
        num_prompt, max_tokens = seq.num_prompt_tokens, seq.sampling_params.max_tokens
        if num_prompt == 0:
            raise ValueError(f"request {rid!r}: prompt is empty; accepted at least 1 token")
        if num_prompt + max_tokens > self.max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt tokens {num_prompt} + max_tokens {max_tokens} = "
                f"{num_prompt + max_tokens} exceeds max_model_len={self.max_model_len}"
            )
        # The last sampled token is never computed, so this is the most KV the request ever holds.
        num_blocks = self.block_manager.num_blocks_for(num_prompt + max_tokens - 1)
        if num_blocks > self.block_manager.num_blocks_per_shard:
            raise ValueError(
                f"request {rid!r}: prompt tokens {num_prompt} + max_tokens {max_tokens} need {num_blocks} "
                f"KV blocks, more than the whole pool of {self.block_manager.num_blocks_per_shard}"
            )
        seq.lane = self.lane_for(seq)
        seq.arrival_step = seq.waiting_since_step = self.step
        self.waiting[seq.lane].append(seq)
        self._requests[rid] = seq

    # ---- one step -------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.step += 1
        budget = self.max_num_batched_tokens
        scheduled: dict[Sequence, int] = {}  # insertion order is running order, then admissions
        preempted: list[Sequence] = []

        # Decodes get the budget before prefill chunks: a long prompt must not stall generation.
        decodes, prefilling = [], []
        for seq in self.running:
            (decodes if seq.is_decoding else prefilling).append(seq)
        # A multi-step chunk only when nothing else would run: no prompt to prefill, none waiting to be admitted.
        chunk = self.num_scheduler_steps if decodes and not prefilling and not self.num_waiting else 1
        steps: dict[Sequence, int] = {}
        for seq in decodes + prefilling:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted to make room for one ahead of it
                continue
            if seq.num_output_tokens >= seq.sampling_params.max_tokens:  # its last token is still pending
                continue
            num_remaining = seq.num_tokens - seq.num_computed_tokens
            num_new = min(num_remaining, budget)
            # cache slots it needs: a multi-step chunk writes one a step (the decoded token, then each sampled one
            # but the last)
            room = num_new
            if chunk > 1:
                room = steps[seq] = self._chunk_steps(seq, chunk)
            if num_new < num_remaining and not self.enable_chunked_prefill:
                continue
            if self.block_manager.num_blocks_to_append(seq, room) == 0:
                scheduled[seq] = num_new  # its blocks have room (most decode steps): nothing to allocate
                budget -= num_new
                continue
            # Allocation evicts cached blocks first, then (with a compressed pool) old blocks are
            # compressed; only when those run out do we preempt (the memory-pressure ladder). The
            # victim is the last in priority order: BULK before DEFAULT before REALTIME, most
            # recently admitted first, among those in seq's pool (data-parallel attention splits
            # the cache); it may be seq itself.
            if not self.block_manager.can_append(seq, room) and self.block_manager.num_compressed_blocks:
                # Before preempting anyone: move old blocks to the compressed pool, lowest priority first.
                self.block_manager.relieve_pressure(list(reversed(self.running)),
                                                    self.block_manager.num_blocks_to_append(seq, room))
            while not self.block_manager.can_append(seq, room):
                victim = self._victim_for(seq)
                budget += scheduled.pop(victim, 0)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.append(seq, room)
                scheduled[seq] = num_new
                budget -= num_new

        # Admitting while others are being preempted would only thrash; but never return an empty step.
        if not preempted or not scheduled:
            budget = self._admit(scheduled, budget)
        # A chunk that lost a sequence to preemption, or gained a prompt (every running one was preempted), runs
        # as one step: the room taken for the rest is used by the steps after it. One whose sequences all take a
        # single step (each one token from its max_tokens) runs as one step too.
        if preempted or any(not seq.is_decoding for seq in scheduled) or max(steps.values(), default=1) == 1:
            chunk = 1

        self._age_waiting()
        items = [
            ScheduledSequence(
                seq=seq, num_scheduled_tokens=n, num_computed_tokens=seq.num_computed_tokens,
                is_decode=seq.is_decoding, do_sample=seq.num_computed_tokens + n == seq.num_tokens,
                num_steps=steps[seq] if chunk > 1 else 1,
            )
            for seq, n in scheduled.items()
        ]
        items.sort(key=lambda item: not item.is_decode)  # stable: keeps priority order in each group
        return SchedulerOutput(
            step=self.step,
            scheduled=items,
            num_decodes=sum(item.is_decode for item in items),
            num_batched_tokens=self.max_num_batched_tokens - budget,
            preempted=preempted,
            num_steps=chunk,
        )

    def _chunk_steps(self, seq: Sequence, chunk: int) -> int:
        """The decode steps of a multi-step chunk seq takes: at most ``chunk``, none past its max_tokens, and none
        past the min_tokens that still mask its EOS (the mask is one flag a chunk)."""
        params = seq.sampling_params
        steps = min(chunk, params.max_tokens - seq.num_output_tokens)
        if not params.ignore_eos and seq.num_output_tokens < params.min_tokens:
            steps = min(steps, params.min_tokens - seq.num_output_tokens)
        return steps

    def _victim_for(self, seq: Sequence) -> Sequence:
        shard = self.block_manager.shard_of(seq)
        return next(s for s in reversed(self.running) if self.block_manager.shard_of(s) == shard)

    def _preempt(self, seq: Sequence) -> None:
        # Recompute, not swap: outputs are kept and re-prefilled with the prompt on re-admission.
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        seq.waiting_since_step = self.step
        self.waiting[seq.lane].appendleft(seq)  # first back in: it already waited its turn
        self.num_preemptions += 1

    def _admit(self, scheduled: dict[Sequence, int], budget: int) -> int:
        """Admit waiting sequences in lane order, FCFS within a lane; returns the budget left.

        Stops at the first that does not fit, so a later or lower-lane request never overtakes it.
        """
        while budget > 0 and len(self.running) < self.max_num_seqs:
            lane = next((lane for lane in Lane if self.waiting[lane]), None)
            if lane is None:
                break
            seq = self.waiting[lane][0]
            if seq.has_pending_token:  # preempted while its last token was in flight: prefill it once known
                break
            num_new = seq.num_tokens - self.block_manager.get_num_cached_tokens(seq)
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            if not self.block_manager.can_allocate(seq, num_new):
                break
            self.waiting[lane].popleft()
            self.block_manager.allocate(seq, num_new)
            seq.num_computed_tokens = seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            seq.admission_index = self._num_admissions
            self._num_admissions += 1
            bisect.insort(self.running, seq, key=_priority_key)
            scheduled[seq] = num_new
            budget -= num_new
        return budget

    def _age_waiting(self) -> None:
        """Promote one lane every sequence passed over for aging_steps steps, so none starves."""
        for lane in (Lane.DEFAULT, Lane.BULK):
            queue, kept = self.waiting[lane], collections.deque()
            for seq in queue:
                if self.step - seq.waiting_since_step >= self.aging_steps:
                    seq.lane = Lane(lane - 1)
                    seq.waiting_since_step = self.step
                    self.waiting[seq.lane].append(seq)
                else:
                    kept.append(seq)
            self.waiting[lane] = kept

    # ---- results in -----------------------------------------------------------------------------

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Sequence]:
        """commit() then resolve(), for a step whose tokens are already known; returns the sequences
        finished now."""
        self.commit(output)
        return [item.seq for item in self.resolve(output, sampled) if item.seq.is_finished]

    def commit(self, output: SchedulerOutput) -> None:
        """The step is on its way: its tokens count as computed, and each sequence it samples for gets
        a PENDING_TOKEN, so the next schedule() can already decode it."""
        for item in output.scheduled:
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:  # aborted between schedule() and now
                continue
            # a chunk's further steps each compute the token sampled by the step before
            seq.num_computed_tokens += item.num_scheduled_tokens + item.num_steps - 1
            if item.do_sample:
                seq.output_token_ids.extend([PENDING_TOKEN] * item.num_steps)
            self.block_manager.cache_full_blocks(seq)

    def resolve(self, output: SchedulerOutput, sampled: dict[str, int | list[int]]) -> list[ScheduledSequence]:
        """The committed step's sampled tokens replace their PENDING_TOKENs and stop conditions are
        checked. sampled: a token a sequence, or a multi-step chunk's tokens (item.num_steps of them, or
        more: the rest is ignored). Returns the items that received a token (not those finished or
        aborted meanwhile: their token was computed for nothing and is dropped); of a chunk, the tokens
        up to the first that ends the sequence are taken (seq.output_token_ids ends there)."""
        received = []
        for item in output.scheduled:
            seq = item.seq
            if not item.do_sample or seq.is_finished:
                continue
            index = item.num_computed_tokens + item.num_scheduled_tokens - seq.num_prompt_tokens
            if index >= seq.num_output_tokens or seq.output_token_ids[index] != PENDING_TOKEN:
                continue  # never committed
            if seq.request_id not in sampled:
                raise KeyError(f"request {seq.request_id!r}: step {output.step} owes it a sampled token")
            tokens = sampled[seq.request_id]
            status = None
            for step, token_id in enumerate([tokens] if isinstance(tokens, int) else tokens[:item.num_steps]):
                seq.output_token_ids[index + step] = token_id
                status, stop_reason = self._check_stop(seq, token_id, index + step + 1)
                if status is not None:
                    del seq.output_token_ids[index + step + 1:]  # the chunk's steps after the stop
                    break
            received.append(item)
            if item.num_steps > 1 and seq.status is SequenceStatus.RUNNING:  # blocks full of the chunk's tokens,
                # pending at commit (hashed before finish frees them; a preempted sequence's are gone)
                self.block_manager.cache_full_blocks(seq)
            if status is not None:
                self.finish(seq, status, stop_reason)
        return received

    def _check_stop(self, seq: Sequence, token_id: int, num_outputs: int) -> tuple[SequenceStatus | None, int | None]:
        """Whether seq ends with token_id, its num_outputs-th output token."""
        params = seq.sampling_params
        # Stop strings are the detokenizer's job: the engine calls finish() for them.
        if num_outputs >= params.min_tokens:
            if token_id in self.eos_token_ids and not params.ignore_eos:
                return SequenceStatus.FINISHED_STOPPED, None
            if token_id in params.stop_token_ids:
                return SequenceStatus.FINISHED_STOPPED, token_id
        if num_outputs >= params.max_tokens:
            return SequenceStatus.FINISHED_LENGTH, None
        return None, None

    def finish(self, seq: Sequence, status: SequenceStatus, stop_reason: int | str | None = None) -> None:
        """End seq (running or waiting) with a finished status and free its blocks."""
        if not status.is_finished:
            raise ValueError(f"status={status}: accepted a FINISHED_* status")
        if self._requests.get(seq.request_id) is not seq:
            raise ValueError(f"request {seq.request_id!r}: not an unfinished request of this scheduler")
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting[seq.lane].remove(seq)
        self.block_manager.free(seq)
        seq.status = status
        seq.finish_reason = finish_reason_of(status)
        seq.stop_reason = stop_reason
        del self._requests[seq.request_id]
        self.num_finished += 1
        self.num_aborted += status is SequenceStatus.FINISHED_ABORTED

    def abort(self, request_id: str) -> Sequence | None:
        """Abort an unfinished request; returns it, or None if unknown or already finished."""
        seq = self._requests.get(request_id)
        if seq is not None:
            self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return seq

    def check_invariants(self) -> None:
        """Block manager invariants plus queue bookkeeping; AssertionError on the first break."""
        self.block_manager.check_invariants(live_seqs=self.running)
        if len(self.running) > self.max_num_seqs:
            raise AssertionError(f"{len(self.running)} running > max_num_seqs={self.max_num_seqs}")
        if self.running != sorted(self.running, key=_priority_key):
            raise AssertionError("running is not sorted by (lane, admission_index)")
        for seq in self.running:
            if seq.status is not SequenceStatus.RUNNING or seq.num_computed_tokens >= seq.num_tokens:
                raise AssertionError(
                    f"running request {seq.request_id!r}: status={seq.status}, num_computed_tokens="
                    f"{seq.num_computed_tokens}, num_tokens={seq.num_tokens}"
                )
        for lane, queue in self.waiting.items():
            for seq in queue:
                if seq.status is not SequenceStatus.WAITING or seq.lane is not lane or seq.block_table:
                    raise AssertionError(
                        f"waiting request {seq.request_id!r} in lane {lane.name}: status={seq.status}, "
                        f"lane={seq.lane.name}, {len(seq.block_table)} blocks"
                    )
        if len(self._requests) != self.num_running + self.num_waiting:
            raise AssertionError(f"{len(self._requests)} unfinished != {self.num_running} running "
                                 f"+ {self.num_waiting} waiting")

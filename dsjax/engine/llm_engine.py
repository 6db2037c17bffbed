"""LLMEngine: requests in, one scheduler + runner step at a time, RequestOutputs out."""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import time

import jax

from dsjax.config import ConfigError, EngineConfig
from dsjax.engine.detokenizer import IncrementalDetokenizer
from dsjax.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from dsjax.engine.runner import ModelRunner, StepHandle
from dsjax.engine.step_inputs import RowSampling
from dsjax.engine.sampling_params import SamplingParams
from dsjax.engine.scheduler import Scheduler, SchedulerOutput
from dsjax.engine.sequence import Sequence, SequenceStatus
from dsjax.kv.block_manager import BlockManager
from dsjax.kv.sharded import ShardedBlockManager
from dsjax.model.paged import PagedKVCache
from dsjax.parallel.mesh import num_batch_shards

log = logging.getLogger(__name__)

DEFAULT_DEVICE_FRACTION = 0.9
_ACTIVATION_BYTES_PER_TOKEN = 64 << 10  # headroom per batched token for a step's activations


def kv_cache_num_blocks(model_config, config: EngineConfig, dtype, num_shards: int = 1) -> int:
    """Pool size from num_kv_blocks (all ranks), kv_cache_memory (bytes or a fraction of free memory, per
    device), or the default; a multiple of num_shards, the data-parallel ranks that split the pool."""
    per_block = PagedKVCache.bytes_per_block(model_config, config.block_size, dtype, config.kv_cache_dtype,
                                             config.kv_cache_group_size)
    whole = lambda n: -(-n // num_shards) * num_shards
    if config.num_kv_blocks is not None:
        return whole(config.num_kv_blocks)
    memory = config.kv_cache_memory
    if isinstance(memory, int):
        return num_shards * max(1, memory // per_block)
    stats = jax.local_devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
    if stats and "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    elif memory is None:  # CPU default: every running sequence can reach max_model_len on its rank
        return num_shards * -(-config.max_num_seqs // num_shards) * config.max_blocks_per_seq
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // jax.local_device_count()
    free -= config.max_num_batched_tokens * _ACTIVATION_BYTES_PER_TOKEN
    return num_shards * max(1, int(free * (memory or DEFAULT_DEVICE_FRACTION)) // per_block)


def kv_pool_sizes(model_config, config: EngineConfig, dtype, num_shards: int = 1) -> tuple[int, int]:
    """(full-precision blocks, compressed blocks). Without full_precision_window: the one pool, in
    kv_cache_dtype. With it, the same budget (num_kv_blocks counts model-dtype blocks' worth) holds
    the recent windows of max_num_seqs sequences plus one step's new tokens at full precision, and
    the rest as compressed blocks."""
    if config.full_precision_window is None:
        return kv_cache_num_blocks(model_config, config, dtype, num_shards), 0
    total = kv_cache_num_blocks(model_config, config.replace(kv_cache_dtype="auto", kv_cache_group_size=None,
                                                             full_precision_window=None), dtype, num_shards)
    full_bytes = PagedKVCache.bytes_per_block(model_config, config.block_size, dtype)
    compressed_bytes = PagedKVCache.bytes_per_block(model_config, config.block_size, dtype, config.kv_cache_dtype,
                                                    config.kv_cache_group_size)
    window_blocks = -(-config.full_precision_window // config.block_size) + 2
    num_full = config.max_num_seqs * window_blocks + -(-config.max_num_batched_tokens // config.block_size)
    if num_full >= total:  # a budget too small for every window: still keep a quarter for older blocks
        num_full = max(1, total * 3 // 4)
    return num_full, max(1, (total - num_full) * full_bytes // compressed_bytes)


class StepFailedError(RuntimeError):
    """One engine step raised; the requests it held (``request_ids``) were aborted, others go on."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"engine step failed ({type(cause).__name__}: {cause}); aborted {len(request_ids)} request(s)")
        self.request_ids = request_ids


@dataclasses.dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    seeds: list[int]
    detokenizers: list[IncrementalDetokenizer]
    logprobs: list[list[dict[int, float]]]
    cumulative_logprob: list[float]
    metrics: RequestMetrics
    final_only: bool = False

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)


class LLMEngine:
    def __init__(self, model, tokenizer, config: EngineConfig | None = None, *, progress: bool = True):
        config = config or EngineConfig()
        if config.max_model_len > model.config.max_position_embeddings:
            raise ConfigError(f"max_model_len={config.max_model_len} exceeds the model's "
                              f"max_position_embeddings={model.config.max_position_embeddings}")
        num_shards = num_batch_shards(model.mesh)
        if config.num_scheduler_steps > 1 and model.mesh is not None:
            raise ConfigError(f"num_scheduler_steps={config.num_scheduler_steps}: multi-step decoding runs on one "
                              "device; accepted: 1 with a mesh (tensor, expert or data parallelism)")
        num_blocks, num_compressed = kv_pool_sizes(model.config, config, model.dtype, num_shards)
        # (label, blocks, kv_cache_dtype, group size) of each pool: one, or full precision + older blocks.
        pools = [("", num_blocks, config.kv_cache_dtype, config.kv_cache_group_size)]
        if num_compressed:
            pools = [("", num_blocks, "auto", None),
                     (" (older blocks)", num_compressed, config.kv_cache_dtype, config.kv_cache_group_size)]
        for label, count, kind, group in pools:
            per_block = PagedKVCache.bytes_per_block(model.config, config.block_size, model.dtype, kind, group)
            log.warning("KV cache%s: %d blocks x %d tokens = %d tokens, %.3f GiB (%d bytes a token over %d layers, "
                        "latent %s)%s", label, count, config.block_size, count * config.block_size,
                        count * per_block / 2**30, per_block // config.block_size, model.config.num_hidden_layers,
                        kind + (f"/{group}" if group else ""),
                        f", in {num_shards} data-parallel slices" if num_shards > 1 else "")
        eos = tuple(sorted(set(model.config.eos_token_ids) | set(getattr(tokenizer, "eos_token_ids", ()))))
        self._setup_host(config, tokenizer, num_blocks, eos, num_shards, num_compressed)
        start = time.perf_counter()
        self.runner = ModelRunner(model, config, self.num_blocks, self.eos_token_ids, progress=progress,
                                  num_compressed_blocks=num_compressed,
                                  shard_of=self.block_manager.shard_of)
        self.warmup_seconds = time.perf_counter() - start

    def _setup_host(self, config: EngineConfig, tokenizer, num_blocks: int, eos_token_ids: tuple[int, ...],
                    num_shards: int = 1, num_compressed_blocks: int = 0):
        """Everything but the runner: block manager, scheduler, request bookkeeping."""
        self.config = config
        self.tokenizer = tokenizer
        self.num_blocks = num_blocks
        self.eos_token_ids = eos_token_ids
        if num_shards == 1:
            self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                              num_compressed_blocks)
        else:
            self.block_manager = ShardedBlockManager(num_shards, num_blocks // num_shards, config.block_size,
                                                     config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len,
            eos_token_ids=eos_token_ids, enable_chunked_prefill=config.enable_chunked_prefill,
            realtime_max_prompt_tokens=config.realtime_max_prompt_tokens,
            bulk_min_prompt_tokens=config.bulk_min_prompt_tokens, aging_steps=config.aging_steps,
            num_scheduler_steps=config.num_scheduler_steps)
        self._requests: dict[str, _Request] = {}
        self._owner: dict[str, tuple[_Request, int]] = {}  # sequence id -> (request, child index)
        self._seed_rng = random.Random(config.seed)
        self._ladder_logged: set[str] = set()
        # Async scheduling: the step on the device whose results are not read yet, and the rows of
        # its result that hold each sequence's PENDING_TOKEN.
        self._in_flight: tuple[SchedulerOutput, StepHandle] | None = None
        self._pending_rows: dict[Sequence, int] = {}
        self.num_steps = 0
        self.warmup_seconds = 0.0

    # ----- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None, params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None, *, final_only: bool = False) -> None:
        """Queues a request. ``final_only``: step() reports it only once finished (offline use; saves
        building the growing output every step)."""
        params = params or SamplingParams()
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        ids = list(prompt_token_ids) if prompt_token_ids is not None else self.tokenizer.encode(prompt)
        if not ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(f"logprobs={params.logprobs} exceeds max_logprobs={self.config.max_logprobs}")
        base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(31)
        seqs = [Sequence(request_id if params.n == 1 else f"{request_id}-{i}", ids, params) for i in range(params.n)]
        for seq in seqs[:1]:
            self.scheduler.add(seq)  # refuses prompts that can never fit, before any child is queued
        for seq in seqs[1:]:
            self.scheduler.add(seq)
        request = _Request(
            request_id, prompt, ids, params, seqs, [base_seed + i for i in range(params.n)],
            [IncrementalDetokenizer(self.tokenizer, ids, params.stop, deferred=final_only and not params.stop)
             for _ in seqs],
            [[] for _ in seqs], [0.0] * params.n, RequestMetrics(arrival_time=time.time()), final_only)
        self._requests[request_id] = request
        for i, seq in enumerate(seqs):
            self._owner[seq.request_id] = (request, i)

    def abort_request(self, request_id: str) -> bool:
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.abort(seq.request_id)
            self._owner.pop(seq.request_id, None)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # ----- one step -------------------------------------------------------------------------------
    def _row(self, seq: Sequence) -> RowSampling:
        request, index = self._owner[seq.request_id]
        p = request.params
        return RowSampling(
            temperature=float(p.temperature), top_k=p.top_k, top_p=float(p.top_p), seed=request.seeds[index],
            counter=seq.num_output_tokens,
            mask_eos=seq.num_output_tokens < p.min_tokens and not p.ignore_eos,
            num_logprobs=p.logprobs or 0)

    def step(self) -> list[RequestOutput]:
        """Runs one model step; returns the outputs of the requests that advanced.

        With async_scheduling the step is queued on the device and the previous one's results are
        read (and returned) while it runs: a request's token reaches the caller one call later, and
        the host's work overlaps the device's instead of adding to it."""
        out = self.scheduler.schedule()
        self._log_ladder()
        ready, self._in_flight = self._in_flight, None
        launched = None
        if not out.is_empty:
            launched = (out, self._launch(out, ready))
            if not self.config.async_scheduling:
                self.scheduler.commit(out)
                ready, launched = launched, None
        outputs = self._complete(*ready, also_failed=launched) if ready is not None else []
        if launched is not None:  # committed only now: the previous step's pending tokens are known
            self.scheduler.commit(out)
            self._pending_rows = {item.seq: int(row) for item, row in zip(out.scheduled, launched[1].row_of)
                                  if item.do_sample}
            self._in_flight = launched
        self._compress_old_blocks()
        return outputs

    def _launch(self, out: SchedulerOutput, in_flight) -> StepHandle:
        try:
            # Partial prefix-cache hits copy their cached block into the request's own first.
            copies = self.block_manager.take_block_copies()
            if copies:
                self.runner.copy_blocks(copies)
            # Block moves decided since the last forward (window or memory pressure) land first: the
            # tables of this step already point at their compressed copies.
            pending = self.block_manager.take_pending_copies()
            if pending:
                self.runner.compress(pending)
            handle = self.runner.dispatch(out, [self._row(item.seq) for item in out.scheduled], self._pending_rows)
        except Exception as e:
            raise StepFailedError(self._fail_step(out, in_flight), e) from e
        self.num_steps += 1
        return handle

    def _complete(self, out: SchedulerOutput, handle: StepHandle, also_failed=None) -> list[RequestOutput]:
        """Reads a dispatched, committed step's samples and hands them to their requests.
        also_failed: a step queued after it, which fails with it."""
        try:
            result = self.runner.fetch(handle)
        except Exception as e:
            raise StepFailedError(self._fail_step(out, also_failed), e) from e
        # Python numbers, in one pass; a multi-step chunk's are [num_seqs, steps]. Log-probabilities as a chunk's
        # in either case: a single step is a chunk of one.
        token_ids = result.token_ids.tolist()
        steps = result.token_ids.shape[1] if result.token_ids.ndim == 2 else 1
        logprobs = result.logprobs.reshape(len(token_ids), steps).tolist()
        top_ids = result.top_ids.reshape(len(token_ids), steps, result.top_ids.shape[-1])
        top_logprobs = result.top_logprobs.reshape(top_ids.shape)
        sampled = {item.seq.request_id: token_ids[i] for i, item in enumerate(out.scheduled) if item.do_sample}
        received = {id(item) for item in self.scheduler.resolve(out, sampled)}
        now = time.time()
        touched: dict[str, _Request] = {}
        for i, item in enumerate(out.scheduled):
            if id(item) not in received or item.seq.request_id not in self._owner:
                continue
            request, index = self._owner[item.seq.request_id]
            seq, detok = item.seq, request.detokenizers[index]
            request.metrics.first_token_time = request.metrics.first_token_time or now
            first = item.num_computed_tokens + item.num_scheduled_tokens - seq.num_prompt_tokens  # its output index
            # the tokens resolve() took: the chunk's up to the one that ended the sequence, if one did
            for step, token in enumerate(seq.output_token_ids[first:first + item.num_steps]):
                logprob = logprobs[i][step]
                request.cumulative_logprob[index] += logprob
                if request.params.logprobs is not None:
                    k = request.params.logprobs
                    entry = {int(t): float(lp) for t, lp in zip(top_ids[i, step, :k], top_logprobs[i, step, :k])}
                    entry[token] = logprob
                    request.logprobs[index].append(entry)
                detok.append(token)
                if detok.stop_reason is not None and not seq.is_finished:
                    del seq.output_token_ids[first + step + 1:]  # a chunk's tokens after the stop string
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED, detok.stop_reason)
                    break
            if seq.is_finished:
                detok.flush()
            touched[request.request_id] = request
        outputs = []
        for request in touched.values():
            finished = request.finished
            if finished:
                request.metrics.finished_time = now
                self._requests.pop(request.request_id, None)
                for seq in request.seqs:
                    self._owner.pop(seq.request_id, None)
            if finished or not request.final_only:
                outputs.append(self._output(request, finished))
        return outputs

    def _compress_old_blocks(self) -> None:
        """Distance-aware precision: blocks now wholly outside their sequence's recent window move to
        the compressed pool (host tables now, the device copy before the next forward)."""
        window = self.config.full_precision_window
        if window is None:
            return
        for seq in self.scheduler.running:
            self.block_manager.compress_outside_window(seq, window)

    # The memory-pressure ladder: what the engine does when KV blocks run out, in order. Each rung is
    # counted (stats(), /metrics) and logged the first time it is used; the server adds the last rung,
    # 503 + Retry-After once its queue is full.
    LADDER = (("num_prefix_evictions", "evicting least recently used prefix-cache blocks"),
              ("num_pressure_compressions", "compressing old KV blocks early into the 8-bit pool"),
              ("num_preemptions", "preempting the lowest-priority sequences (recomputed later)"))

    def ladder_counts(self) -> dict[str, int]:
        bm = self.block_manager
        return {"num_prefix_evictions": bm.num_evictions, "num_pressure_compressions": bm.num_pressure_compressions,
                "num_preemptions": self.scheduler.num_preemptions}

    def _log_ladder(self) -> None:
        counts = self.ladder_counts()
        for rung, (key, what) in enumerate(self.LADDER, start=1):
            if counts[key] and key not in self._ladder_logged:
                self._ladder_logged.add(key)
                log.warning("KV memory pressure, rung %d of %d: %s (first at step %d; counted in %s)", rung,
                            len(self.LADDER) + 1, what, self.num_steps + 1, key)

    def _fail_step(self, out: SchedulerOutput, in_flight=None) -> list[str]:
        """Aborts the requests of a failed step and of in_flight, a (SchedulerOutput, StepHandle)
        queued with it (all running ones if the cache was lost with them)."""
        seqs = [item.seq for item in out.scheduled]
        if in_flight is not None:
            seqs += [item.seq for item in in_flight[0].scheduled]
        if self.runner.cache_was_reset:  # every sequence's KV is gone, cached prefixes too
            self.runner.cache_was_reset = False
            seqs += list(self.scheduler.running)
        failed = list(dict.fromkeys(self._owner[s.request_id][0].request_id for s in seqs
                                    if s.request_id in self._owner))
        for request_id in failed:
            self.abort_request(request_id)
        self.block_manager.reset_prefix_cache()
        return failed

    def _output(self, request: _Request, finished: bool) -> RequestOutput:
        """The request's outputs so far; ``finished``: request.finished, which the caller has computed."""
        seqs = request.seqs
        request.metrics.num_preemptions = (seqs[0].num_preemptions if len(seqs) == 1 else
                                           sum(seq.num_preemptions for seq in seqs))
        completions = [
            CompletionOutput(
                index=i, text=request.detokenizers[i].text, token_ids=list(seq.output_token_ids),
                cumulative_logprob=request.cumulative_logprob[i],
                logprobs=list(request.logprobs[i]) if request.params.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)
            for i, seq in enumerate(seqs)]
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions,
                             finished, request.metrics, seqs[0].num_cached_tokens)

    # ----- introspection ---------------------------------------------------------------------------
    def stats(self) -> dict:
        bm = self.block_manager
        return {
            "prefix_cache_hit_rate": bm.prefix_cache_hit_rate,
            "num_blocks_total": bm.num_blocks_total, "num_blocks_free": bm.num_blocks_free,
            "num_blocks_cached": bm.num_blocks_cached, "num_blocks_used": bm.num_blocks_used,
            "padding_ratio": self.runner.padding_ratio, "num_compiled_shapes": self.runner.num_compiled_shapes,
            "buckets": list(self.runner.buckets.sizes), "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps, "warmup_seconds": self.warmup_seconds,
            "compile_seconds": self.runner.compile_seconds,
            "num_running": self.scheduler.num_running, "num_waiting": self.scheduler.num_waiting,
            "prefix_cache_queries": bm.num_prefix_query_tokens, "prefix_cache_hits": bm.num_prefix_hit_tokens,
            "num_blocks_compressed": bm.num_blocks_compressed, **self.ladder_counts(),
        }

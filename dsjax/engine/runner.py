"""The model runner: the only place that jits. Turns a scheduler decision into fixed-shape arrays and
runs one compiled, cache-donating step (forward over the packed tokens + sampling).

Shapes come from token-count buckets: a step of n tokens runs at T = buckets.pick(n) with
S = min(T, max_num_seqs) sequence rows and max_blocks_per_seq block-table columns, so the compiled
set is one program per bucket, all compiled at start.

With a mesh the step runs per device inside one shard_map (docs/parallelism.md). Its P = data x
expert ranks each own a slice of the KV cache and the sequences placed there (ShardedBlockManager):
the step's arrays are P slices of T tokens and S rows, rank p's at [p*T, (p+1)*T), with block ids
local to its slice, and T is the bucket of the busiest rank. The sampled tokens come back gathered
and replicated, so every process of a multi-host run reads them.

A step is two programs: the forward (per bucket: tokens -> cache writes and the sampled rows'
logits) and the sampler (per bucket and the batch's sampling features: top-k/top-p filtering,
logprobs, decided on the host), traced from ``StepPrograms`` (dsjax/engine/step_programs.py).
Nothing in either waits on the host. Without a mesh both take the step's inputs as one int32 vector
(``StepLayout.pack``), sent to the device in one transfer.

Multi-step chunks (``num_scheduler_steps``, no mesh): a decode-only step may run as up to that many forward +
sample steps in one program (``StepPrograms.forward_steps``), each step's samples the next one's tokens, one
cache slot a step and row (none past a row's own count of steps); the host launches and reads once a chunk.

Async scheduling: dispatch() returns as soon as the step is queued; fetch() reads its sampled tokens.
Each step also returns its tokens as a device array of max_num_seqs rows per rank (``last_tokens``),
and the next step takes any token whose value the host does not know yet (a PENDING_TOKEN) from it:
``token_sources`` names the row, so the host never waits for a step before queuing the next.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from dsjax.config import EngineConfig
from dsjax.engine.buckets import Buckets
from dsjax.engine.sampler import SampleResult
from dsjax.engine.scheduler import SchedulerOutput
from dsjax.engine.sequence import Sequence
from dsjax.engine.step_inputs import RowSampling, StepInputs, StepLayout
from dsjax.engine.step_programs import StepPrograms
from dsjax.model.dispatch import compiler_options
from dsjax.model.paged import PagedKVCache
from dsjax.parallel.mesh import num_batch_shards
from dsjax.parallel.sharding import CACHE_SPEC, batch_spec, checks_vma, param_specs

log = logging.getLogger(__name__)

# Whether a bucket whose forward runs the batch-1 step kernel keeps XLA's command buffers (CUDA graphs). That
# forward is ~34 ops, and XLA re-records its graph on every call (the inputs, last_tokens and logits move): on the
# H200 the step ran ~25 µs faster with graphs off (decode_profile.md round 32). Now that a greedy step is one program
# the graph is ahead on the device, 1.6767 against 1.6834 ms in two rounds (round 39), but the engine with it ran
# inside the swing of one process to the next (589 against 586 tok/s, round 36), and the sampled steps' two programs,
# which round 32 timed slower with the graph, were not timed again: off. Read when compiling; the other buckets
# (hundreds of launches a step) keep their graphs.
STEP_KERNEL_GRAPHS = False
# Whether a bucket whose forward runs the batch-1 step kernel also compiles that forward with the greedy sampler
# inside, for its steps whose rows all decode greedily without log-probabilities: one program a step instead of
# two. The loop of round 32 (decode_profile.md) ran the forward alone 7 µs a step faster than forward + sampler,
# and each program's launch costs the host ~0.2-0.3 ms. Read when compiling. In the batch-1 compiled step (round 33,
# step_ab_round33_b1_h200.json): 1.7273 vs 1.7303 ms on the device, and the host's launch call 1.49 vs 1.63 ms.
GREEDY_IN_FORWARD = True
# Whether a multi-step chunk program (num_scheduler_steps > 1) of a bucket that runs the batch-1 step kernel keeps
# XLA's command buffers, which STEP_KERNEL_GRAPHS turns off for that bucket's forward. A chunk is a loop of steps
# whose kernels the host otherwise launches one by one, every step; as a CUDA graph (the loop a conditional node)
# one launch would queue them all. Read when compiling; not yet timed on the H200.
CHUNK_GRAPHS = False
# Whether dispatch() queues the step's device-to-host copy of its samples right behind the step (each array's
# copy_to_host_async), instead of leaving it to fetch(). With async scheduling the next step is queued before the
# previous one's samples are read; if the runtime orders that copy behind the work queued before it, a late
# copy waits out the whole next step and the host queues the step after it late (the device idle between them).
# Read at each dispatch; untimed on the H200 (benchmarks/engine_trace.py, run_h200.sh engine-trace), so off.
COPY_AT_DISPATCH = False


@dataclasses.dataclass
class StepHandle:
    """A dispatched step: its bucket, where each scheduled sequence's sample lands, the device result."""

    bucket: int
    row_of: np.ndarray  # i64[num_seqs]
    result: SampleResult
    num_batched_tokens: int


@dataclasses.dataclass
class StepResult:
    """A step's samples by scheduled sequence; a multi-step chunk's have a steps axis after the first."""

    token_ids: np.ndarray  # i32[num_seqs] (chunk: [num_seqs, steps])
    logprobs: np.ndarray  # f32[num_seqs]
    top_ids: np.ndarray  # i32[num_seqs, K] (K = 0 when no row asked for top log-probabilities)
    top_logprobs: np.ndarray  # f32[num_seqs, K]


def sampling_features(arrays) -> tuple[bool, bool, bool]:
    """A step's host sampling arrays -> (filtered, logprobs, greedy): whether some drawn row filters by top-k / top-p,
    whether some row asks for log-probabilities, whether every row decodes greedily; they pick the step's programs
    (a greedy step without log-probabilities is what ``compile_all``'s greedy_only compiles for)."""
    drawn = arrays.temperature > 0
    filtered = bool(np.any(drawn & ((arrays.top_k > 0) | (arrays.top_p < 1))))
    return filtered, bool(np.any(arrays.num_logprobs > 0)), not np.any(drawn)


class ModelRunner:
    """``shard_of(seq)``: the data-parallel rank whose cache slice holds seq's blocks (block ids in its
    table are local to that slice); ``num_blocks`` counts all slices."""

    def __init__(self, model, config: EngineConfig, num_blocks: int, eos_token_ids: tuple[int, ...] = (),
                 *, progress: bool = True, shard_of=None, num_compressed_blocks: int = 0):
        self.config = config
        self.model_config = model.config
        if why_not := model.prepare_step_kernel():  # one-token steps' MoE stack in one kernel, where it may run
            log.debug("batch-1 step kernel off: %s", why_not)
        self.graphdef, self.state = nnx.split(model)
        # the step takes the weights as a flat list: an nnx State flattens in Python on every call (~25 us a
        # launch on a CPU machine, against ~1.5 for the list)
        self._state_leaves, self._state_treedef = jax.tree.flatten(self.state)
        self.mesh = model.mesh
        self.num_shards = num_batch_shards(self.mesh)
        if num_blocks % self.num_shards:
            raise ValueError(f"num_blocks={num_blocks}: accepted a multiple of the {self.num_shards} "
                             "data-parallel ranks, which split the cache evenly")
        if num_compressed_blocks and self.mesh is not None:
            raise ValueError("full_precision_window (a compressed KV pool) runs on one device only; "
                             "accepted: no mesh, or full_precision_window=None")
        self.num_blocks = num_blocks
        self.num_blocks_per_shard = num_blocks // self.num_shards
        self.num_compressed_blocks = num_compressed_blocks
        self.shard_of = shard_of or (lambda seq: 0)
        # the cache slot of a bucket's padding tokens: past every pool (k_pe spans the compressed one too)
        padding_slot = (self.num_blocks_per_shard + num_compressed_blocks) * config.block_size
        self.layout = StepLayout(config, self.num_shards, self.mesh, padding_slot, self.shard_of)
        self.cache_dtype = model.dtype
        self.cache = self._zero_cache()
        self.eos_token_ids = tuple(eos_token_ids)
        self.progress = progress
        self.compiler_options = compiler_options(model.kernel_backend)
        self._packs = self.mesh is None  # the step's inputs as one vector (StepLayout.pack)
        self.programs = StepPrograms(self.graphdef, self._state_treedef, self.layout, config, self.eos_token_ids,
                                     self.num_shards, self._packs, lambda: self.buckets.sizes)
        forward = self.programs.forward
        if self.mesh is not None:
            specs = jax.tree.leaves(param_specs(self.state), is_leaf=lambda x: isinstance(x, P))  # as the leaves
            forward = jax.shard_map(forward, mesh=self.mesh, out_specs=(CACHE_SPEC, batch_spec(2)),
                                    in_specs=(specs, CACHE_SPEC, self.layout.specs()._replace(sampling=None), P()),
                                    check_vma=checks_vma(model.kernel_backend))
        self._jitted = jax.jit(forward, donate_argnums=(1,))
        self._step_kernel_blocker = model.step_kernel_blocker
        self._compress = jax.jit(PagedKVCache.compress_blocks, donate_argnums=(0,))
        copy_blocks = PagedKVCache.copy_blocks
        if self.mesh is not None:  # each rank copies within its own cache slice (local block ids)
            copy_blocks = jax.shard_map(copy_blocks, mesh=self.mesh, in_specs=(CACHE_SPEC, batch_spec(1), batch_spec(1)),
                                        out_specs=CACHE_SPEC)
        self._copy_blocks = jax.jit(copy_blocks, donate_argnums=(0,))
        self.last_tokens = self._zero_last_tokens()
        self._compiled: dict[int, jax.stages.Compiled] = {}  # bucket -> its forward
        # (bucket, filtered, logprobs, greedy) -> the sampler (``sample``'s static settings)
        self._samplers: dict[tuple[int, bool, bool, bool], jax.stages.Compiled] = {}
        self._greedy_forwards: dict[int, jax.stages.Compiled] = {}  # bucket -> its forward + greedy sampler
        self._complete: set[int] = set()  # buckets compile_all compiled whole (not greedy_only)
        # (bucket, filtered, logprobs, greedy) -> its multi-step chunk program (num_scheduler_steps > 1)
        self._chunks: dict[tuple[int, bool, bool, bool], jax.stages.Compiled] = {}
        self.num_compiled_shapes = 0
        self.compile_seconds = 0.0
        self.num_useful_tokens = 0  # scheduled tokens, summed over steps
        self.num_padded_tokens = 0  # tokens computed (bucket sizes), summed over steps
        self.step_sizes: list[int] = []  # useful tokens per step, kept only until quantile buckets are set
        if isinstance(config.buckets, tuple):
            self.buckets = Buckets(config.buckets)
        else:
            self.buckets = Buckets.pow2(1, config.max_num_batched_tokens)
        self._quantile_pending = config.buckets == "quantile"
        self.compile_all()

    # ----- compiled steps ------------------------------------------------------------------------
    def _sampler(self, t: int, filtered: bool, logprobs: bool, greedy: bool) -> jax.stages.Compiled:
        """The sampler of bucket t's rows, compiled on first use (the plain and the greedy ones with every
        bucket). Without a mesh it takes the step's packed vector, whose sampling fields it reads."""
        key = (t, filtered, logprobs, greedy)
        if key not in self._samplers:
            fn = functools.partial(self.programs.sample, filtered=filtered, logprobs=logprobs, greedy=greedy)
            if self.mesh is not None:
                specs = self.layout.specs().sampling
                fn = jax.shard_map(fn, mesh=self.mesh, in_specs=(batch_spec(2), specs), out_specs=P())
                sampling = self.layout.abstract(t).sampling
            else:
                fn = functools.partial(self.programs.sample_packed, fn)
                sampling = jax.ShapeDtypeStruct((self.layout.packed_length(t),), jnp.int32)
            logits = jax.ShapeDtypeStruct((self.num_shards * self.layout.num_rows(t), self.model_config.vocab_size),
                                          jnp.float32, sharding=None if self.mesh is None else
                                          NamedSharding(self.mesh, batch_spec(2)))
            self._samplers[key] = self._compile(jax.jit(fn), (logits, sampling))
        return self._samplers[key]

    def _chunk_program(self, t: int, filtered: bool, logprobs: bool, greedy: bool) -> jax.stages.Compiled:
        """Bucket t's multi-step chunk program for those sampling features, compiled on first use (the greedy
        one of every decode bucket with the rest, ``compile_all``)."""
        key = (t, filtered, logprobs, greedy)
        if key not in self._chunks:
            fn = functools.partial(self.programs.forward_steps, t=t, filtered=filtered, logprobs=logprobs,
                                   greedy=greedy)
            packed = jax.ShapeDtypeStruct((self.layout.packed_length(t) + self.layout.num_rows(t),), jnp.int32)
            args = (self._state_leaves, self.cache, packed, self._last_tokens_shape())
            options = self.compiler_options if CHUNK_GRAPHS else self._compiler_options(t)
            self._chunks[key] = self._compile(jax.jit(fn, donate_argnums=(1,)), args, options)
        return self._chunks[key]

    def runs_step_kernel(self, t: int) -> bool:
        """Whether bucket t's forward runs the batch-1 step kernel (``DeepseekForCausalLM.step_kernel_blocker``)."""
        return self._step_kernel_blocker(self.num_shards * t, self.cache, self.config.max_blocks_per_seq) is None

    def _last_tokens_shape(self) -> jax.ShapeDtypeStruct:
        sharding = None if self.mesh is None else NamedSharding(self.mesh, P())
        return jax.ShapeDtypeStruct((self.num_shards * self.config.max_num_seqs,), jnp.int32, sharding=sharding)

    def _zero_last_tokens(self) -> jax.Array:
        shape = self._last_tokens_shape()
        return jax.device_put(np.zeros(shape.shape, np.int32), shape.sharding)

    def _zero_cache(self) -> PagedKVCache:
        sharding = None if self.mesh is None else NamedSharding(self.mesh, CACHE_SPEC)
        return PagedKVCache.zeros(self.model_config, self.num_blocks, self.config.block_size, self.cache_dtype,
                                  sharding=sharding, kv_cache_dtype=self.config.kv_cache_dtype,
                                  group_size=self.config.kv_cache_group_size,
                                  num_compressed_blocks=self.num_compressed_blocks)

    def place_inputs(self, inputs: StepInputs) -> StepInputs:
        """Host arrays -> the mesh's devices: each receives its rank's slices (every process passes the
        same host arrays in a multi-host run). Without a mesh a step's inputs go packed (``StepLayout.pack``)."""
        return jax.device_put(inputs, self.layout.shardings())

    def compile_all(self, sizes=None, *, greedy_only: bool = False):
        """Compiles every bucket (or those of ``sizes``) ahead of time, so no request ever waits on the compiler.
        greedy_only: of each bucket only the program that a step whose rows all decode greedily without
        log-probabilities launches (the forward with the greedy sampler inside, where ``GREEDY_IN_FORWARD`` gives
        the bucket one; else the forward and the greedy sampler). A/Bs of such a step (benchmarks/step_profile.py)
        compile one step-kernel forward a variant, not two; a later compile_all without it compiles the rest."""
        greedy_ready = lambda t: t in self._greedy_forwards or t in self._compiled  # a greedy step could launch
        todo = [t for t in (self.buckets.sizes if sizes is None else sizes)
                if t not in self._complete and not (greedy_only and greedy_ready(t))]
        for t in tqdm(todo, desc="compiling step buckets", unit="shape", disable=not self.progress or not todo):
            inputs = self.layout.abstract(t)._replace(sampling=None)
            if self._packs:
                inputs = jax.ShapeDtypeStruct((self.layout.packed_length(t),), jnp.int32)
            args = (self._state_leaves, self.cache, inputs, self._last_tokens_shape())
            if not greedy_ready(t):  # new: a greedy_only call may have compiled part of it
                self.num_compiled_shapes += 1
                if GREEDY_IN_FORWARD and self._packs and self.runs_step_kernel(t):
                    greedy = jax.jit(self.programs.forward_greedy, donate_argnums=(1,))
                    self._greedy_forwards[t] = self._compile(greedy, args, self._compiler_options(t))
            if greedy_only and t in self._greedy_forwards:
                continue
            if t not in self._compiled:
                self._compiled[t] = self._compile(self._jitted, args, self._compiler_options(t))
            self._sampler(t, False, False, True)
            if greedy_only:
                continue
            if self.config.num_scheduler_steps > 1 and self._packs and t <= self.buckets.pick(self.config.max_num_seqs):
                self._chunk_program(t, filtered=False, logprobs=False, greedy=True)
            self._sampler(t, False, False, False)
            self._complete.add(t)

    def _compile(self, jitted, args, options=None) -> jax.stages.Compiled:
        """jitted lowered on abstract args and compiled with XLA ``options``, its time added to compile_seconds
        (every program of the runner compiles here, once, so none is counted twice)."""
        start = time.perf_counter()
        compiled = jitted.lower(*args).compile(options)
        self.compile_seconds += time.perf_counter() - start
        return compiled

    def clear_compiled(self):
        """Drops every compiled program (compile_all makes them again, e.g. after a knob read at trace time changed)."""
        self._compiled.clear()
        self._samplers.clear()
        self._greedy_forwards.clear()
        self._chunks.clear()
        self._complete.clear()

    def _compiler_options(self, t: int) -> dict | None:
        """XLA options of bucket t's forward: the backend's, and no command buffers where it runs the step kernel
        (``STEP_KERNEL_GRAPHS``)."""
        if STEP_KERNEL_GRAPHS or not self.runs_step_kernel(t):
            return self.compiler_options
        return {**(self.compiler_options or {}), "xla_gpu_enable_command_buffer": ""}

    def _maybe_requantize(self):
        """buckets="quantile": after the warm-up steps, re-derive the buckets from the observed sizes."""
        if not self._quantile_pending or len(self.step_sizes) < self.config.quantile_warmup_steps:
            return
        self._quantile_pending = False
        self.buckets = Buckets.quantile(self.step_sizes, self.config.num_quantile_buckets,
                                        self.config.max_num_batched_tokens)
        log.info("quantile buckets from %d steps: %s", len(self.step_sizes), self.buckets.sizes)
        self.step_sizes = []
        self.compile_all()

    # ----- one step ------------------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput, rows: list[RowSampling],
                pending_rows: dict[Sequence, int] | None = None) -> tuple[int, StepInputs, np.ndarray]:
        """Host-side packing of a step into the arrays of its bucket (numpy, no device work).
        pending_rows: for each sequence whose last token is still a PENDING_TOKEN, its row in the
        previous step's result (StepHandle.row_of).

        -> (bucket t, inputs, row i32[num_seqs]: where scheduled sequence i's sample comes back)."""
        by_shard = self.layout.by_shard(out)
        t = self.buckets.pick(max(sum(out.scheduled[i].num_scheduled_tokens for i in items) for items in by_shard))
        inputs, row_of = self.layout.arrays(out, rows, t, by_shard, pending_rows)
        return t, inputs, row_of

    def execute(self, out: SchedulerOutput, rows: list[RowSampling]) -> StepResult:
        """dispatch() and wait for its result."""
        return self.fetch(self.dispatch(out, rows))

    def dispatch(self, out: SchedulerOutput, rows: list[RowSampling],
                 pending_rows: dict[Sequence, int] | None = None) -> StepHandle:
        """Packs and queues one step; returns without waiting for the device."""
        if len(rows) != out.num_seqs:
            raise ValueError(f"{len(rows)} sampling rows for {out.num_seqs} scheduled sequences")
        t, inputs, row_of = self.prepare(out, rows, pending_rows)
        row_steps = None
        if out.num_steps > 1:  # a multi-step chunk: each row's count of steps
            if not self._packs:
                raise ValueError(f"a chunk of {out.num_steps} steps: multi-step decoding runs without a mesh")
            row_steps = np.zeros(self.layout.num_rows(t), np.int32)
            row_steps[row_of] = [item.num_steps for item in out.scheduled]
        result = self.launch(t, inputs, row_steps)
        if COPY_AT_DISPATCH:
            for array in jax.tree.leaves(result):
                array.copy_to_host_async()
        return StepHandle(t, row_of, result, out.num_batched_tokens)

    def launch(self, t: int, inputs: StepInputs, row_steps: np.ndarray | None = None) -> SampleResult:
        """Queues the forward of bucket t and its sampler on host inputs (from prepare); updates the
        cache and last_tokens, and returns the device result. row_steps: a multi-step chunk's count of
        steps for each of the bucket's rows (``StepPrograms.forward_steps``); its result has a steps axis after the
        rows'."""
        filtered, logprobs, greedy = sampling_features(inputs.sampling)
        one_program = self._greedy_forwards.get(t) if row_steps is None and greedy and not logprobs else None
        if one_program is None and t not in self._compiled:  # after buckets change, or a greedy_only compile_all
            self.compile_all()
        chunk = sampler = None
        if row_steps is not None:
            chunk = self._chunk_program(t, filtered, logprobs, greedy)
        elif one_program is None:
            sampler = self._sampler(t, filtered, logprobs, greedy)
        if self._packs:  # one transfer, every program's input (a chunk's row counts after the step's)
            packed = self.layout.pack(inputs)
            if chunk is not None:
                packed = np.concatenate([packed, row_steps])
            forward_inputs = sampling = jax.device_put(packed)
        else:
            placed = self.place_inputs(inputs)
            forward_inputs, sampling = placed._replace(sampling=None), placed.sampling
        try:
            if chunk is not None:
                self.cache, result, self.last_tokens = chunk(self._state_leaves, self.cache, forward_inputs,
                                                             self.last_tokens)
                return result
            if one_program:
                self.cache, result = one_program(self._state_leaves, self.cache, forward_inputs, self.last_tokens)
            else:
                self.cache, logits = self._compiled[t](self._state_leaves, self.cache, forward_inputs,
                                                       self.last_tokens)
                result = sampler(logits, sampling)
            self.last_tokens = result.token_ids  # padded to every row of last_tokens (StepPrograms.sample)
        except Exception:
            self._recover_cache()
            raise
        return result

    def fetch(self, handle: StepHandle) -> StepResult:
        """Waits for a dispatched step and reads its samples: the one host sync of a step."""
        try:
            result: SampleResult = jax.device_get(handle.result)
        except Exception:
            self._recover_cache()
            raise
        self.num_useful_tokens += handle.num_batched_tokens
        self.num_padded_tokens += self.num_shards * handle.bucket
        if self._quantile_pending:
            self.step_sizes.append(handle.num_batched_tokens)
            self._maybe_requantize()
        row_of = handle.row_of
        token_ids = result.token_ids[row_of]
        if result.top_ids is None:  # no row asked for top log-probabilities: the program made none
            return StepResult(token_ids, result.logprobs[row_of], np.zeros((*token_ids.shape, 0), np.int32),
                              np.zeros((*token_ids.shape, 0), np.float32))
        return StepResult(token_ids, result.logprobs[row_of], result.top_ids[row_of], result.top_logprobs[row_of])

    def compress(self, pairs: list[tuple[int, int]]) -> None:
        """Copies full-precision blocks into compressed ones (quantizing), (src, dst) global ids, before
        the next step reads the tables that now point at dst."""
        if not pairs:
            return
        src = np.zeros(_padded_count(len(pairs)), np.int32)
        dst = np.full(src.shape, self.num_blocks + self.num_compressed_blocks, np.int32)  # padding: dropped
        src[:len(pairs)], dst[:len(pairs)] = zip(*pairs)
        self.cache = self._compress(self.cache, src, dst)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copies whole full-precision blocks (src, dst) before the next step (partial prefix hits).
        Under a mesh the ids are global, rank r's pool holding [r * P, (r + 1) * P) for P blocks a rank,
        and every pair stays within one rank's pool."""
        if not pairs:
            return
        per = self.num_blocks_per_shard
        by_rank = [[] for _ in range(self.num_shards)]
        for src, dst in pairs:
            if src // per != dst // per:
                raise ValueError(f"copy of block {src} to {dst} crosses data-parallel pools of {per} blocks")
            by_rank[src // per].append((src % per, dst % per))
        size = _padded_count(max(map(len, by_rank)))
        src = np.zeros((self.num_shards, size), np.int32)
        dst = np.full((self.num_shards, size), per + self.num_compressed_blocks, np.int32)  # padding: dropped
        for rank, rank_pairs in enumerate(by_rank):
            if rank_pairs:
                src[rank, :len(rank_pairs)], dst[rank, :len(rank_pairs)] = zip(*rank_pairs)
        src, dst = src.reshape(-1), dst.reshape(-1)  # rank-major: each rank's slice of the split axis
        if self.mesh is not None:
            src, dst = (jax.device_put(a, NamedSharding(self.mesh, batch_spec(1))) for a in (src, dst))
        self.cache = self._copy_blocks(self.cache, src, dst)

    def _recover_cache(self):
        """A call that failed after donation leaves the cache deleted: start from a zeroed one, so
        later steps can run. Sets ``cache_was_reset``: every cached token is gone."""
        if any(leaf.is_deleted() for leaf in jax.tree.leaves(self.cache)):
            self.cache = self._zero_cache()
            self.cache_was_reset = True
        if self.last_tokens.is_deleted():
            self.last_tokens = self._zero_last_tokens()

    cache_was_reset = False

    @property
    def padding_ratio(self) -> float:
        padded = self.num_padded_tokens
        return (padded - self.num_useful_tokens) / padded if padded else 0.0


def _padded_count(num_pairs: int) -> int:
    """Block-copy lists are padded to a power of two (>= 8) so only a few shapes compile."""
    return max(8, 1 << (num_pairs - 1).bit_length())

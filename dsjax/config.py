"""Model configuration: a frozen dataclass parsed from a Hugging Face ``config.json``.

Every field that changes the math of DeepSeek-V2/V3 is here; anything we do not implement is refused
with an error that names the field, the value and what is accepted.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger(__name__)

MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")
ROPE_TYPES = ("default", "yarn")

PRESETS_DIR = Path(__file__).resolve().parents[1] / "configs" / "models"

# Hugging Face's per-model defaults for keys a config.json may leave out.
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v2": dict(
        vocab_size=102400, hidden_size=4096, intermediate_size=11008, moe_intermediate_size=1407,
        num_hidden_layers=32, num_attention_heads=32, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
        n_shared_experts=2, num_experts_per_tok=None, first_k_dense_replace=0, moe_layer_freq=1,
        n_group=None, topk_group=None, topk_method="greedy", scoring_func="softmax",
        norm_topk_prob=False, routed_scaling_factor=1.0, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_interleave=True, tie_word_embeddings=False, max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2, hidden_act="silu", attention_bias=False,
    ),
    "deepseek_v3": dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256,
        n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3, moe_layer_freq=1,
        n_group=8, topk_group=4, topk_method="noaux_tc", scoring_func="sigmoid",
        norm_topk_prob=True, routed_scaling_factor=2.5, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_interleave=True, tie_word_embeddings=False, max_position_embeddings=4096,
        bos_token_id=0, eos_token_id=1, hidden_act="silu", attention_bias=False,
    ),
}


class ConfigError(ValueError):
    """A configuration value we cannot run: names the field, the value and what is accepted."""


def _refuse(field: str, value: Any, accepted: str) -> ConfigError:
    return ConfigError(f"config field {field!r} = {value!r} is not supported; accepted: {accepted}")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention-temperature correction, 0.1·mscale·ln(scale) + 1 (1 when not extending)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """YaRN context extension as DeepSeek ships it (``rope_type: yarn``)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if not self.factor or self.factor <= 0:
            raise _refuse("rope_scaling.factor", self.factor, "a positive number")
        if not self.original_max_position_embeddings or self.original_max_position_embeddings <= 0:
            raise _refuse("rope_scaling.original_max_position_embeddings",
                          self.original_max_position_embeddings, "a positive integer")

    @property
    def cos_sin_scale(self) -> float:
        """Factor applied to cos/sin (so to q_pe and k_pe), as Hugging Face computes it."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    moe_layer_freq: int
    n_group: int
    topk_group: int
    topk_method: str
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    rope_interleave: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise _refuse("model_type", self.model_type, ", ".join(MODEL_TYPES))
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise _refuse(name, value, "a positive integer")
        if self.qk_rope_head_dim % 2:
            raise _refuse("qk_rope_head_dim", self.qk_rope_head_dim, "an even number")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise _refuse("q_lora_rank", self.q_lora_rank, "null (plain q_proj) or a positive integer")
        if self.topk_method not in TOPK_METHODS:
            raise _refuse("topk_method", self.topk_method, ", ".join(TOPK_METHODS))
        if self.scoring_func not in SCORING_FUNCS:
            raise _refuse("scoring_func", self.scoring_func, ", ".join(SCORING_FUNCS))
        if self.moe_layer_freq != 1:
            raise _refuse("moe_layer_freq", self.moe_layer_freq,
                          "1 (every layer from first_k_dense_replace on is MoE, as in all DeepSeek-V2/V3 releases)")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise _refuse("first_k_dense_replace", self.first_k_dense_replace,
                          f"an integer in [0, num_hidden_layers={self.num_hidden_layers}]")
        if self.num_moe_layers:
            if self.moe_intermediate_size <= 0:
                raise _refuse("moe_intermediate_size", self.moe_intermediate_size, "a positive integer")
            if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
                raise _refuse("num_experts_per_tok", self.num_experts_per_tok,
                              f"an integer in [1, n_routed_experts={self.n_routed_experts}]")
            if self.n_routed_experts % self.n_group:
                raise _refuse("n_group", self.n_group,
                              f"a divisor of n_routed_experts={self.n_routed_experts}")
            if not 1 <= self.topk_group <= self.n_group:
                raise _refuse("topk_group", self.topk_group, f"an integer in [1, n_group={self.n_group}]")
            if self.topk_method != "greedy":
                experts_in_groups = self.topk_group * self.n_routed_experts // self.n_group
                if experts_in_groups < self.num_experts_per_tok:
                    raise _refuse("topk_group", self.topk_group,
                                  f"enough groups to hold num_experts_per_tok={self.num_experts_per_tok} experts")

    # ----- derived -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace if self.n_routed_experts else 0

    @property
    def num_dense_layers(self) -> int:
        return self.num_hidden_layers - self.num_moe_layers

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        if self.rope_scaling is not None and self.rope_scaling.mscale_all_dim:
            m = yarn_mscale(self.rope_scaling.factor, self.rope_scaling.mscale_all_dim)
            scale *= m * m
        return scale

    @property
    def kv_cache_dim(self) -> int:
        """Numbers cached per token per layer: the latent c_kv plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def num_params(self) -> int:
        d, h = self.hidden_size, self.num_attention_heads
        q = d * h * self.qk_head_dim if self.q_lora_rank is None else \
            d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * self.qk_head_dim
        attn = q + d * self.kv_cache_dim + self.kv_lora_rank \
            + self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim) + h * self.v_head_dim * d
        dense_mlp = 3 * d * self.intermediate_size
        moe = 3 * d * self.moe_intermediate_size * (self.n_routed_experts + self.n_shared_experts) \
            + d * self.n_routed_experts
        layers = self.num_hidden_layers * (attn + 2 * d) + self.num_dense_layers * dense_mlp \
            + self.num_moe_layers * moe
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return layers + embed + d

    # ----- Hugging Face config.json ---------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        model_type = hf.get("model_type")
        if model_type not in MODEL_TYPES:
            raise _refuse("model_type", model_type, ", ".join(MODEL_TYPES))
        c = {**_HF_DEFAULTS[model_type], **{k: v for k, v in hf.items() if v is not None or k == "q_lora_rank"}}
        if c.get("hidden_act", "silu") != "silu":
            raise _refuse("hidden_act", c["hidden_act"], "silu")
        if c.get("attention_bias"):
            raise _refuse("attention_bias", c["attention_bias"], "false")
        rope_theta, rope_scaling = _parse_rope(c)
        if model_type == "deepseek_v2":
            # transformers' DeepseekV2 always pairs rope dims interleaved and never renormalizes the
            # top-k weights; matching it is what makes logits agree.
            if c.get("norm_topk_prob"):
                log.warning("deepseek_v2: norm_topk_prob=true is ignored, as transformers ignores it")
            c["norm_topk_prob"] = False
            c["rope_interleave"] = True
        n_routed = c.get("n_routed_experts") or 0
        eos = c.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"], moe_intermediate_size=c["moe_intermediate_size"],
            num_hidden_layers=c["num_hidden_layers"], num_attention_heads=c["num_attention_heads"],
            q_lora_rank=c.get("q_lora_rank"), kv_lora_rank=c["kv_lora_rank"],
            qk_nope_head_dim=c["qk_nope_head_dim"], qk_rope_head_dim=c["qk_rope_head_dim"],
            v_head_dim=c["v_head_dim"], n_routed_experts=n_routed,
            n_shared_experts=c.get("n_shared_experts") or 0,
            num_experts_per_tok=c.get("num_experts_per_tok") or (1 if not n_routed else 0),
            first_k_dense_replace=c.get("first_k_dense_replace") or 0,
            moe_layer_freq=c.get("moe_layer_freq") or 1,
            n_group=c.get("n_group") or 1, topk_group=c.get("topk_group") or 1,
            topk_method=c["topk_method"], scoring_func=c["scoring_func"],
            norm_topk_prob=bool(c["norm_topk_prob"]),
            routed_scaling_factor=float(c["routed_scaling_factor"]),
            rms_norm_eps=float(c["rms_norm_eps"]), rope_theta=rope_theta, rope_scaling=rope_scaling,
            rope_interleave=bool(c["rope_interleave"]), tie_word_embeddings=bool(c["tie_word_embeddings"]),
            max_position_embeddings=c["max_position_embeddings"], bos_token_id=c.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        return cls.from_hf(json.loads(Path(path).read_text()))

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that transformers and ``from_hf`` both read back to this config."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("rope_scaling", "eos_token_ids")}
        out["eos_token_id"] = self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope.update(rope_type="yarn", **{k: v for k, v in dataclasses.asdict(self.rope_scaling).items()
                                              if v is not None})
        out["rope_parameters"] = rope
        out["num_key_value_heads"] = self.num_attention_heads
        out["architectures"] = ["DeepseekV3ForCausalLM" if self.model_type == "deepseek_v3"
                                else "DeepseekV2ForCausalLM"]
        return out

    # ----- presets ---------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        path = PRESETS_DIR / f"{name}.yaml"
        if not path.is_file():
            raise ConfigError(f"unknown model preset {name!r}; accepted: {', '.join(list_presets())} "
                              "or a directory holding config.json")
        return cls.from_hf(yaml.safe_load(path.read_text()))

    @classmethod
    def tiny(cls) -> "ModelConfig":
        return cls.preset("tiny")

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def _parse_rope(c: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Reads rope theta and scaling from either spelling: ``rope_parameters`` (new) or ``rope_scaling`` (old)."""
    params = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise _refuse("rope_parameters", params, "a mapping with rope_type / rope_theta")
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta") or c.get("rope_theta") or 10000.0)
    if rope_type not in ROPE_TYPES:
        raise _refuse("rope_parameters.rope_type", rope_type, ", ".join(ROPE_TYPES))
    if rope_type == "default":
        return theta, None
    original = params.get("original_max_position_embeddings") or c.get("max_position_embeddings")
    factor = params.get("factor") or c["max_position_embeddings"] / original
    return theta, RopeScaling(
        factor=float(factor), original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)),
    )


BUCKET_MODES = ("pow2", "quantile")
# "auto" stores the model's dtype; the others 8 bits a latent element (pallas_kernels/kv_quant.py).
KV_CACHE_DTYPES = ("auto", "int8", "fp8")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Serving-side settings (vLLM's names where the meaning is the same)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    block_size: int = 64
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # KV pool: bytes per device (int), a fraction of the free device memory (float in (0, 1]), or None
    # for the default (0.9 of free memory on an accelerator; room for max_num_seqs full sequences on CPU).
    kv_cache_memory: int | float | None = None
    num_kv_blocks: int | None = None  # exact pool size (all data-parallel ranks); overrides kv_cache_memory
    # Latent cache storage: "auto" (the model's dtype) or 8 bits a latent element, "int8" or "fp8" (e4m3),
    # with one f32 scale per token, or per kv_cache_group_size elements of it (e.g. 128); the rope key
    # stays in the model's dtype.
    kv_cache_dtype: str = "auto"
    kv_cache_group_size: int | None = None
    # Distance-aware precision: the most recent full_precision_window tokens of a sequence stay in the
    # model's dtype; blocks wholly older than that move to a kv_cache_dtype (int8 / fp8) pool, freeing
    # their full-precision blocks. None: one pool, all kv_cache_dtype.
    full_precision_window: int | None = None
    # Token-count buckets of the jitted steps: "pow2", "quantile" (re-derived from the first
    # quantile_warmup_steps observed steps), or an explicit tuple of sizes.
    buckets: str | tuple[int, ...] = "pow2"
    # Queue each step before reading the previous one's tokens, so host work (scheduling, packing,
    # detokenizing) overlaps the device's; a token reaches the caller one step() later, and a sequence
    # that stops computes one extra token, dropped.
    async_scheduling: bool = False
    # Decode steps a launch runs (vLLM's multi-step scheduling): when every running sequence decodes and none
    # waits, one program runs up to this many forward + sample steps on the device, each feeding its tokens to
    # the next, so the host launches and reads once per chunk. Tokens then reach the caller in chunks; a
    # sequence that stops inside one drops the rest of it. One device only (no mesh).
    num_scheduler_steps: int = 1
    num_quantile_buckets: int = 6
    quantile_warmup_steps: int = 32
    realtime_max_prompt_tokens: int = 512
    bulk_min_prompt_tokens: int = 2048
    aging_steps: int = 64
    max_logprobs: int = 20
    seed: int = 0

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "aging_steps",
                     "num_quantile_buckets", "quantile_warmup_steps", "num_scheduler_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise _refuse(name, value, "a positive integer")
        if self.block_size & (self.block_size - 1) or self.block_size > 512:
            raise _refuse("block_size", self.block_size, "a power of two up to 512 (the kernels tile by it)")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise _refuse("max_num_batched_tokens", self.max_num_batched_tokens,
                          f"at least max_num_seqs={self.max_num_seqs} (every running sequence decodes each step)")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise _refuse("max_num_batched_tokens", self.max_num_batched_tokens,
                          f"at least max_model_len={self.max_model_len} when enable_chunked_prefill is false")
        memory = self.kv_cache_memory
        if memory is not None and not (isinstance(memory, int) and memory > 0) and \
                not (isinstance(memory, float) and 0 < memory <= 1):
            raise _refuse("kv_cache_memory", memory, "bytes (a positive int), a fraction in (0, 1], or null")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise _refuse("kv_cache_dtype", self.kv_cache_dtype, ", ".join(KV_CACHE_DTYPES))
        group = self.kv_cache_group_size
        if group is not None and (not isinstance(group, int) or isinstance(group, bool) or group < 1
                                  or group & (group - 1)):
            raise _refuse("kv_cache_group_size", group, "a power of two dividing kv_lora_rank, or null (per token)")
        if group is not None and self.kv_cache_dtype == "auto":
            raise _refuse("kv_cache_group_size", group, "null unless kv_cache_dtype is int8 or fp8")
        window = self.full_precision_window
        if window is not None:
            if not isinstance(window, int) or isinstance(window, bool) or window < 1:
                raise _refuse("full_precision_window", window, "a positive number of tokens, or null")
            if self.kv_cache_dtype == "auto":
                raise _refuse("full_precision_window", window,
                              "null unless kv_cache_dtype is int8 or fp8 (the format of the older blocks)")
        if not isinstance(self.async_scheduling, bool):
            raise _refuse("async_scheduling", self.async_scheduling, "true or false")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise _refuse("num_kv_blocks", self.num_kv_blocks, "a positive integer or null")
        if isinstance(self.buckets, str):
            if self.buckets not in BUCKET_MODES:
                raise _refuse("buckets", self.buckets, "pow2, quantile, or a list of token counts")
        elif not self.buckets or any(not isinstance(b, int) or b < 1 for b in self.buckets) \
                or max(self.buckets) < self.max_num_batched_tokens:
            raise _refuse("buckets", self.buckets,
                          f"positive token counts whose largest is >= max_num_batched_tokens={self.max_num_batched_tokens}")
        if not 0 <= self.max_logprobs <= 1024:
            raise _refuse("max_logprobs", self.max_logprobs, "an integer in [0, 1024]")

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


PARALLEL_PRESETS_DIR = Path(__file__).resolve().parents[1] / "configs" / "parallel"
EXPERT_ALL_TO_ALL = ("auto", "allgather", "padded", "ragged")
# YAML spellings: the design notes' *_degree keys, or our *_size names.
_PARALLEL_ALIASES = {
    "tensor_parallel_degree": "tensor_parallel_size", "expert_parallel_degree": "expert_parallel_size",
    "data_parallel_degree": "data_parallel_size",
}


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How one engine spreads over devices: a mesh ('data', 'expert', 'tensor') of
    data_parallel_size x expert_parallel_size x tensor_parallel_size devices (docs/parallelism.md).

    Sequences (and their KV blocks) are split over data x expert; routed experts over expert; attention
    heads, MLP columns and the vocabulary over tensor. Multi-host: every process starts with the same
    coordinator_address and num_processes and its own process_id (jax.distributed).
    """

    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    data_parallel_size: int = 1
    # Rows each rank may send to each other rank per MoE layer, as a multiple of the mean
    # (T*k/expert_parallel_size); None: the worst case, so no token is ever dropped.
    expert_capacity_factor: float | None = None
    expert_all_to_all: str = "auto"  # the token exchange; auto: allgather while ep <= top-k, else padded
    coordinator_address: str | None = None  # "host:port" of process 0; None: a single process
    num_processes: int = 1
    process_id: int = 0

    def __post_init__(self):
        for name in ("tensor_parallel_size", "expert_parallel_size", "data_parallel_size", "num_processes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise _refuse(name, value, "a positive integer")
        factor = self.expert_capacity_factor
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0):
            raise _refuse("expert_capacity_factor", factor, "a positive number, or null for drop-free capacity")
        if self.expert_all_to_all not in EXPERT_ALL_TO_ALL:
            raise _refuse("expert_all_to_all", self.expert_all_to_all, ", ".join(EXPERT_ALL_TO_ALL))
        if not isinstance(self.process_id, int) or not 0 <= self.process_id < self.num_processes:
            raise _refuse("process_id", self.process_id, f"an integer in [0, num_processes={self.num_processes})")
        if self.num_processes > 1 and not self.coordinator_address:
            raise _refuse("coordinator_address", self.coordinator_address,
                          f"'host:port' of process 0 when num_processes={self.num_processes}")

    @property
    def num_devices(self) -> int:
        return self.tensor_parallel_size * self.expert_parallel_size * self.data_parallel_size

    @property
    def num_batch_shards(self) -> int:
        """Data-parallel attention ranks: each holds its own sequences and their KV blocks."""
        return self.data_parallel_size * self.expert_parallel_size

    @classmethod
    def from_dict(cls, settings: dict[str, Any], where: str = "parallel config") -> "ParallelConfig":
        """Our field names or the design notes' (``parallel_config: {tensor_parallel_degree: 2, ...}``)."""
        if set(settings) == {"parallel_config"}:
            settings = settings["parallel_config"]
        if not isinstance(settings, dict):
            raise ConfigError(f"{where}: accepted a mapping of settings, got {type(settings).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        out: dict[str, Any] = {}
        for key, value in settings.items():
            name = _PARALLEL_ALIASES.get(str(key).replace("-", "_"), str(key).replace("-", "_"))
            if name == "pipeline_parallel_degree":
                if value != 1:
                    raise _refuse(f"{where}: {key}", value, "1 (pipeline parallelism is not implemented)")
                continue
            if name == "expert_parallel":  # the design notes' switch: only 'disabled' says anything alone
                if value not in ("disabled", False):
                    raise _refuse(f"{where}: {key}", value, "disabled (set expert_parallel_degree instead)")
                name, value = "expert_parallel_size", 1
            if name not in fields:
                raise ConfigError(f"{where}: unknown key {key!r}; accepted: {', '.join(sorted(fields))}, "
                                  f"{', '.join(_PARALLEL_ALIASES)}, pipeline_parallel_degree (1), expert_parallel")
            if name in out:
                raise ConfigError(f"{where}: {name} is given twice (as {key!r} and another spelling)")
            out[name] = value
        return cls(**out)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "ParallelConfig":
        path = Path(path)
        if not path.is_file():
            named = PARALLEL_PRESETS_DIR / f"{path}.yaml"
            if not named.is_file():
                presets = ", ".join(sorted(p.stem for p in PARALLEL_PRESETS_DIR.glob("*.yaml")))
                raise ConfigError(f"parallel config {str(path)!r}: no such file or preset; presets: {presets}")
            path = named
        return cls.from_dict(yaml.safe_load(path.read_text()) or {}, where=str(path))

    def replace(self, **changes: Any) -> "ParallelConfig":
        return dataclasses.replace(self, **changes)

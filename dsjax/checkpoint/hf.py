"""Load a Hugging Face DeepSeek-V2/V3 checkpoint directory into the model.

Reads ``config.json`` and ``model.safetensors`` (or the shards of ``model.safetensors.index.json``).
Every tensor name and shape is checked against the config before anything is read; each tensor is
then read once from its memory map (FP8 block-scaled weights dequantized) and copied into the one host
buffer of its parameter, stacking per-expert tensors into [E, ...] and layers into [L, ...]. The buffer
keeps Hugging Face's [out, in] layout, so host copies stay contiguous; it goes to the device, where one
jitted relayout (transposes, head splits) produces our layout, and is dropped.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dsjax.checkpoint.safetensors_io import CheckpointError, SafetensorsFile
from dsjax.config import ConfigError, ModelConfig
from dsjax.model.params import logical_axes
from dsjax.model.transformer import abstract_model, state_shardings
from dsjax.parallel.expert import ExpertDispatch
from dsjax.parallel.sharding import logical_to_spec

log = logging.getLogger(__name__)

FP8_BLOCK = 128  # DeepSeek-V3 ships FP8 weights with one f32 scale per 128x128 block
_FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


@dataclasses.dataclass(frozen=True)
class Piece:
    """One slice of a parameter's host buffer: ``host[index] = select(*tensors named in names)``, then
    the whole buffer becomes the parameter as ``relayout(buffer, *layout)`` on the device."""

    index: tuple[int, ...]
    names: tuple[str, ...]
    select: Callable[..., np.ndarray]
    layout: tuple = ("same",)


def _relayout(x, kind: str, heads: int = 0):
    """Hugging Face [..., out, in] buffers -> our layouts (leading stack axes untouched)."""
    if kind == "same":
        return x
    if kind == "t":  # [..., out, in] -> [..., in, out]
        return jnp.swapaxes(x, -1, -2)
    if kind == "t_split_out":  # [..., H*k, in] -> [..., in, H, k]
        x = jnp.swapaxes(x, -1, -2)
        return x.reshape(*x.shape[:-1], heads, x.shape[-1] // heads)
    if kind == "t_split_in":  # [..., out, H*k] -> [..., H, k, out]
        x = jnp.swapaxes(x, -1, -2)
        return x.reshape(*x.shape[:-2], heads, x.shape[-2] // heads, x.shape[-1])
    if kind == "latent_first":  # [..., H, k, C] -> [..., C, H, k]
        return jnp.moveaxis(x, -1, -3)
    raise ValueError(kind)


relayout = jax.jit(_relayout, static_argnums=(1, 2))


def source_spec(target: P, ndim: int, kind: str) -> P:
    """The PartitionSpec of a Hugging Face buffer that ``relayout(buffer, kind)`` turns into a weight
    of ``ndim`` dims sharded as ``target``, so the relayout moves no data between devices. The head
    axis H of a fused H*k dimension keeps its split (heads are the major part of H*k)."""
    s = tuple(target) + (None,) * (ndim - len(target))
    if kind == "same":
        return P(*s)
    if kind == "t":  # [..., in, out] <- [..., out, in]
        return P(*s[:-2], s[-1], s[-2])
    if kind == "t_split_out":  # [..., in, H, k] <- [..., H*k, in]
        return P(*s[:-3], s[-2], s[-3])
    if kind == "t_split_in":  # [..., H, k, out] <- [..., out, H*k]
        return P(*s[:-3], s[-1], s[-3])
    if kind == "latent_first":  # [..., C, H, k] <- [..., H, k, C]
        return P(*s[:-3], s[-2], s[-1], s[-3])
    raise ValueError(kind)


def _place(host: np.ndarray, variable, layout: tuple, mesh: Mesh | None):
    """Host buffer -> the device weight: with a mesh each device receives only its shard (the
    buffer is put with the sharding that the relayout maps onto the weight's own)."""
    if mesh is None:
        return relayout(jax.device_put(host), *layout)
    target = logical_to_spec(logical_axes(variable))
    buffer = jax.device_put(host, NamedSharding(mesh, source_spec(target, len(variable.shape), layout[0])))
    move = jax.jit(_relayout, static_argnums=(1, 2), out_shardings=NamedSharding(mesh, target))
    return move(buffer, *layout)


class TensorIndex:
    """Tensor name -> the safetensors file holding it, for one checkpoint directory."""

    def __init__(self, directory: Path):
        index_path = directory / "model.safetensors.index.json"
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index_path}: no readable weight_map ({e})") from e
            files = {name: directory / fname for name, fname in weight_map.items()}
        elif (directory / "model.safetensors").is_file():
            files = None
        else:
            raise CheckpointError(f"{directory}: found neither model.safetensors nor model.safetensors.index.json")
        paths = sorted(set(files.values())) if files else [directory / "model.safetensors"]
        missing_files = [str(p.name) for p in paths if not p.is_file()]
        if missing_files:
            raise CheckpointError(f"{directory}: shard files listed in the index are missing: {missing_files}")
        opened = {p: SafetensorsFile(p) for p in paths}
        self.files: dict[str, SafetensorsFile] = {}
        for path, f in opened.items():
            for name in f.tensors:
                if files is None or files.get(name) == path:
                    self.files[name] = f
        if files:
            absent = [n for n, p in files.items() if n not in opened[p].tensors]
            if absent:
                raise CheckpointError(f"{directory}: tensors listed in the index are not in their shard: "
                                      f"{_listing(absent)}")

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def shape(self, name: str) -> tuple[int, ...]:
        return self.files[name].shape(name)

    def is_fp8(self, name: str) -> bool:
        return self.files[name].dtype(name) in _FP8_DTYPES

    def read(self, name: str) -> np.ndarray:
        """The tensor as stored, FP8 dequantized to f32 with its weight_scale_inv blocks."""
        w = self.files[name].get(name)
        if not self.is_fp8(name):
            return w
        scale = self.files[_scale_name(name)].get(_scale_name(name)).astype(np.float32)
        out, inp = w.shape
        blocks = np.repeat(np.repeat(scale, FP8_BLOCK, axis=0), FP8_BLOCK, axis=1)[:out, :inp]
        return w.astype(np.float32) * blocks


def _scale_name(name: str) -> str:
    return name + "_scale_inv"  # "...weight" -> "...weight_scale_inv"


def _listing(names, limit: int = 12) -> str:
    names = sorted(names)
    shown = ", ".join(names[:limit])
    return shown + (f", ... and {len(names) - limit} more" if len(names) > limit else "")


# ----- the name and layout mapping -------------------------------------------------------------------

_T = ("t",)


def _layer_plan(config: ModelConfig, layer: int, moe: bool, fused_experts: bool, pos: int):
    """(our leaf path suffix, piece, expected HF shapes) for one decoder layer at stack position pos."""
    d, h = config.hidden_size, config.num_attention_heads
    qk, n, v = config.qk_head_dim, config.qk_nope_head_dim, config.v_head_dim
    c, r = config.kv_lora_rank, config.qk_rope_head_dim
    p = f"model.layers.{layer}."
    a = p + "self_attn."
    plan: list[tuple[tuple[str, ...], Piece]] = []
    shapes: dict[str, tuple[int, ...]] = {}

    def add(path, name, shape, layout=("same",), select=np.asarray, index=(pos,)):
        plan.append((path, Piece(index, (name,), select, layout)))
        shapes[name] = shape

    add(("attn_norm", "weight"), p + "input_layernorm.weight", (d,))
    add(("mlp_norm", "weight"), p + "post_attention_layernorm.weight", (d,))
    if config.q_lora_rank is None:
        add(("attn", "q_proj"), a + "q_proj.weight", (h * qk, d), ("t_split_out", h))
    else:
        q = config.q_lora_rank
        add(("attn", "q_a"), a + "q_a_proj.weight", (q, d), _T)
        add(("attn", "q_a_norm", "weight"), a + "q_a_layernorm.weight", (q,))
        add(("attn", "q_b"), a + "q_b_proj.weight", (h * qk, q), ("t_split_out", h))
    add(("attn", "kv_a"), a + "kv_a_proj_with_mqa.weight", (c + r, d), _T)
    add(("attn", "kv_a_norm", "weight"), a + "kv_a_layernorm.weight", (c,))
    kv_b = lambda w: np.asarray(w).reshape(h, n + v, c)  # per head: [k_nope rows | v rows] x latent
    add(("attn", "w_uk"), a + "kv_b_proj.weight", (h * (n + v), c), ("latent_first",), lambda w: kv_b(w)[:, :n])
    add(("attn", "w_uv"), a + "kv_b_proj.weight", (h * (n + v), c), ("latent_first",), lambda w: kv_b(w)[:, n:])
    add(("attn", "o_proj"), a + "o_proj.weight", (d, h * v), ("t_split_in", h))

    m = p + "mlp."
    if not moe:
        i = config.intermediate_size
        add(("mlp", "w_gate"), m + "gate_proj.weight", (i, d), _T)
        add(("mlp", "w_up"), m + "up_proj.weight", (i, d), _T)
        add(("mlp", "w_down"), m + "down_proj.weight", (d, i), _T)
        return plan, shapes
    e, i = config.n_routed_experts, config.moe_intermediate_size
    add(("mlp", "router"), m + "gate.weight", (e, d), _T)
    if config.topk_method == "noaux_tc":
        add(("mlp", "score_bias"), m + "gate.e_score_correction_bias", (e,))
    if fused_experts:  # transformers v5's in-memory layout: gate_up [E, 2I, D], down [E, D, I]
        add(("mlp", "w_gate"), m + "experts.gate_up_proj", (e, 2 * i, d), _T, lambda w: np.asarray(w)[:, :i])
        add(("mlp", "w_up"), m + "experts.gate_up_proj", (e, 2 * i, d), _T, lambda w: np.asarray(w)[:, i:])
        add(("mlp", "w_down"), m + "experts.down_proj", (e, d, i), _T)
    else:
        for x in range(e):
            ex = f"{m}experts.{x}."
            add(("mlp", "w_gate"), ex + "gate_proj.weight", (i, d), _T, index=(pos, x))
            add(("mlp", "w_up"), ex + "up_proj.weight", (i, d), _T, index=(pos, x))
            add(("mlp", "w_down"), ex + "down_proj.weight", (d, i), _T, index=(pos, x))
    if config.n_shared_experts:
        si = i * config.n_shared_experts
        add(("mlp", "shared", "w_gate"), m + "shared_experts.gate_proj.weight", (si, d), _T)
        add(("mlp", "shared", "w_up"), m + "shared_experts.up_proj.weight", (si, d), _T)
        add(("mlp", "shared", "w_down"), m + "shared_experts.down_proj.weight", (d, si), _T)
    return plan, shapes


def checkpoint_plan(config: ModelConfig, index: TensorIndex):
    """-> ({our leaf path: [pieces]}, {HF name: expected shape}) for this config."""
    d, vocab = config.hidden_size, config.vocab_size
    plan: dict[tuple[str, ...], list[Piece]] = {}
    shapes: dict[str, tuple[int, ...]] = {}

    def put(path, piece):
        plan.setdefault(path, []).append(piece)

    put(("embed",), Piece((), ("model.embed_tokens.weight",), np.asarray))
    shapes["model.embed_tokens.weight"] = (vocab, d)
    put(("norm", "weight"), Piece((), ("model.norm.weight",), np.asarray))
    shapes["model.norm.weight"] = (d,)
    if not config.tie_word_embeddings:
        put(("lm_head",), Piece((), ("lm_head.weight",), np.asarray, _T))
        shapes["lm_head.weight"] = (vocab, d)
    for layer in range(config.num_hidden_layers):
        moe = layer >= config.num_dense_layers
        stack = "moe_layers" if moe else "dense_layers"
        pos = layer - config.num_dense_layers if moe else layer
        fused = f"model.layers.{layer}.mlp.experts.gate_up_proj" in index
        layer_plan, layer_shapes = _layer_plan(config, layer, moe, fused, pos)
        for suffix, piece in layer_plan:
            put((stack, *suffix), piece)
        shapes.update(layer_shapes)
    return plan, shapes


def _is_ignored(name: str, config: ModelConfig) -> bool:
    """Tensors a checkpoint may carry that inference does not use: multi-token-prediction layers past
    num_hidden_layers, rotary caches, a stored lm_head when embeddings are tied."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    if m and int(m.group(1)) >= config.num_hidden_layers:
        return True
    return bool(_IGNORED.match(name)) or (config.tie_word_embeddings and name == "lm_head.weight")


def validate(config: ModelConfig, index: TensorIndex, directory: Path):
    plan, shapes = checkpoint_plan(config, index)
    missing = [n for n in shapes if n not in index]
    missing += [_scale_name(n) for n in shapes if n in index and index.is_fp8(n) and _scale_name(n) not in index]
    scales = {_scale_name(n) for n in shapes if n in index and index.is_fp8(n)}
    unexpected = [n for n in index.files if n not in shapes and n not in scales and not _is_ignored(n, config)]
    wrong = [f"{n}: checkpoint {list(index.shape(n))}, config expects {list(s)}"
             for n, s in shapes.items() if n in index and index.shape(n) != s]
    if missing or unexpected or wrong:
        lines = [f"checkpoint {directory} does not match its config.json ({config.model_type}):"]
        if missing:
            lines.append(f"  missing tensors ({len(missing)}): {_listing(missing)}")
        if unexpected:
            lines.append(f"  unexpected tensors ({len(unexpected)}): {_listing(unexpected)}")
        if wrong:
            lines.append(f"  wrong shapes ({len(wrong)}): " + "; ".join(wrong[:12])
                         + (f"; ... and {len(wrong) - 12} more" if len(wrong) > 12 else ""))
        raise CheckpointError("\n".join(lines))
    return plan


def load_hf_checkpoint(directory: str | Path, *, dtype="float32", kernel_backend: str = "auto",
                       progress: bool = True, mesh: Mesh | None = None,
                       expert_dispatch: ExpertDispatch = ExpertDispatch()):
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{directory}: no config.json")
    try:
        config = ModelConfig.from_json(config_path)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_path}: not valid JSON ({e})") from e
    except ConfigError as e:
        raise ConfigError(f"{config_path}: {e}") from e
    index = TensorIndex(directory)
    plan = validate(config, index, directory)

    model = abstract_model(config, dtype=dtype, kernel_backend=kernel_backend, mesh=mesh,
                           expert_dispatch=expert_dispatch)
    graphdef, state = nnx.split(model)
    state_shardings(state, mesh)  # refuses a mesh that cannot split some weight evenly, before reading
    flat = nnx.to_flat_state(state)
    total = sum(len(pieces) for pieces in plan.values())
    bar = tqdm(total=total, desc=f"loading {directory.name}", unit="tensor", disable=not progress)
    leaves = []
    for path, variable in flat:
        pieces = plan.get(path)
        if pieces is None:
            raise CheckpointError(f"internal: no checkpoint mapping for parameter {'.'.join(path)}")
        host = None
        for piece in pieces:
            part = piece.select(*(index.read(n) for n in piece.names))
            if host is None:
                host = np.empty(variable.shape[:len(piece.index)] + part.shape, np.dtype(variable.dtype))
            host[piece.index] = part
            bar.update(1)
        value = _place(host, variable, pieces[0].layout, mesh)
        del host
        if value.shape != variable.shape:
            raise CheckpointError(f"internal: {'.'.join(path)} loaded as {value.shape}, model wants {variable.shape}")
        leaves.append((path, variable.replace(value)))
    bar.close()
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))

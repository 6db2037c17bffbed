"""Write a model as a Hugging Face checkpoint (config.json + safetensors) that transformers loads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from flax import nnx

from dsjax.checkpoint.safetensors_io import save_file


def hf_tensors(model):
    """Yields (Hugging Face name, numpy array) for every weight, in Linear's [out, in] layout."""
    config = model.config
    state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    d, h = config.hidden_size, config.num_attention_heads
    np_ = lambda a: np.asarray(a)
    yield "model.embed_tokens.weight", np_(state["embed"])
    yield "model.norm.weight", np_(state["norm"]["weight"])
    if not config.tie_word_embeddings:
        yield "lm_head.weight", np_(state["lm_head"]).T
    for layer in range(config.num_hidden_layers):
        moe = layer >= config.num_dense_layers
        pos = layer - config.num_dense_layers if moe else layer
        s = state["moe_layers" if moe else "dense_layers"]
        get = lambda *path: np_(_dig(s, path)[pos])
        p, a, m = f"model.layers.{layer}.", f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
        yield p + "input_layernorm.weight", get("attn_norm", "weight")
        yield p + "post_attention_layernorm.weight", get("mlp_norm", "weight")
        if config.q_lora_rank is None:
            yield a + "q_proj.weight", get("attn", "q_proj").reshape(d, -1).T
        else:
            yield a + "q_a_proj.weight", get("attn", "q_a").T
            yield a + "q_a_layernorm.weight", get("attn", "q_a_norm", "weight")
            yield a + "q_b_proj.weight", get("attn", "q_b").reshape(config.q_lora_rank, -1).T
        yield a + "kv_a_proj_with_mqa.weight", get("attn", "kv_a").T
        yield a + "kv_a_layernorm.weight", get("attn", "kv_a_norm", "weight")
        kv_b = np.concatenate([get("attn", "w_uk"), get("attn", "w_uv")], axis=-1)  # [C, H, n + v]
        yield a + "kv_b_proj.weight", kv_b.transpose(1, 2, 0).reshape(h * kv_b.shape[-1], -1)
        yield a + "o_proj.weight", get("attn", "o_proj").reshape(-1, d).T
        if not moe:
            for name in ("gate", "up", "down"):
                yield m + f"{name}_proj.weight", get("mlp", f"w_{name}").T
            continue
        yield m + "gate.weight", get("mlp", "router").T
        if config.topk_method == "noaux_tc":
            yield m + "gate.e_score_correction_bias", get("mlp", "score_bias")
        for name in ("gate", "up", "down"):
            stacked = get("mlp", f"w_{name}")
            for e in range(config.n_routed_experts):
                yield m + f"experts.{e}.{name}_proj.weight", stacked[e].T
        if config.n_shared_experts:
            for name in ("gate", "up", "down"):
                yield m + f"shared_experts.{name}_proj.weight", get("mlp", "shared", f"w_{name}").T


def _dig(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def save_hf(model, directory: str | Path, *, max_shard_bytes: int = 4 << 30) -> Path:
    """config.json + model.safetensors (or shards with an index past ``max_shard_bytes``)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2))
    shards, current, size = [], {}, 0
    for name, array in hf_tensors(model):
        array = np.ascontiguousarray(array)
        if current and size + array.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name], size = array, size + array.nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], directory / "model.safetensors")
        return directory
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, directory / fname)
        weight_map.update({name: fname for name in shard})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory

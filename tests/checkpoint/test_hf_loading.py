"""Loading Hugging Face checkpoints: shards, FP8 block scales, orbax round trip, and clear errors."""

from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import dsjax
from dsjax.checkpoint import CheckpointError, save_orbax
from dsjax.checkpoint.safetensors_io import SafetensorsFile, save_file
from dsjax.config import ConfigError
from tests.hf_models import build_hf_model, hf_logits, save_hf_model

TOKENS = np.random.default_rng(0).integers(2, 256, size=(2, 16), dtype=np.int32)


def _close(got, expected):
    assert np.abs(np.asarray(got) - expected).max() <= 1e-4 * np.abs(expected).max()


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    hf = build_hf_model("deepseek_v3")
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("v3"))


def _copy(directory, tmp_path):
    out = tmp_path / "ckpt"
    shutil.copytree(directory, out)
    return out


def _rewrite(path, edit):
    """Rewrites one safetensors file after ``edit(dict of arrays)``."""
    f = SafetensorsFile(path)
    tensors = {n: np.array(f.get(n)) for n in f.tensors}
    edit(tensors)
    save_file(tensors, path)


def test_sharded_checkpoint(tmp_path):
    hf = build_hf_model("deepseek_v2", topk_method="group_limited_greedy", n_group=4, topk_group=2)
    directory = save_hf_model(hf, tmp_path / "sharded", max_shard_size="40KB")
    shards = sorted(directory.glob("model-*.safetensors"))
    assert len(shards) > 3 and (directory / "model.safetensors.index.json").is_file()
    _close(dsjax.load_model(directory, progress=False).logits(TOKENS), hf_logits(hf, TOKENS))


def _quantize_fp8_blocks(w: np.ndarray, block: int = 128):
    """f32 [out, in] -> (fp8 e4m3 weights, f32 scale_inv [ceil(out/128), ceil(in/128)], dequantized f32)."""
    out_dim, in_dim = w.shape
    rows, cols = -(-out_dim // block), -(-in_dim // block)
    scales = np.zeros((rows, cols), np.float32)
    q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scales[i, j] = np.abs(tile).max() / 448.0
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / scales[i, j]).astype(q.dtype)
    deq = q.astype(np.float32) * np.repeat(np.repeat(scales, block, 0), block, 1)[:out_dim, :in_dim]
    return q, scales, deq


def test_fp8_block_scaled_weights(tmp_path):
    from transformers import DeepseekV3ForCausalLM

    # hidden 192 and intermediate 320 give several 128x128 blocks, including partial ones.
    hf = build_hf_model("deepseek_v3", hidden_size=192, intermediate_size=320, moe_intermediate_size=160)
    fp8_dir = save_hf_model(hf, tmp_path / "fp8")
    ref_dir = _copy(fp8_dir, tmp_path)  # same weights, dequantized, in f32: what transformers runs
    dequantized = {}

    def quantize(tensors):
        for name in list(tensors):
            if name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight"):
                q, scale, dequantized[name] = _quantize_fp8_blocks(tensors[name].astype(np.float32))
                tensors[name], tensors[name + "_scale_inv"] = q, scale

    _rewrite(fp8_dir / "model.safetensors", quantize)
    _rewrite(ref_dir / "model.safetensors", lambda tensors: tensors.update(dequantized))
    assert any("experts.0.gate_proj" in n for n in dequantized) and any("q_b_proj" in n for n in dequantized)
    reference = DeepseekV3ForCausalLM.from_pretrained(ref_dir).float().eval()
    _close(dsjax.load_model(fp8_dir, progress=False).logits(TOKENS), hf_logits(reference, TOKENS))


def test_bfloat16_load(v3):
    hf, directory = v3
    model = dsjax.load_model(directory, dtype="bfloat16", progress=False)
    assert model.dtype == np.dtype(ml_dtypes.bfloat16)
    got, expected = np.asarray(model.logits(TOKENS)), hf_logits(hf, TOKENS)
    # bf16 rounding can flip a near-tied expert choice for a few tokens (transformers' own bf16 run
    # does too), so most positions must agree to bf16 accuracy rather than all of them.
    per_token = np.abs(got - expected).max(-1) / np.abs(expected).max()
    assert np.mean(per_token <= 0.05) >= 0.75


def test_orbax_round_trip(v3, tmp_path):
    hf, directory = v3
    model = dsjax.load_model(directory, progress=False)
    saved = save_orbax(model, tmp_path / "orbax")
    restored = dsjax.load_model(saved)
    assert restored.config == model.config
    np.testing.assert_array_equal(np.asarray(restored.logits(TOKENS)), np.asarray(model.logits(TOKENS)))


def test_wrong_model_type(v3, tmp_path):
    directory = _copy(v3[1], tmp_path)
    cfg = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(dict(cfg, model_type="llama")))
    with pytest.raises(ConfigError, match=r"'model_type' = 'llama'.*deepseek_v2, deepseek_v3"):
        dsjax.load_model(directory, progress=False)


def test_unsupported_value_names_field(v3, tmp_path):
    directory = _copy(v3[1], tmp_path)
    cfg = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(dict(cfg, topk_method="random")))
    with pytest.raises(ConfigError, match=r"'topk_method' = 'random'.*greedy, group_limited_greedy, noaux_tc"):
        dsjax.load_model(directory, progress=False)


def test_missing_and_unexpected_tensors(v3, tmp_path):
    directory = _copy(v3[1], tmp_path)

    def edit(tensors):
        del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
        tensors["model.layers.0.self_attn.extra.weight"] = np.zeros((2, 2), np.float32)

    _rewrite(directory / "model.safetensors", edit)
    with pytest.raises(CheckpointError) as err:
        dsjax.load_model(directory, progress=False)
    message = str(err.value)
    assert "missing tensors (1): model.layers.1.mlp.experts.3.up_proj.weight" in message
    assert "unexpected tensors (1): model.layers.0.self_attn.extra.weight" in message


def test_wrong_shape(v3, tmp_path):
    directory = _copy(v3[1], tmp_path)

    def edit(tensors):
        tensors["model.layers.2.self_attn.kv_b_proj.weight"] = np.zeros((8, 32), np.float32)

    _rewrite(directory / "model.safetensors", edit)
    with pytest.raises(CheckpointError, match=r"wrong shapes \(1\): model.layers.2.self_attn.kv_b_proj.weight: "
                                              r"checkpoint \[8, 32\], config expects \[128, 32\]"):
        dsjax.load_model(directory, progress=False)


def test_truncated_file(v3, tmp_path):
    directory = _copy(v3[1], tmp_path)
    path = directory / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="truncated"):
        dsjax.load_model(directory, progress=False)


def test_corrupt_header(v3, tmp_path):
    directory = _copy(v3[1], tmp_path)
    path = directory / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:16] = b"garbage!"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        dsjax.load_model(directory, progress=False)


def test_unknown_preset_lists_presets():
    with pytest.raises(ConfigError, match="presets: deepseek-v2-lite, deepseek-v3, tiny"):
        dsjax.load_model("no-such-model")


def test_export_round_trip_and_transformers_reads_it(tmp_path):
    from transformers import AutoModelForCausalLM

    from dsjax.checkpoint import save_hf

    model = dsjax.load_model("tiny")
    directory = save_hf(model, tmp_path / "export", max_shard_bytes=2 << 20)
    assert (directory / "model.safetensors.index.json").is_file()
    ours = np.asarray(model.logits(TOKENS))
    np.testing.assert_array_equal(np.asarray(dsjax.load_model(directory, progress=False).logits(TOKENS)), ours)
    hf = AutoModelForCausalLM.from_pretrained(directory).float().eval()
    _close(ours, hf_logits(hf, TOKENS))

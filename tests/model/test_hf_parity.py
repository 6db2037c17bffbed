"""The model against transformers: logits, greedy generation, absorbed vs expanded MLA (float32)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import dsjax
from tests.hf_models import YARN, build_hf_model, hf_greedy, hf_logits, save_hf_model

# Each case covers a slice of the config space; together they cover every item of the parity list.
CASES = {
    "v3_qlora_yarn_dense1": ("deepseek_v3", dict(rope_parameters=YARN)),
    "v3_noqlora_nonorm_dense0_halfrope_tied": ("deepseek_v3", dict(
        q_lora_rank=None, norm_topk_prob=False, first_k_dense_replace=0, rope_interleave=False,
        tie_word_embeddings=True, routed_scaling_factor=1.5)),
    "v2_greedy_scaled": ("deepseek_v2", dict(routed_scaling_factor=2.0)),
    "v2_group_limited_qlora_yarn": ("deepseek_v2", dict(
        topk_method="group_limited_greedy", n_group=4, topk_group=2, q_lora_rank=40, rope_parameters=YARN,
        first_k_dense_replace=2)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    model_type, overrides = CASES[request.param]
    hf = build_hf_model(model_type, **overrides)
    directory = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    return request.param, hf, dsjax.load_model(directory, progress=False), directory


def _tokens(batch, length, seed=0):
    return np.random.default_rng(seed).integers(2, 256, size=(batch, length), dtype=np.int32)


def test_logits_match_transformers(case):
    _, hf, model, _ = case
    tokens = _tokens(2, 24)
    expected = hf_logits(hf, tokens)
    got = np.asarray(model.logits(tokens))
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= 1e-4 * np.abs(expected).max()


def test_absorbed_equals_expanded(case):
    _, _, model, _ = case
    tokens = _tokens(2, 24, seed=1)
    expanded = np.asarray(model.logits(tokens, mode="expanded"))
    absorbed = np.asarray(model.logits(tokens, mode="absorbed"))
    assert np.abs(absorbed - expanded).max() <= 1e-5 * np.abs(expanded).max()


def test_greedy_matches_transformers_generate(case):
    _, hf, model, _ = case
    prompt, num_new = _tokens(1, 8, seed=2), 32
    expected = hf_greedy(hf, prompt, num_new)
    # One compile: a fixed-size buffer; causal attention makes the padding after position i irrelevant.
    buffer = np.zeros((1, prompt.shape[1] + num_new), np.int32)
    buffer[:, :prompt.shape[1]] = prompt
    for i in range(num_new):
        pos = prompt.shape[1] + i
        buffer[0, pos] = int(jnp.argmax(model.logits(buffer)[0, pos - 1]))
    np.testing.assert_array_equal(buffer[:, prompt.shape[1]:], expected)


def test_config_parsed_from_both_rope_spellings(case):
    name, _, model, directory = case
    hf_cfg = json.loads((directory / "config.json").read_text())
    params = hf_cfg.pop("rope_parameters")
    old = dict(hf_cfg, rope_theta=params.pop("rope_theta"))
    if params.get("rope_type", "default") != "default":
        params["type"] = params.pop("rope_type")
        old["rope_scaling"] = params
    assert dsjax.ModelConfig.from_hf(old) == model.config

"""The Pallas kernels (interpret mode on CPU) inside the whole model and the engine match the references."""

from __future__ import annotations

import numpy as np
import pytest

import dsjax
from dsjax import LLM, SamplingParams


@pytest.mark.parametrize("mode", ["expanded", "absorbed"])
def test_model_forward_interpret_matches_reference(mode):
    tokens = np.random.default_rng(0).integers(3, 259, (2, 19)).astype(np.int32)
    reference = np.asarray(dsjax.load_model("tiny", kernel_backend="reference").logits(tokens, mode=mode))
    kernels = np.asarray(dsjax.load_model("tiny", kernel_backend="interpret").logits(tokens, mode=mode))
    assert np.abs(kernels - reference).max() <= 1e-4 * np.abs(reference).max()


def test_engine_generation_interpret_matches_reference():
    # Both buckets (the 25-token prefill in 32, the decode steps in 4) are within STACKED_GEMV_MAX_TOKENS:
    # the stacked GEMV launches with fused norms (tests/model: XLA's projections above it).
    engine = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4, buckets=(4, 32),
                  progress=False)
    prompts = [[5, 6, 7], list(range(10, 31)), [9]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = {}
    for backend in ("reference", "interpret"):
        llm = LLM("tiny", dtype="float32", kernel_backend=backend, **engine)
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs["interpret"] == outs["reference"]

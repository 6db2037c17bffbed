"""The inputs every parallel check shares: the worker subprocesses and the pytest process (which
computes one-device references) import them from here."""

import numpy as np

from dsjax import SamplingParams

# Prompts of 1 to 41 tokens: one longer than a step's token budget, so prefill is chunked.
PROMPTS = [list(range(3, 3 + n)) for n in (5, 1, 41, 12, 7, 20)]
TOKENS = np.random.default_rng(0).integers(3, 500, (3, 11)).astype(np.int32)
ENGINE = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=32, max_model_len=96, block_size=8,
              buckets=(32,), progress=False)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)

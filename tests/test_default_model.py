"""The embedded default model (models/default, trained by dsjax.train): it is what LLM(), the server and
the demo load with no model named; it loads in dsjax and transformers with the same logits; it has
learned Python (low loss on a held-out stdlib module); the engine reproduces its model card's sample."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

import dsjax
from dsjax import LLM, SamplingParams
from dsjax.config import ConfigError
from dsjax.loader import DEFAULT_MODEL, EMBEDDED_MODELS
from dsjax.serve.config import ServeConfig

MODEL_DIR = EMBEDDED_MODELS[DEFAULT_MODEL]
SUMMARY = json.loads((MODEL_DIR / "train_summary.json").read_text())


def test_default_is_the_embedded_trained_model():
    assert ServeConfig().model == DEFAULT_MODEL == "default"
    assert MODEL_DIR == Path(__file__).resolve().parents[1] / "models" / "default"
    assert (MODEL_DIR / "model.safetensors").stat().st_size <= 30 * 2**20  # the repository budget
    config = dsjax.load_config(DEFAULT_MODEL)
    assert config.model_type == "deepseek_v3" and config.n_routed_experts == 8 and config.n_shared_experts == 1
    assert config.vocab_size == 6144 and 5e6 <= config.num_params() <= 20e6
    assert type(dsjax.load_tokenizer(DEFAULT_MODEL)).__name__ == "HFTokenizer"
    for section in ("## Corpus and tokenizer", "## Recipe", "held-out perplexity"):
        assert section in (MODEL_DIR / "README.md").read_text()


def test_unknown_name_lists_embedded_models_and_presets():
    with pytest.raises(ConfigError, match=r"embedded: default; presets: .*tiny"):
        dsjax.load_model("no-such-model")


def test_default_logits_match_transformers():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tokenizer = dsjax.load_tokenizer(DEFAULT_MODEL)
    tokens = np.asarray([tokenizer.encode("import os\n\ndef main(argv):\n    for name in os.listdir(argv[1]):")],
                        np.int32)
    ours = np.asarray(dsjax.load_model(DEFAULT_MODEL, dtype="float32", kernel_backend="reference",
                                       progress=False).logits(tokens))
    hf = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
    assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(theirs).max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def test_default_model_knows_python_on_a_held_out_module():
    """textwrap is held out of training: a random model scores ln(6144) = 8.7 nats a token there; the trained
    one must be near its card's held-out loss (the local stdlib may differ slightly from the GPU's)."""
    assert "textwrap" in SUMMARY["data"]["heldout_modules"]
    source = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    ids = np.asarray([dsjax.load_tokenizer(DEFAULT_MODEL).encode(source)[:512]], np.int32)
    logits = np.asarray(dsjax.load_model(DEFAULT_MODEL, dtype="float32", progress=False).logits(ids))[0, :-1]
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    loss = -logp[np.arange(ids.shape[1] - 1), ids[0, 1:]].mean()
    assert loss < SUMMARY["best_eval_loss"] + 0.75, loss


def test_engine_reproduces_the_model_card_sample():
    """LLM() with no model named serves the default; its greedy completion of the card's prompt is the
    card's sample (computed at export by full forwards on the GPU, here through the paged engine)."""
    llm = LLM(dtype="float32", progress=False, block_size=8, max_num_seqs=4, max_num_batched_tokens=64,
              max_model_len=256, num_kv_blocks=64)
    prompt = SUMMARY["train"]["sample_prompt"]
    out = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0), use_tqdm=False)[0]
    completion = out.outputs[0].text
    assert completion.strip() and SUMMARY["sample"].startswith(prompt + completion)
    llm.engine.scheduler.block_manager.check_invariants()

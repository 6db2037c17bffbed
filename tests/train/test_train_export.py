"""The exported directory loads in dsjax and in transformers with the same logits, and its tokenizer
reads the same in both."""

from __future__ import annotations

import numpy as np
import pytest

import dsjax

CODE = 'def add(a, b):\n    """Sum."""\n    return a + b  # ✓ déjà vu\n\n\tx = {"k": [1, 2.5e-3]}\n'


def test_export_logits_match_transformers(tiny_run):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tokens = np.random.default_rng(0).integers(0, tiny_run.summary["data"]["vocab_size"], (2, 24), np.int32)
    ours = np.asarray(dsjax.load_model(tiny_run.out, dtype="float32", kernel_backend="reference",
                                       progress=False).logits(tokens))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_run.out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
    assert ours.shape == theirs.shape
    assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(theirs).max()


def test_tokenizer_round_trips_code_in_dsjax_and_transformers(tiny_run):
    tok = dsjax.load_tokenizer(tiny_run.out)
    ids = tok.encode(CODE)
    assert ids[0] == 0 and tok.decode(ids) == CODE
    transformers = pytest.importorskip("transformers")
    for hf in (transformers.PreTrainedTokenizerFast(tokenizer_file=str(tiny_run.out / "tokenizer.json")),
               transformers.AutoTokenizer.from_pretrained(tiny_run.out)):
        assert hf(CODE)["input_ids"] == ids
        assert hf.decode(ids, skip_special_tokens=True) == CODE
    auto = transformers.AutoTokenizer.from_pretrained(tiny_run.out)
    assert (auto.bos_token, auto.eos_token, auto.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")


def test_chat_template_renders_with_special_tokens(tiny_run):
    transformers = pytest.importorskip("transformers")
    messages = [{"role": "user", "content": "Write add()."}, {"role": "assistant", "content": "def add(a, b):"},
                {"role": "user", "content": "Thanks"}]
    hf = transformers.AutoTokenizer.from_pretrained(tiny_run.out)
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|bos|><|user|>Write add().<|assistant|>def add(a, b):<|eos|><|user|>Thanks"
                    "<|assistant|>")
    tok = dsjax.load_tokenizer(tiny_run.out)
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[:2] == [0, 4] and ids[-1] == 5  # <|bos|> <|user|> ... <|assistant|>
    assert tok.chat_template == hf.chat_template

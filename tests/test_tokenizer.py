from __future__ import annotations

import json

import pytest

import dsjax
from dsjax.tokenizer import ByteTokenizer, HFTokenizer


def test_byte_tokenizer_round_trip():
    tok = dsjax.load_tokenizer("tiny")
    assert isinstance(tok, ByteTokenizer)
    ids = tok.encode("déf f(x): ✓")
    assert ids[0] == 0 and all(3 <= i < 259 for i in ids[1:])
    assert tok.decode(ids) == "déf f(x): ✓"


def test_byte_tokenizer_needs_room_for_bytes():
    with pytest.raises(ValueError, match="vocab_size >= 259"):
        ByteTokenizer(100)


def test_tokenizer_json_used_when_present(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["def add(a, b):\n    return a + b\n"] * 50,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<bos>", "<eos>", "<unk>"]))
    model = dsjax.load_model("tiny")
    from dsjax.checkpoint import save_hf
    directory = save_hf(model, tmp_path / "m")
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    loaded = dsjax.load_tokenizer(directory)
    assert isinstance(loaded, HFTokenizer) and loaded.chat_template == "{{ messages }}"
    ids = loaded.encode("def add(a, b):")
    assert ids[0] == model.config.bos_token_id
    assert loaded.decode(ids[1:]) == "def add(a, b):"

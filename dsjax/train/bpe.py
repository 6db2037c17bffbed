"""A byte-level BPE tokenizer trained on the corpus with the `tokenizers` library, saved the Hugging
Face way (tokenizer.json + tokenizer_config.json with a chat template) so that both
``dsjax.load_tokenizer`` and transformers' ``PreTrainedTokenizerFast`` read it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
CHAT_ROLES = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (BOS, EOS, PAD, *CHAT_ROLES)  # ids 0..5, in this order
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2

# Role-tagged turns; an assistant turn ends with <|eos|>, so generation stops there.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles are system, user and assistant; got ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def train_bpe(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` of at most ``vocab_size`` ids (specials first)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    # GPT-2's split: runs of indentation spaces stay whole, words keep their leading space.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    # transformers adds BOS through the post-processor; dsjax's HFTokenizer adds it itself.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)])
    for token, expected in zip(SPECIAL_TOKENS, range(len(SPECIAL_TOKENS))):
        assert tokenizer.token_to_id(token) == expected, (token, tokenizer.token_to_id(token))
    return tokenizer


def save_tokenizer(tokenizer, directory: str | Path, model_max_length: int) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "additional_special_tokens": list(CHAT_ROLES),
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,  # code: " ," and " ." must survive decoding
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (directory / "special_tokens_map.json").write_text(json.dumps(
        {**specials, "additional_special_tokens": list(CHAT_ROLES)}, indent=2))
    return directory


def load_bpe(directory: str | Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))

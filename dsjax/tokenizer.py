"""Tokenizers: ``tokenizer.json`` through the `tokenizers` library, or bytes for presets without one."""

from __future__ import annotations

import json
from pathlib import Path


class ByteTokenizer:
    """UTF-8 bytes as tokens, after three specials: <bos>=0, <eos>=1, <pad>=2; byte b is id b + 3.

    Any string round-trips, so presets with random weights still take and return text.
    """

    OFFSET = 3

    def __init__(self, vocab_size: int, bos_token_id: int | None = 0, eos_token_ids: tuple[int, ...] = (1,)):
        if vocab_size < 256 + self.OFFSET:
            raise ValueError(f"a byte tokenizer needs vocab_size >= {256 + self.OFFSET}, got {vocab_size}")
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = None
        self.bos_token = self.eos_token = None  # no strings for the specials: ids only

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [b + self.OFFSET for b in text.encode("utf-8")]
        return ([self.bos_token_id] if add_special_tokens and self.bos_token_id is not None else []) + ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        data = bytes([i - self.OFFSET for i in ids if self.OFFSET <= i < 256 + self.OFFSET])
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json`` (any Hugging Face fast tokenizer) plus its tokenizer_config.json."""

    def __init__(self, directory: str | Path, bos_token_id: int | None, eos_token_ids: tuple[int, ...]):
        from tokenizers import Tokenizer

        directory = Path(directory)
        self._tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
        cfg_path = directory / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template = cfg.get("chat_template")
        self.vocab_size = self._tok.get_vocab_size()
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.add_bos = cfg.get("add_bos_token", bos_token_id is not None)
        # Special-token strings, for chat templates ({{ bos_token }}).
        self.bos_token = self._tok.id_to_token(bos_token_id) if bos_token_id is not None else None
        self.eos_token = self._tok.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

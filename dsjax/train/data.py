"""Token data: the tokenizer is trained and the corpus encoded once per (corpus, vocab size), then read
back from ``<work_dir>/data-<key>/``; training windows are sampled on the device."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
import time
from pathlib import Path

import jax
import numpy as np

from dsjax.train.bpe import BOS_ID, EOS_ID, TOKENIZER_FILES, save_tokenizer, train_bpe
from dsjax.train.corpus import Corpus, read_text

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TokenData:
    directory: Path  # tokenizer files, train.npy, heldout.npy, data.json
    train_ids: np.ndarray  # i32[N_train]: every training file as <|bos|> ... <|eos|>, concatenated
    heldout_ids: np.ndarray  # i32[N_heldout]
    info: dict  # corpus description, token counts, bytes per token, preparation seconds

    @property
    def tokenizer_dir(self) -> Path:
        return self.directory


def _encode_files(tokenizer, files) -> np.ndarray:
    encodings = tokenizer.encode_batch([read_text(p) for p in files], add_special_tokens=False)
    pieces = [np.asarray([BOS_ID, *e.ids, EOS_ID], np.int32) for e in encodings]
    return np.concatenate(pieces) if pieces else np.zeros((0,), np.int32)


def prepare_data(corpus: Corpus, vocab_size: int, model_max_length: int, work_dir: str | Path) -> TokenData:
    """Trains the tokenizer on the training files and encodes both splits, unless already cached."""
    key = hashlib.sha256(f"{corpus.fingerprint()}:{vocab_size}".encode()).hexdigest()[:12]
    directory = Path(work_dir) / f"data-{key}"
    if not (directory / "data.json").is_file():
        start = time.perf_counter()
        scratch = directory.with_name(directory.name + ".partial")
        shutil.rmtree(scratch, ignore_errors=True)
        log.info("training a %d-token BPE on %d files, then encoding", vocab_size, len(corpus.train_files))
        tokenizer = train_bpe((read_text(p) for p in corpus.train_files), vocab_size)
        save_tokenizer(tokenizer, scratch, model_max_length)
        train_ids = _encode_files(tokenizer, corpus.train_files)
        heldout_ids = _encode_files(tokenizer, corpus.heldout_files)
        np.save(scratch / "train.npy", train_ids)
        np.save(scratch / "heldout.npy", heldout_ids)
        described = corpus.describe()
        info = {**described, "vocab_size": tokenizer.get_vocab_size(), "train_tokens": int(train_ids.size),
                "heldout_tokens": int(heldout_ids.size),
                "bytes_per_token": described["train_bytes"] / max(int(train_ids.size), 1),
                "prepare_seconds": time.perf_counter() - start}
        (scratch / "data.json").write_text(json.dumps(info, indent=2))
        shutil.rmtree(directory, ignore_errors=True)
        scratch.rename(directory)  # complete or absent, never half-written
    info = json.loads((directory / "data.json").read_text())
    return TokenData(directory, np.load(directory / "train.npy"), np.load(directory / "heldout.npy"), info)


def copy_tokenizer(data: TokenData, out_dir: str | Path) -> None:
    for name in TOKENIZER_FILES:
        shutil.copy2(data.directory / name, Path(out_dir) / name)


def sample_windows(tokens, key, batch_size: int, length: int):
    """tokens i32[N] (on device) -> i32[batch_size, length] windows at uniform random starts."""
    starts = jax.random.randint(key, (batch_size,), 0, tokens.shape[0] - length + 1)
    return jax.vmap(lambda s: jax.lax.dynamic_slice_in_dim(tokens, s, length))(starts)


def heldout_windows(tokens: np.ndarray, length: int, max_windows: int, batch_size: int) -> np.ndarray:
    """i32[W, length]: consecutive windows overlapping by one token (each position predicted once),
    evenly thinned to at most ``max_windows``, W a multiple of min(batch_size, windows available)."""
    available = (tokens.size - 1) // (length - 1)
    if available < 1:
        raise ValueError(f"the held-out split has {tokens.size} tokens, fewer than one window of {length}; "
                         "hold out more modules or shorten seq_len")
    count = min(available, max_windows)
    count -= count % min(batch_size, count)
    starts = [(i * available // count) * (length - 1) for i in range(count)]
    return np.stack([tokens[s:s + length] for s in starts])

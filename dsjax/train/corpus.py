"""The training corpus: the Python standard library of the interpreter running this, as a sorted list
of ``.py`` files split into training files and a few held-out modules."""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import sysconfig
from pathlib import Path

from dsjax.config import ConfigError

SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
HASH_SPLIT_PERCENT = 2  # held-out share when none of the named modules exists


@dataclasses.dataclass(frozen=True)
class Corpus:
    root: Path
    train_files: tuple[Path, ...]
    heldout_files: tuple[Path, ...]
    heldout_modules: tuple[str, ...]  # the modules actually held out ("hash split" when none existed)

    @property
    def python_version(self) -> str:
        return sys.version.split()[0]

    def describe(self) -> dict:
        size = lambda files: sum(p.stat().st_size for p in files)
        return {"python": self.python_version, "stdlib": str(self.root),
                "train_files": len(self.train_files), "train_bytes": size(self.train_files),
                "heldout_files": len(self.heldout_files), "heldout_bytes": size(self.heldout_files),
                "heldout_modules": list(self.heldout_modules)}

    def fingerprint(self) -> str:
        """Changes when the file list, a file's size or the interpreter does."""
        h = hashlib.sha256(self.python_version.encode())
        for tag, files in (("train", self.train_files), ("heldout", self.heldout_files)):
            for p in files:
                h.update(f"{tag}:{p.relative_to(self.root)}:{p.stat().st_size}\n".encode())
        return h.hexdigest()[:16]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path) -> list[Path]:
    """Every .py file under ``root`` outside test directories and site-packages, sorted by relative path."""
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in SKIPPED_DIRS for part in rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _module_of(path: Path, root: Path) -> str:
    rel = path.relative_to(root)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _hash_percent(rel: str) -> int:
    return int.from_bytes(hashlib.sha256(rel.encode()).digest()[:4], "big") % 100


def load_corpus(heldout_modules: tuple[str, ...], max_files: int | None = None,
                root: Path | None = None) -> Corpus:
    """Held-out: the named modules that exist; if none does, a deterministic 2% by hash of the path.

    ``max_files`` keeps that many training files, evenly spaced over the sorted list (all of the
    held-out files stay, so evaluation is the same for quick and full runs).
    """
    root = root or stdlib_root()
    files = stdlib_files(root)
    if not files:
        raise ConfigError(f"no .py files under the stdlib directory {root}")
    present = tuple(m for m in heldout_modules if any(_module_of(p, root) == m for p in files))
    if present:
        is_heldout = lambda p: _module_of(p, root) in present
    else:
        is_heldout = lambda p: _hash_percent(p.relative_to(root).as_posix()) < HASH_SPLIT_PERCENT
    train = [p for p in files if not is_heldout(p)]
    heldout = [p for p in files if is_heldout(p)]
    if max_files is not None and max_files < len(train):
        train = [train[i * len(train) // max_files] for i in range(max_files)]
    return Corpus(root, tuple(train), tuple(heldout), present or ("hash split",))


def read_text(path: Path) -> str:
    # A few stdlib files carry latin-1 bytes in comments; keep them rather than fail.
    return path.read_bytes().decode("utf-8", errors="replace")

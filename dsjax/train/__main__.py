"""``python -m dsjax.train [--config configs/train/default-model.yaml] [--steps N] [--out DIR] ...``"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys

from dsjax.config import ConfigError
from dsjax.train.config import DTYPES
from dsjax.train.pipeline import DEFAULT_CONFIG, run

DEFAULT_OUT = "models/default"
DEFAULT_WORK_DIR = "tmp/train"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dsjax.train", description=(
        "Train a small DeepSeek-V3 model on the Python standard library and export it in the Hugging Face "
        "layout (config.json, model.safetensors, tokenizer files, README.md model card)."))
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML with model: and train: sections")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"export directory (default {DEFAULT_OUT})")
    p.add_argument("--work-dir", default=DEFAULT_WORK_DIR,
                   help=f"tokenizer/token cache, checkpoints and log (default {DEFAULT_WORK_DIR})")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --work-dir")
    p.add_argument("--steps", type=int, help="total optimizer steps (overrides train.steps)")
    p.add_argument("--batch-size", type=int, help="windows per step (overrides train.batch_size)")
    p.add_argument("--seq-len", type=int, help="tokens per window (overrides train.seq_len)")
    p.add_argument("--dtype", choices=DTYPES, help="compute dtype (overrides train.dtype)")
    p.add_argument("--max-files", type=int, help="training files kept, for quick runs (overrides train.max_files)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def _log_to_stderr() -> None:
    """dsjax's INFO lines on stderr (jax/absl may already own the root logger; orbax's stay quiet)."""
    logger = logging.getLogger("dsjax")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    try:
        return run(args.config, out=args.out, work_dir=args.work_dir, resume=args.resume, steps=args.steps,
                   batch_size=args.batch_size, seq_len=args.seq_len, dtype=args.dtype, max_files=args.max_files,
                   progress=not args.no_progress, command=shlex.join(["python", "-m", "dsjax.train", *argv]))
    except ConfigError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    _log_to_stderr()
    main()

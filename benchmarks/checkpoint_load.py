"""Restore time: Hugging Face safetensors (name mapping, transposes, expert stacking) vs dsjax's orbax
checkpoint of the same converted weights.

    python -m benchmarks.checkpoint_load --preset deepseek-v2-lite --layers 2 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

import dsjax
from benchmarks.common import environment, markdown_table, write_result
from dsjax.checkpoint import save_hf, save_orbax
from dsjax.config import ModelConfig
from dsjax.model import random_model


def _timed_load(path, dtype, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model = dsjax.load_model(path, dtype=dtype, progress=False)
        jax.block_until_ready(jax.tree.leaves(dsjax.model.transformer.nnx.state(model)))
        times.append(time.perf_counter() - start)
        del model
    return min(times), times


def run(preset: str, layers: int | None, dtype: str, repeats: int, workdir: Path | None) -> dict:
    config = ModelConfig.preset(preset)
    if layers is not None:
        config = dataclasses.replace(config, num_hidden_layers=layers,
                                     first_k_dense_replace=min(config.first_k_dense_replace, layers))
    work = Path(workdir or tempfile.mkdtemp(prefix="dsjax-ckpt-"))
    model = random_model(config, dtype=dtype)
    hf_dir, orbax_dir = save_hf(model, work / "hf"), save_orbax(model, work / "orbax")
    tokens = np.arange(8, dtype=np.int32)[None] + 3
    reference = np.asarray(model.logits(tokens))
    del model
    hf_best, hf_all = _timed_load(hf_dir, dtype, repeats)
    orbax_best, orbax_all = _timed_load(orbax_dir, dtype, repeats)
    restored = dsjax.load_model(orbax_dir, dtype=dtype)
    assert np.array_equal(np.asarray(restored.logits(tokens)), reference), "orbax restore changed the weights"
    size = sum(p.stat().st_size for p in hf_dir.glob("*.safetensors"))
    shutil.rmtree(work, ignore_errors=True)
    rows = [
        {"format": "hugging face safetensors", "seconds": hf_best, "GB/s": size / hf_best / 1e9},
        {"format": "dsjax orbax", "seconds": orbax_best, "GB/s": size / orbax_best / 1e9},
    ]
    return {
        **environment(),
        "preset": preset, "num_hidden_layers": config.num_hidden_layers, "dtype": dtype,
        "params": config.num_params(), "checkpoint_bytes": size, "repeats": repeats,
        "hf_seconds": hf_all, "orbax_seconds": orbax_all, "orbax_speedup": hf_best / orbax_best,
        "rows": rows, "table": markdown_table(rows, ["format", "seconds", "GB/s"]),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="deepseek-v2-lite")
    parser.add_argument("--layers", type=int, default=2, help="truncate the preset to this many layers")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--out", default="checkpoint_load", help="results/<out>.json")
    args = parser.parse_args(argv)
    result = run(args.preset, args.layers, args.dtype, args.repeats, args.workdir)
    print(result["table"])
    print(f"orbax restores {result['orbax_speedup']:.1f}x faster ({result['params'] / 1e9:.2f}B parameters, "
          f"{result['checkpoint_bytes'] / 1e9:.2f} GB)")
    print("wrote", write_result(args.out, result))


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# One device round on an H200 (see .library device notes): GPU correctness, then the kernel
# benchmarks with their tuned defaults. Results land in $OUT (or benchmarks/results/ without it).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python -c "import jax, jaxlib; print(jax.__version__, jax.devices())"
timeout 300 python -m pytest tests/gpu -q -x -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/gpu_tests.log"
timeout 150 python benchmarks/kernels_attention.py --no-sweep --out "$OUT/attention_h200.json" 2>&1 | tail -30
timeout 150 python benchmarks/kernels_moe.py --no-sweep --out "$OUT/moe_h200.json" 2>&1 | tail -30

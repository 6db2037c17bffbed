#!/usr/bin/env bash
# Device round 2: GPU correctness (all), then the full MoE kernel sweep (saved after every shape).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
timeout 200 python -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
timeout 370 python benchmarks/kernels_moe.py --out "$OUT/moe_h200" 2>&1 | grep -vi warn | tee "$OUT/moe_sweep.log" | tail -60

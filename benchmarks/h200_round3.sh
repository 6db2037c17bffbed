#!/usr/bin/env bash
# Device round 3: full GPU test output (diagnosis), then the decode-kernel sweep.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
timeout 200 python -m pytest tests/gpu -q -p no:cacheprovider -rA -s > "$OUT/gpu_tests_full.log" 2>&1
grep -E "^(PASSED|FAILED|ERROR)|float32 \{|bfloat16 \{|Error|assert " "$OUT/gpu_tests_full.log" | head -40
timeout 330 python benchmarks/kernels_attention.py --only decode --out "$OUT/attention_decode.json" 2>&1 | grep -vi warn | tail -25

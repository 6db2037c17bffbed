#!/usr/bin/env bash
# Device round 4: GPU tests after the f32 tile fix, then a first V2-Lite engine decode probe.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
timeout 200 python -m pytest tests/gpu -q -p no:cacheprovider -rA > "$OUT/gpu_tests_full.log" 2>&1
grep -E "^(PASSED|FAILED|ERROR)|Error:|assert " "$OUT/gpu_tests_full.log" | head -30
timeout 330 python -m benchmarks.decode_probe --preset deepseek-v2-lite --batches 1 64 --prompt 128 --steps 24 \
  --out decode_probe_v2lite 2>&1 | grep -vi warn | tail -12
cp benchmarks/results/decode_probe_v2lite.json "$OUT/" 2>/dev/null

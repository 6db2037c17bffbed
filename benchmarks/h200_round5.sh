#!/usr/bin/env bash
# Is the step time proportional to the KV pool size (a per-step copy of the cache)?
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
for gib in 4 32; do
  timeout 150 python -m benchmarks.decode_probe --preset deepseek-v2-lite --batches 1 64 --prompt 128 --steps 16 \
    --kv-cache-gib $gib --out probe_$gib 2>&1 | grep -E "^\| [0-9]|setup"
done

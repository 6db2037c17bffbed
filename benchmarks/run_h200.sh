#!/usr/bin/env bash
# Everything measured on one H200, in the order of a device session (each part fits a 10-minute call;
# run them as separate calls: `bash benchmarks/run_h200.sh PART`, PART one of
# tests|tests-model|decode-round|decode-ab|decode-knobs|decode-absorb|decode-folds|decode-residual|decode-round16|decode-round19|moe-mgpu|megakernel|gemv-chain|step-phases|step-block|step-attention|step-chains|step-layer|step-engine|step-verify|step-code|step-curve|step-without|step-round29|step-merge|host-launch|step-graphs|round33-tests|round33-ab|step-context|merge-context|sampler-ab|graphs-ab|barriers|ll-bound|ring10|code-pad|ptx|chunk-cuts|phase-cuts|phase2-parts|step-knobs-tests|step-knobs-ab|round35-ab|round35-graphs|round36|knobs-curve|xla-flags|host-swing|engine-trace|multi-step-tests|multi-step-curve|step-kernel-trace|step-profile|step-router|step-traces|pdl|persistent|attention-decode|attention-prefill|moe|moe-focus|moe-waves|gemv|decode|train|e2e|kvquant|kvquant-kernels|kvquant-sweep|mla8|mla8-fence|mla8-many|wgmma|l2-staging|l2-chain|l2-experts|tma-stream|parallel|host).
# Results go to $OUT when set (the device tool's folder), else to benchmarks/results/.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
part=${1:-tests}
MODEL_TESTS="engine_pallas or paged_decode_pallas or model_bf16 or every_kernel_at_tiny"
# GPU tests matching $1, then the batch-$b compiled step (V2-Lite) as built and under the --variant
# arguments after $3, in turns, for each b in $2: results in $OUT/step_ab_$3_b<b>_h200.json
tests_then_step_ab() {
  local tests=$1 batches=$2 name=$3; shift 3
  timeout 200 python -m pytest tests/gpu -q -p no:cacheprovider -rf -k "$tests" 2>&1 \
    | tee "$OUT/gpu_tests_$name.log" | tail -3
  for b in $batches; do
    timeout 190 python -m benchmarks.step_profile --preset deepseek-v2-lite --batch "$b" --num-kv-blocks 2048 \
      --rounds 3 --variant built "$@" --out "$OUT/step_ab_${name}_b${b}_h200.json" 2>&1 | grep -E "^\||Error"
  done
}
case $part in
  tests)      # kernels on the GPU vs references (the whole-model checks are tests-model: one call each fits)
    timeout 560 python -m pytest tests/gpu -q -p no:cacheprovider -rf -k "not ($MODEL_TESTS)" 2>&1 \
      | tee "$OUT/gpu_tests.log" | tail -15 ;;
  tests-model)  # the engine and the paged forward with kernel_backend="pallas" vs the reference path
    timeout 560 python -m pytest tests/gpu -q -p no:cacheprovider -rf -k "$MODEL_TESTS" 2>&1 \
      | tee "$OUT/gpu_tests_model.log" | tail -15 ;;
  decode-round)  # after a change to the decode path: its GPU tests, a batch-1 step profile, the small-batch curve
    timeout 240 python -m pytest tests/gpu -q -p no:cacheprovider -rf \
      -k "stacked or moe_decode or write_latents or engine_pallas" 2>&1 | tee "$OUT/gpu_tests_decode.log" | tail -4
    timeout 150 python -m benchmarks.step_profile --preset deepseek-v2-lite --batch 1 --num-kv-blocks 2048 --top 60 \
      --trace-dir /tmp/trace_b1 | grep -vi warn | tee "$OUT/profile_b1.txt" | head -30
    timeout 150 python -m dsjax.bench decode-curve --batches 1 2 4 8 16 32 64 --prompts 128 --out-dir "$OUT" \
      | grep "decode-curve b" ;;
  decode-ab)  # the decode launches' GPU tests and the kernels A/B (about 6 minutes)
    timeout 240 python -m pytest tests/gpu -q -p no:cacheprovider -rf \
      -k "stacked or moe_decode or write_latents or paged_decode_pallas" \
      2>&1 | tee "$OUT/gpu_tests_ab.log" | tail -4
    timeout 300 python benchmarks/kernels_gemv.py --only fused_launches moe_one_launch \
      --out "$OUT/gemv_decode_h200" | tail -60 ;;
  decode-knobs)  # the batch-1 compiled step under the decode kernels' trace-time tile knobs, A/B in turns (~4 minutes)
    g=pallas_kernels.stacked_gemv; m=pallas_kernels.mla_decode; d=dsjax.model.dispatch
    timeout 560 python -m benchmarks.step_profile --preset deepseek-v2-lite --batch 1 --num-kv-blocks 2048 \
      --rounds 2 --variant built --variant "moe 8 warps: $d.MOE_DECODE_TILES.num_warps=8" \
      --variant "moe k256: $d.MOE_DECODE_TILES.block_k=256" \
      --variant "gemv 1 wave: $g.TARGET_WAVES=1" --variant "gemv 4 waves: $g.TARGET_WAVES=4" \
      --variant "gemv 64 cols: $g.WIDE_MIN_WIDTH=1000000" --variant "gemv 128 cols: $g.BLOCK_N=128" \
      --variant "gemv k64: $g.BLOCK_K=64" --variant "gemv k256: $g.BLOCK_K=256" \
      --variant "absorb 4: pallas_kernels.latent_write.ONE_TOKEN_ABSORB_TILES=4" \
      --variant "absorb 16: pallas_kernels.latent_write.ONE_TOKEN_ABSORB_TILES=16" \
      --variant "attn 66 programs: $m.TARGET_PROGRAMS=66" --variant "attn 264 programs: $m.TARGET_PROGRAMS=264" \
      --variant "attn latency k64: $m.LATENCY_BLOCKS.block_k=64" \
      --out "$OUT/step_ab_knobs_h200.json" 2>&1 | grep -E "^round|^\||Error" ;;
  decode-absorb)  # write_latents' programs a head: one token's at batch 1, more tokens' at batch 8, A/B in turns (~3 minutes)
    for b in 1 8; do
      a=pallas_kernels.latent_write.$([ $b = 1 ] && echo ONE_TOKEN_ABSORB_TILES || echo ABSORB_TILES)
      timeout 270 python -m benchmarks.step_profile --preset deepseek-v2-lite --batch $b --num-kv-blocks 2048 \
        --rounds 3 --variant built --variant "absorb 4: $a=4" --variant "absorb 8: $a=8" \
        --variant "absorb 16: $a=16" --out "$OUT/step_ab_absorb_b${b}_h200.json" 2>&1 | grep -E "^\||Error"
    done ;;
  decode-folds)  # the MoE norm finished in the routing kernel (as built) or in the stacked GEMV: GPU tests, then
                 # batch 1 and 2 step A/Bs in turns (~4 minutes; the residual-in-the-sum fold measured with it
                 # 2026-12-02 lost 39 µs and is gone, git 1740334)
    tests_then_step_ab "route_finishes or moe_decode_gpu or paged_decode_pallas" "1 2" folds \
      --variant "norm in stacked gemv: dsjax.model.dispatch.ROUTER_NORM_IN_ROUTE=False" ;;
  decode-residual)  # the MoE residual added by the experts' launch (as built at one token): GPU tests, batch 1 / 2
                    # step A/Bs in turns, then the batch-1 step's op profile as built (~6 minutes)
    tests_then_step_ab "moe_decode_gpu or paged_decode_pallas" "1 2" residual \
      --variant "residual after the sum: dsjax.model.dispatch.MOE_DECODE_RESIDUAL_MAX_TOKENS=0"
    timeout 120 python -m benchmarks.step_profile --preset deepseek-v2-lite --batch 1 --num-kv-blocks 2048 --top 60 \
      --trace-dir /tmp/trace_b1 | grep -vi warn > "$OUT/profile_b1.txt"; head -40 "$OUT/profile_b1.txt" ;;
  decode-round16)  # the routing launch's normed rows from 4 programs of their own (as built) against 0 / 16:
                   # GPU tests, then batch 1 / 2 step A/Bs in turns (~5 minutes; W_UV's one-split GEMV tiles
                   # measured with them 2026-12-02 lost 20 µs and are gone, git a403d29)
    d=dsjax.model.dispatch
    tests_then_step_ab "route_finishes or paged_decode_pallas" "1 2" round16 \
      --variant "rows by the routing program: $d.ROUTE_ROWS_PROGRAMS=0" \
      --variant "16 rows programs: $d.ROUTE_ROWS_PROGRAMS=16" ;;
  decode-round19)  # moe_decode with 4 pipeline stages (40.5-40.8 µs alone against 41.3, gemv_moe_stages_h200.json):
                   # its GPU test, then batch 1 / 2 compiled-step A/Bs in turns (~4 minutes; lost in session 33)
    d=dsjax.model.dispatch
    tests_then_step_ab "moe_decode_gpu" "1 2" round19 --variant "moe_decode 4 stages: $d.MOE_DECODE_TILES.num_stages=4" ;;
  moe-mgpu)   # the TMA-fed Mosaic GPU expert launch: its GPU test, errors and kernel times beside the Triton
              # launch at V2-Lite's one-token layer, at 3 and 5 ring slots too, and its trace
              # (benchmarks/moe_mgpu_probe.py), then, if the test passed, the batch-1 compiled step with it
              # (as built) and with the Triton launch, in turns (~5 minutes)
    timeout 150 python -m pytest tests/gpu -q -p no:cacheprovider -rf -k "moe_decode_mgpu" 2>&1 \
      | tee "$OUT/gpu_tests_moe_mgpu.log" | tail -8
    passed=${PIPESTATUS[0]}
    timeout 200 python -m benchmarks.moe_mgpu_probe --variant RING=3 --variant RING=5 --trace "$OUT/trace_moe_mgpu" \
      --out "$OUT/moe_mgpu_h200.json" 2>&1 | grep -v -i warn | tail -30
    if [ "$passed" = 0 ]; then
      timeout 200 python -m benchmarks.step_profile --preset deepseek-v2-lite --batch 1 --num-kv-blocks 2048 \
        --rounds 3 --variant built --variant "triton: dsjax.model.dispatch.MOE_DECODE_MGPU=False" \
        --out "$OUT/step_ab_moe_mgpu_b1_h200.json" 2>&1 | grep -E "^\||Error"
    fi ;;
  megakernel)  # a batch-1 layer as one persistent kernel's stream and grid barriers (benchmarks/megakernel_probe.py),
               # after the one-token expert launch's GPU test and before the small-batch curve (~6 minutes)
    timeout 150 python -m pytest tests/gpu -q -p no:cacheprovider -rf -k "moe_decode_mgpu" 2>&1 \
      | tee "$OUT/gpu_tests_moe_mgpu.log" | tail -3
    timeout 240 python -m benchmarks.megakernel_probe --out "$OUT/megakernel_probe_h200.json" 2>&1 \
      | grep -v -i warn | tail -10
    timeout 150 python -m dsjax.bench decode-curve --batches 1 2 32 --prompts 128 --out-dir "$OUT" \
      | grep "decode-curve b" ;;
  gemv-chain)  # the batch-1 step kernel's first phase (pallas_kernels/decode_step_mgpu.gemv_chain): its GPU test,
               # then 26 dependent 2048 x 2048 GEMVs in one kernel against a launch a layer (~3 minutes)
    timeout 150 python -m pytest tests/gpu -q -p no:cacheprovider -rf -k "gemv_chain" 2>&1 \
      | tee "$OUT/gpu_tests_gemv_chain.log" | tail -3
    timeout 200 python -m benchmarks.megakernel_probe --gemv-chain --out "$OUT/gemv_chain_h200.json" 2>&1 \
      | grep -v -i warn | tail -8 ;;
  step-phases)  # the step kernel's phases (pallas_kernels/decode_step_mgpu.py, decode_step_moe.py): GPU tests of the
                # GEMV, expert, MoE-half and layer-tail chains; the expert chain (8 of V2-Lite's layers; tiles whole,
                # dealt or split) against a launch a layer, traced (~7 minutes; then step-block)
    timeout 260 python -m pytest tests/gpu -q -p no:cacheprovider -rf \
      -k "gemv_chain or moe_chain or moe_block_chain or moe_layer_tail" 2>&1 | tee "$OUT/gpu_tests_step_phases.log" | tail -4
    timeout 180 python -m benchmarks.megakernel_probe --moe-chain 8 --trace "$OUT/trace" \
      --out "$OUT/moe_chain_h200.json" 2>&1 | grep -v -i warn | tail -30 ;;
  step-block)   # the MoE halves (norm, router and routing in the kernel) and the layer tails (o_proj in front), 8
                # layers, each plan, against the expert chain given the routing; traced (~5 minutes)
    timeout 300 python -m benchmarks.megakernel_probe --moe-block-chain 8 --trace "$OUT/trace" \
      --out "$OUT/moe_block_chain_h200.json" 2>&1 | grep -v -i warn | tail -40 ;;
  step-attention)  # the attention halves in one kernel (pallas_kernels/decode_step_attention.py): GPU tests at 4
                   # positions, then 8 of V2-Lite's layers at positions 0, 255, 511, traced (~4 minutes)
    timeout 200 python -m pytest tests/gpu -q -p no:cacheprovider -rf -x -k "attention_chain" 2>&1 \
      | tee "$OUT/gpu_tests_step_attention.log" | tail -30
    timeout 200 python -m benchmarks.megakernel_probe --attention-chain 8 --trace "$OUT/trace" \
      --out "$OUT/attention_chain_h200.json" 2>&1 | grep -v -i warn | tail -40 ;;
  step-chains)  # every step-kernel chain checked and timed in one call: GPU tests of the attention, expert, MoE-half
                # and layer-tail chains, then the attention chain and the split-plan MoE halves, untraced (~8 minutes)
    timeout 300 python -m pytest tests/gpu -q -p no:cacheprovider -rf \
      -k "attention_chain or moe_chain or moe_block_chain or moe_layer_tail" 2>&1 | tee "$OUT/gpu_tests_step_chains.log" | tail -6
    timeout 150 python -m benchmarks.megakernel_probe --attention-chain 8 --out "$OUT/attention_chain_h200.json" \
      2>&1 | grep -v -i warn | tail -6
    timeout 150 python -m benchmarks.megakernel_probe --moe-block-chain 8 --only split routing \
      --out "$OUT/moe_block_chain_split_h200.json" 2>&1 | grep -v -i warn | tail -6 ;;
  step-layer)  # the GPU tests of the step kernels (since round 25: two warpgroups, the producer routing) and of
               # the model's one-token steps through the whole-layer kernel (~8 minutes)
    timeout 560 python -m pytest tests/gpu -q -p no:cacheprovider -rf \
      -k "gemv_chain or attention_chain or moe_block_chain or moe_layer_tail or moe_layer_chain or step_kernel" 2>&1 \
      | tee "$OUT/gpu_tests_step_layer.log" | tail -8 ;;
  step-engine)  # the engine's one-token steps through the step kernel: the model's GPU tests (the MoE stack's rope
                # columns readied on Hopper) and the kernel in a model's steps, then the batch-1 compiled step A/B,
                # dispatch.STEP_KERNEL off / on (~8 minutes)
    timeout 320 python -m pytest tests/gpu -q -p no:cacheprovider -rf -k "$MODEL_TESTS or step_kernel" 2>&1 \
      | tee "$OUT/gpu_tests_step_engine.log" | tail -6
    timeout 250 python -m benchmarks.step_profile --preset deepseek-v2-lite --batch 1 --num-kv-blocks 2048 \
      --rounds 3 --variant built --variant "step kernel: dsjax.model.dispatch.STEP_KERNEL=True" \
      --out "$OUT/step_ab_step_kernel_b1_h200.json" 2>&1 | grep -E "^\||Error" ;;
  step-verify)  # round 25's two-warpgroup MoE kernels (the producer routes) on the GPU: the MoE half (split plan)
                # and the whole layer (~3 minutes)
    timeout 170 python -m pytest tests/gpu -q -p no:cacheprovider -rf \
      -k "moe_block_chain_gpu and split or moe_layer_chain_gpu" 2>&1 | tee "$OUT/gpu_tests_step_verify.log" | tail -4 ;;
  step-code)  # the step kernels' GPU tests, then the whole layer, the attention chain and the tail at 8 layers, each
              # kernel's machine code sized (benchmarks/code_size.py on the PTX Mosaic GPU dumps; ~7 minutes)
    timeout 250 python -m pytest tests/gpu -q -p no:cacheprovider -rf \
      -k "gemv_chain or attention_chain or moe_block_chain_gpu and split or moe_layer_chain_gpu or moe_layer_tail" \
      2>&1 | tee "$OUT/gpu_tests_step_code.log" | tail -4
    rm -rf /tmp/ptx_dump && mkdir -p /tmp/ptx_dump
    MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=/tmp/ptx_dump timeout 250 python -m benchmarks.megakernel_probe \
      --layer-chain 8 --out "$OUT/layer_chain_code_h200.json" 2>&1 | grep -E "^\|"
    python -m benchmarks.code_size /tmp/ptx_dump --out "$OUT/code_size_h200.json" ;;
  step-curve)  # the engine with the step kernel on (dispatch.STEP_KERNEL, round 26): the small-batch decode curve,
               # batch 1 through the kernel, 2 and 32 through the launches (~3 minutes)
    timeout 200 python -m dsjax.bench decode-curve --batches 1 2 32 --prompts 128 --out-dir "$OUT" \
      --tag h200_b1b2b32_step_kernel | grep "decode-curve b" ;;
  step-without)  # diagnostics: the whole layer with its tensor products left out (wgmma a no-op), and with its TMA
                 # stores' waits and proxy fences left out (results wrong, no hang), beside it as built, 8 layers:
                 # what the products and the stores' round trips hold up (~5 minutes)
    timeout 450 python -m benchmarks.megakernel_probe --layer-chain 8 --without products --without store_waits \
      --out "$OUT/layer_chain_without_h200.json" 2>&1 | grep -E "^\||^\{" ;;
  step-round29)  # round 29: the GPU tests of the whole layer and of the engine's steps through it (phase 3's query
                 # windows by TMA, QUERY_TMA, now on); the batch-1 compiled step with it and with the warpgroup's
                 # loads, in turns; the step's device ops; the engine at batch 1 / 2 / 32 (~8 minutes)
    timeout 150 python -m pytest tests/gpu -q -p no:cacheprovider -rf \
      -k "layer_chain_gpu or attention_chain_gpu or through_the_step_kernel" 2>&1 | tee "$OUT/gpu_tests_round29.log" | tail -2
    timeout 170 python -m benchmarks.step_profile --preset deepseek-v2-lite --batch 1 --num-kv-blocks 2048 \
      --rounds 2 --variant built --variant "query loads: pallas_kernels.decode_step_attention.QUERY_TMA=False" \
      --out "$OUT/step_ab_query_tma_b1_h200.json" 2>&1 | grep -E "^\||Error"
    timeout 70 python -m benchmarks.step_profile --preset deepseek-v2-lite --batch 1 --num-kv-blocks 2048 \
      --trace-dir "$OUT/trace" --top 40 2>&1 | grep -v "^WARNING" | tail -90 > "$OUT/step_profile_b1.txt"
    head -4 "$OUT/step_profile_b1.txt"
    timeout 200 python -m dsjax.bench decode-curve --batches 1 2 32 --prompts 128 --out-dir "$OUT" \
      --tag h200_b1b2b32_step_kernel | grep "decode-curve b" ;;
  step-merge)  # round 29: phase 4's merge group (decode_step_attention.MERGE_GROUP; 8 as built, 4, 2): the attention
               # chain's GPU tests (two groups of 4 and of 2 among them), the batch-1 compiled step under each, in
               # turns (~6 minutes)
    timeout 120 python -m pytest tests/gpu -q -p no:cacheprovider -rf -k "attention_chain_gpu" 2>&1 \
      | tee "$OUT/gpu_tests_merge.log" | tail -2
    timeout 300 python -m benchmarks.step_profile --preset deepseek-v2-lite --batch 1 --num-kv-blocks 2048 \
      --rounds 2 --variant built --variant "merge 4: pallas_kernels.decode_step_attention.MERGE_GROUP=4" \
      --variant "merge 2: pallas_kernels.decode_step_attention.MERGE_GROUP=2" \
      --out "$OUT/step_ab_merge_b1_h200.json" 2>&1 | grep -E "^\||Error" ;;
  host-launch)  # round 31's next step: the host's share of a batch-1 engine step under XLA command-buffer settings,
                # one process each: the engine and device step (decode-curve, batch 1) and each step's launch call
                # (host_overhead --device, async); settings in $2 (default: all four, ~2.5 minutes each):
                # built, skip_profiled / skip_temp (--xla_gpu_command_buffer_update_mode: graphs not updated for
                # buffers whose address stays; the CUDA graph is re-created on every call as built), off (no graphs)
    for setting in ${2:-built skip_profiled skip_temp off}; do
      case $setting in
        built) flags= ;;
        skip_profiled) flags=--xla_gpu_command_buffer_update_mode=SKIP_PROFILED ;;
        skip_temp) flags=--xla_gpu_command_buffer_update_mode=SKIP_TEMP ;;
        off) flags=--xla_gpu_enable_command_buffer= ;;
        *) echo "host-launch: setting $setting; accepted: built skip_profiled skip_temp off" >&2; exit 2 ;;
      esac
      echo "== $setting ($flags)"
      XLA_FLAGS=$flags timeout 150 python -m dsjax.bench decode-curve --batches 1 --prompts 128 --out-dir "$OUT" \
        --tag "h200_b1_graphs_$setting" 2>&1 | grep "decode-curve b"
      XLA_FLAGS=$flags timeout 150 python -m benchmarks.host_overhead --device --async-scheduling \
        --preset deepseek-v2-lite --dtype bfloat16 --block-size 64 --batches 1 --prompt 128 --steps 400 --profile 0 \
        --out "$OUT/host_overhead_device_b1_graphs_${setting}_h200" 2>&1 | grep -E "^\| (batch|1) "
    done ;;
  step-graphs)  # round 32: the batch-1 compiled step as built (its forward without CUDA graphs, one packed
               # transfer a step) against the graphs on (runner.STEP_KERNEL_GRAPHS), in turns; then step-curve
               # (~6 minutes)
    timeout 300 python -m benchmarks.step_profile --preset deepseek-v2-lite --batch 1 --num-kv-blocks 2048 \
      --rounds 3 --variant built --variant "graphs on: dsjax.engine.runner.STEP_KERNEL_GRAPHS=True" \
      --out "$OUT/step_ab_graphs_b1_h200.json" 2>&1 | grep -E "^\||Error"
    timeout 250 python -m dsjax.bench decode-curve --batches 1 2 32 --prompts 128 --out-dir "$OUT" \
      --tag h200_b1b2b32_step_kernel | grep "decode-curve b" ;;
  round33-tests)  # round 32's two built-off knobs, their GPU tests: layer 0's MLP by the expert launch
                 # (dispatch.DENSE_MLP_MGPU) against the stacked GEMVs and the f32 reference, and an engine over a
                 # 3-layer V2-Lite-shaped model with the greedy sampler inside the forward (runner.GREEDY_IN_FORWARD)
                 # giving the tokens of two programs a step (~4 minutes; round 32's call cut a test at 60 s, too
                 # short on a fresh machine)
    timeout 400 python -m pytest tests/gpu -q -p no:cacheprovider -rf -k "dense_mlp or greedy_steps_in_one_program" \
      2>&1 | tee "$OUT/gpu_tests_round33.log" | tail -3 ;;
  round33-ab)  # round 32's two built-off knobs in one A/B (their GPU tests: round33-tests):
              # the batch-1 compiled step as built, with layer 0's MLP by the expert launch, with the greedy sampler
              # in the forward, and with both, 2 rounds in turns, each variant compiling the timed bucket only
              # (~4 minutes; round 33's first call, compiling every bucket a variant, ran past 560 s)
    timeout 560 python -m benchmarks.step_profile --preset deepseek-v2-lite --batch 1 --num-kv-blocks 2048 \
      --rounds 2 --variant built --variant "dense mlp: dsjax.model.dispatch.DENSE_MLP_MGPU=True" \
      --variant "greedy in forward: dsjax.engine.runner.GREEDY_IN_FORWARD=True" \
      --variant "both: dsjax.model.dispatch.DENSE_MLP_MGPU=True dsjax.engine.runner.GREEDY_IN_FORWARD=True" \
      --out "$OUT/step_ab_round33_b1_h200.json" 2>&1 | grep -E "^\||^round|Error" ;;
  step-context)  # round 32's finding: the batch-1 step grows ~4.6 µs a layer from context ~142 to ~630. The kernel's
                # per-scope trace at prompts of 128 and 1024 tokens, phase by phase, to see which phase grows
                # (~6 minutes)
    for p in 128 1024; do
      timeout 280 python -m benchmarks.step_profile --preset deepseek-v2-lite --batch 1 --num-kv-blocks 2048 \
        --prompt $p --kernel-trace "$OUT/kernel_trace_p$p" 2>&1 | grep -v "^WARNING" | tail -120 \
        | tee "$OUT/step_kernel_trace_b1_p$p.txt" | tail -25
    done ;;
  merge-context)  # round 34: the batch-1 step grows with context in phase 4 (its merge: the w_uv scope 3.9 -> 6.0 µs traced
                 # from prompt 128 to 1024, the other attention phases flat; step_kernel_trace_b1_p*.txt). Merging the
                 # chunks' states 16 or 32 at a time waits out L2 once a group: the attention chain's GPU tests (groups of
                 # 16 and 32 among them), then the compiled step under each, in turns, at the prompts in $2 (default
                 # 1024; ~5 minutes a prompt: the engine's start and ~50 s of compile a variant. Round 34's call gave
                 # each prompt 200 s and got one round of two variants)
    timeout 150 python -m pytest tests/gpu -q -p no:cacheprovider -rf -k "attention_chain_gpu" 2>&1 \
      | tee "$OUT/gpu_tests_merge_context.log" | tail -2
    for p in ${2:-1024}; do
      timeout 400 python -m benchmarks.step_profile --preset deepseek-v2-lite --batch 1 --num-kv-blocks 2048 \
        --prompt $p --rounds 2 --variant built --variant "merge 16: pallas_kernels.decode_step_attention.MERGE_GROUP=16" \
        --variant "merge 32: pallas_kernels.decode_step_attention.MERGE_GROUP=32" \
        --out "$OUT/step_ab_merge_context_p${p}_b1_h200.json" 2>&1 | grep -E "^\||^round|Error"
    done ;;
  sampler-ab)  # round 34's one-pass sampler (sampler.ONE_PASS, built off: the argmax, the max and the sum of
              # exponentials in one reduction of two launches, where the greedy sampler takes five of the batch-1
              # step's 26): its tests on the GPU, then the compiled step as built, with it, and with the step kernel's bucket
              # as a CUDA graph again (round 32 measured it 10 µs slower while the sampler was a second program), in
              # turns, 2 rounds, at the batches in $2 (default 1; ~8 minutes a batch: each round compiles each
              # variant again, ~50-70 s)
    timeout 150 python -m pytest tests/engine/test_llm.py -q -p no:cacheprovider -rf -k "sampler" 2>&1 \
      | tee "$OUT/sampler_tests_gpu.log" | tail -2
    for b in ${2:-1}; do
      timeout 440 python -m benchmarks.step_profile --preset deepseek-v2-lite --batch $b --num-kv-blocks 2048 \
        --rounds 2 --variant built --variant "one pass: dsjax.engine.sampler.ONE_PASS=True" \
        --variant "graphs on: dsjax.engine.runner.STEP_KERNEL_GRAPHS=True" \
        --out "$OUT/step_ab_sampler_b${b}_h200.json" 2>&1 | grep -E "^\||^round|Error"
    done ;;
  graphs-ab)  # round 38 (H100, one round before the call's time ran out): the step kernel's bucket as a CUDA graph
             # (runner.STEP_KERNEL_GRAPHS) 2.1384 ms against 2.1511 as built. The batch-1 compiled step as built and
             # with it, 2 rounds in turns (~5 minutes; the one-pass sampler was within the swing, so it is left out)
    timeout 540 python -m benchmarks.step_profile --preset deepseek-v2-lite --batch 1 --num-kv-blocks 2048 \
      --rounds 2 --variant built --variant "graphs on: dsjax.engine.runner.STEP_KERNEL_GRAPHS=True" \
      --out "$OUT/step_ab_graphs_b1_h200.json" 2>&1 | grep -E "^\||^round|Error" ;;
  barriers)  # what each grid barrier of a layer holds up: the batch-1 compiled step as built and with every CTA
             # arriving at one named barrier without waiting (decode_step_mgpu.PROBE_NO_WAIT; results wrong, timing
             # only), one round; a variant's gain bounds what gating that boundary on its producers alone could save
             # (docs/decode_step_kernel.md's candidate). $2: attention (after phases 1-4, the default) or moe (after
             # o_proj, after the layer, and all six) (~5 minutes each)
    m=pallas_kernels.decode_step_mgpu half=${2:-attention}
    case $half in
      attention) names="phase1 phase2 phase3 phase4" ;;
      moe) names="o_proj layer" ;;
      *) echo "barriers: half '$half'; accepted: attention, moe" >&2; exit 2 ;;
    esac
    variants=(--variant built)
    for n in $names; do variants+=(--variant "no $n wait: $m.PROBE_NO_WAIT=('$n',)"); done
    all=$(python -c "from pallas_kernels.decode_step_mgpu import BARRIER_NAMES as n; print(repr(n).replace(' ', ''))")
    [ "$half" = moe ] && variants+=(--variant "no waits: $m.PROBE_NO_WAIT=$all")
    timeout 560 python -m benchmarks.step_profile --preset deepseek-v2-lite --batch 1 --num-kv-blocks 2048 \
      --rounds 1 "${variants[@]}" --out "$OUT/step_ab_barriers_${half}_b1.json" 2>&1 | grep -E "^\||^round|Error" ;;
  ring10)  # rounds 47-48: decode_step_moe.COMPACT_SMEM (the whole layers in 13 KiB less shared memory; on as built
           # since round 48) and a ring of 10 boxes (RING = 10 in the three kernel modules). $2: tests (the whole
           # layers at both positions, 40 repeated calls, the attention chain, the model's one-token steps, the
           # engine's greedy program, at RING = 10; ~6 minutes), ab (the batch-1 compiled step as built, with a
           # buffer each (COMPACT_SMEM=False), at RING = 10; 2 rounds in turns, ~5 minutes). Phase 1's L2 prefetch
           # (PREFETCH_P1, rounds 48 and 51) was removed after losing on both cards.
    m=pallas_kernels.decode_step_moe
    ten="$m.RING=10 pallas_kernels.decode_step_mgpu.RING=10 pallas_kernels.decode_step_attention.RING=10"
    case ${2:-tests} in
      tests) timeout -s KILL 420 python -c "import sys, pytest
from pallas_kernels import decode_step_attention, decode_step_mgpu, decode_step_moe
for module in (decode_step_attention, decode_step_mgpu, decode_step_moe):
    module.RING = 10
sys.exit(pytest.main(['tests/gpu', '-q', '-p', 'no:cacheprovider', '-rf', '-k', 'moe_layer_chain_gpu or \
moe_layer_chain_repeated or (attention_chain_gpu and (0-8-False or 200-8-True or 511-8-False)) or \
one_token_steps_through_the_step_kernel or engine_greedy_steps_in_one_program']))" 2>&1 \
          | tee "$OUT/gpu_tests_ring10.log" | tail -4 ;;
      ab) timeout -s KILL 420 python -m benchmarks.step_profile --preset deepseek-v2-lite --batch 1 \
          --num-kv-blocks 2048 --rounds 2 --variant built --variant "a buffer each: $m.COMPACT_SMEM=False" \
          --variant "ring 10: $ten" --out "$OUT/step_ab_ring10_b1.json" 2>&1 | grep -E "^\||^round|Error" ;;
      *) echo "ring10: '$2'; accepted: tests, ab" >&2; exit 2 ;;
    esac ;;
  code-pad)  # round 47: what the layer's instruction-cache footprint costs. The producer's last warp runs padding
             # at each layer's end (decode_step_moe.PROBE_CODE_PAD, values right), as a loop (the same work in a
             # sixteenth of the code) or straight-line (16 bytes an instruction); the batch-1 compiled step. $2:
             # sizes (loop 2048, straight 1024 / 2048 / 4096: 16 / 32 / 64 KB; 1 round, ~4 minutes), small (loop
             # 2048 and 512, straight 512; 2 rounds, ~5 minutes) or work (loop 2048 by the last one and three warps,
             # loop 8192; 1 round, ~4 minutes)
    d=pallas_kernels.decode_step_moe
    loop="$d.PROBE_CODE_PAD_LOOPED=True"
    case ${2:-sizes} in
      sizes) v=(--rounds 1 --variant "loop 2048: $d.PROBE_CODE_PAD=2048 $loop"
                --variant "straight 1024: $d.PROBE_CODE_PAD=1024" --variant "straight 2048: $d.PROBE_CODE_PAD=2048"
                --variant "straight 4096: $d.PROBE_CODE_PAD=4096") ;;
      small) v=(--rounds 2 --variant "loop 2048: $d.PROBE_CODE_PAD=2048 $loop"
                --variant "loop 512: $d.PROBE_CODE_PAD=512 $loop" --variant "straight 512: $d.PROBE_CODE_PAD=512") ;;
      work) v=(--rounds 1 --variant "loop 2048: $d.PROBE_CODE_PAD=2048 $loop"
               --variant "loop 2048 warps 1-3: $d.PROBE_CODE_PAD=2048 $loop $d.PROBE_CODE_PAD_WARPS=3"
               --variant "loop 8192: $d.PROBE_CODE_PAD=8192 $loop") ;;
      *) echo "code-pad: '$2'; accepted: sizes, small, work" >&2; exit 2 ;;
    esac
    timeout -s KILL 450 python -m benchmarks.step_profile --preset deepseek-v2-lite --batch 1 --num-kv-blocks 2048 \
      --variant built "${v[@]}" --out "$OUT/step_ab_code_pad_${2:-sizes}_b1.json" 2>&1 | grep -E "^\||^round|Error" ;;
  ll-bound)  # round 45: what flags inside the rows could save at phase 2's and phase 3's boundaries, bounded: their
             # arrivals relaxed (decode_step_mgpu.PROBE_RELAXED_AT) and their waits left out (PROBE_NO_WAIT), values
             # wrong, the routing fixed in every variant; the batch-1 compiled step. $2: bound (that and the fixed
             # routing alone, 2 rounds in turns, ~4.5 minutes; round 45 ran 1 round: -54 µs on an H100) or split
             # (each boundary alone, and the releases alone against the waits alone, 1 round, ~5 minutes)
    m=pallas_kernels.decode_step_mgpu; f=pallas_kernels.decode_step_moe.PROBE_FIXED_ROUTING=True
    both="('phase2','phase3')"
    case ${2:-bound} in
      bound) v=(--rounds 2 --variant "fixed routing: $f"
                --variant "bound: $m.PROBE_NO_WAIT=$both $m.PROBE_RELAXED_AT=$both $f") ;;
      split) v=(--rounds 1 --variant "fixed routing: $f"
                --variant "phase 2: $m.PROBE_NO_WAIT=('phase2',) $m.PROBE_RELAXED_AT=('phase2',) $f"
                --variant "phase 3: $m.PROBE_NO_WAIT=('phase3',) $m.PROBE_RELAXED_AT=('phase3',) $f"
                --variant "releases only: $m.PROBE_RELAXED_AT=$both $f" --variant "waits only: $m.PROBE_NO_WAIT=$both $f") ;;
      *) echo "ll-bound: '$2'; accepted: bound, split" >&2; exit 2 ;;
    esac
    timeout -s KILL 330 python -m benchmarks.step_profile --preset deepseek-v2-lite --batch 1 --num-kv-blocks 2048 \
      "${v[@]}" --out "$OUT/step_ab_ll_${2:-bound}_b1.json" 2>&1 | grep -E "^\||^round|Error" ;;
  ptx)  # the whole layers' PTX and ptxas report under settings $3 (Python statements, decode_step_attention and
        # decode_step_moe imported; none: as built) into $OUT/ptx_$2: compiled by one GPU test with JAX's
        # compilation cache off (a cached executable dumps nothing), only the kernel's .ptx and .ptxas kept (a call
        # returns a limited number of files). Read here: `python -m benchmarks.code_size $OUT/ptx_$2` (size,
        # registers, spills), `python -m benchmarks.sass_lines ptx_B/anonymous_0.ptx --base ptx_A/anonymous_0.ptx`
        name=${2:-built}
        mkdir -p "/tmp/ptx_$name" "$OUT/ptx_$name"
        JAX_ENABLE_COMPILATION_CACHE=false MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO="/tmp/ptx_$name" \
          timeout -s KILL 100 python -c "import sys, pytest
from pallas_kernels import decode_step_attention, decode_step_moe; ${3:-}
sys.exit(pytest.main(['tests/gpu', '-q', '-p', 'no:cacheprovider', '-k', 'moe_layer_chain_gpu and 200']))" \
          2>&1 | tail -1
        cp "/tmp/ptx_$name/anonymous_0.ptx" "/tmp/ptx_$name/anonymous_0.ptxas" "$OUT/ptx_$name/" ;;
  chunk-cuts)  # round 41: phase 3's work cut from a point on (decode_step_attention.PROBE_PHASE_CUT; values wrong,
               # every layer's picks replaced by experts 0-5 so that each variant reads the same bytes:
               # decode_step_moe.PROBE_FIXED_ROUTING): the states' stores, the value products and stores, everything
               # after the chunk's boxes land; one round (~8 minutes)
    m=pallas_kernels.decode_step_moe.PROBE_FIXED_ROUTING=True a=pallas_kernels.decode_step_attention.PROBE_PHASE_CUT
    timeout 580 python -m benchmarks.step_profile --preset deepseek-v2-lite --batch 1 --num-kv-blocks 2048 \
      --rounds 1 --variant "fixed: $m" --variant "fixed, no states out: $m $a=('chunk_states',)" \
      --variant "fixed, no values: $m $a=('chunk_values',)" --variant "fixed, no chunk: $m $a=('chunk',)" \
      --variant "fixed again: $m" --out "$OUT/step_ab_chunk_cuts_b1.json" 2>&1 | grep -E "^\||^round|Error" ;;
  phase-cuts)  # the other attention phases' work left out (decode_step_attention.PROBE_PHASE_CUT; values wrong,
               # routing fixed as in chunk-cuts): q_proj / kv_a's products and sums, phase 2's work, phase 4's
               # merge, all of phase 4; one round (~8 minutes)
    m=pallas_kernels.decode_step_moe.PROBE_FIXED_ROUTING=True a=pallas_kernels.decode_step_attention.PROBE_PHASE_CUT
    variants=(--variant "fixed: $m")
    for n in phase1 phase2 merge phase4; do variants+=(--variant "fixed, no $n: $m $a=('$n',)"); done
    timeout 580 python -m benchmarks.step_profile --preset deepseek-v2-lite --batch 1 --num-kv-blocks 2048 \
      --rounds 1 "${variants[@]}" --out "$OUT/step_ab_phase_cuts_b1.json" 2>&1 | grep -E "^\||^round|Error" ;;
  phase2-parts)  # round 42: phase 2's parts cut (decode_step_attention.PROBE_PHASE_CUT "wuk", "rope"; values wrong,
                 # routing fixed as in chunk-cuts); one round (~5 minutes; round 42's call also timed the rope and
                 # latent CTAs' input-free work ahead of phase 1's barrier: no faster, removed, decode_profile.md)
    m=pallas_kernels.decode_step_moe.PROBE_FIXED_ROUTING=True a=pallas_kernels.decode_step_attention
    timeout 580 python -m benchmarks.step_profile --preset deepseek-v2-lite --batch 1 --num-kv-blocks 2048 \
      --rounds 1 --variant "fixed: $m" --variant "fixed, no W_UK units: $m $a.PROBE_PHASE_CUT=('wuk',)" \
      --variant "fixed, no rope / latent: $m $a.PROBE_PHASE_CUT=('rope',)" --out "$OUT/step_ab_phase2_parts_b1.json" \
      2>&1 | grep -E "^\||^round|Error" ;;
  step-knobs-tests)  # the built-off step knobs' GPU tests (~5 minutes): session 49's dense layer's attention half as
                    # one attention_chain launch over its cache layer (dispatch.STEP_KERNEL_DENSE_ATTENTION) and the
                    # final norm in the step kernel's tail (dispatch.STEP_KERNEL_FINAL_NORM); session 51's rope cos /
                    # sin in the attention kernels (decode_step_attention.ROPE_IN_KERNEL), the dense MLP's expert
                    # launch adding into the residual in place (dispatch.DENSE_MLP_IN_PLACE) and the embedding row
                    # read by the dense attention kernel (dispatch.STEP_KERNEL_EMBEDDING), the three kernels as
                    # dependent launches (dispatch.STEP_KERNEL_PDL): the chain at cache_layer 1 (x_L in f32 too, the
                    # token's row from the table too), the chain with the rope in it, the expert launch in place (and
                    # PDL), the whole layers' kernel with the final norm, the model's one-token steps
    timeout 560 python -m pytest tests/gpu -q -p no:cacheprovider -rf \
      -k "cache_layer or test_moe_layer_chain_gpu or through_the_step_kernel or (attention_chain_gpu and True) or test_moe_decode_mgpu_gpu" 2>&1 \
      | tee "$OUT/gpu_tests_step_knobs.log" | tail -3 ;;
  step-knobs-ab)  # after step-knobs-tests: the batch-1 compiled step as built, with each of session 49's knobs and
                 # with both, 2 rounds in turns (~5 minutes)
    d=dsjax.model.dispatch
    timeout 560 python -m benchmarks.step_profile --preset deepseek-v2-lite --batch 1 --num-kv-blocks 2048 \
      --rounds 2 --variant built --variant "dense attention: $d.STEP_KERNEL_DENSE_ATTENTION=True" \
      --variant "final norm: $d.STEP_KERNEL_FINAL_NORM=True" \
      --variant "both: $d.STEP_KERNEL_DENSE_ATTENTION=True $d.STEP_KERNEL_FINAL_NORM=True" \
      --out "$OUT/step_ab_step_knobs_b1_h200.json" 2>&1 | grep -E "^\||^round|Error" ;;
  round35-ab)  # after step-knobs-tests (and sampler-ab's tests): the batch-1 compiled step as built, with every built-off
              # kernel knob (session 49's dense attention kernel and final norm; session 51's rope in the kernels, the
              # dense MLP in place, the embedding row read by the kernel), then also the three kernels as dependent
              # launches (PDL); 2 rounds in turns (each variant compiles the bucket's two programs, ~55 s, every
              # round: ~7 minutes with the engine's start; each variant's line prints as it comes)
    d=dsjax.model.dispatch; kernels="$d.STEP_KERNEL_DENSE_ATTENTION=True $d.STEP_KERNEL_FINAL_NORM=True"
    kernels="$kernels pallas_kernels.decode_step_attention.ROPE_IN_KERNEL=True $d.DENSE_MLP_IN_PLACE=True"
    kernels="$kernels $d.STEP_KERNEL_EMBEDDING=True"
    timeout 560 python -m benchmarks.step_profile --preset deepseek-v2-lite --batch 1 --num-kv-blocks 2048 \
      --rounds 2 --variant built --variant "kernel knobs: $kernels" --variant "+ PDL: $kernels $d.STEP_KERNEL_PDL=True" \
      --out "$OUT/step_ab_round35_b1_h200.json" 2>&1 | grep -E "^\||^round|Error" ;;
  round35-graphs)  # after round35-ab: with every kernel knob and the one-pass sampler, the step kernel's bucket as a
                   # CUDA graph (runner.STEP_KERNEL_GRAPHS) against dependent launches (PDL, which measured nothing
                   # inside XLA's graphs), 2 rounds in turns (~6 minutes)
    d=dsjax.model.dispatch; kernels="$d.STEP_KERNEL_DENSE_ATTENTION=True $d.STEP_KERNEL_FINAL_NORM=True"
    kernels="$kernels pallas_kernels.decode_step_attention.ROPE_IN_KERNEL=True $d.DENSE_MLP_IN_PLACE=True"
    kernels="$kernels $d.STEP_KERNEL_EMBEDDING=True dsjax.engine.sampler.ONE_PASS=True"
    timeout 560 python -m benchmarks.step_profile --preset deepseek-v2-lite --batch 1 --num-kv-blocks 2048 \
      --rounds 2 --variant "knobs: $kernels" --variant "+ PDL: $kernels $d.STEP_KERNEL_PDL=True" \
      --variant "+ graphs: $kernels dsjax.engine.runner.STEP_KERNEL_GRAPHS=True" \
      --out "$OUT/step_ab_round35_graphs_b1_h200.json" 2>&1 | grep -E "^\||^round|Error" ;;
  knobs-curve)  # after sampler-ab: the engine at batch 1 and 2 (96 timed tokens, one process each) as built, with the
               # one-pass sampler, with the step kernel's bucket as a CUDA graph, and with both (~6 minutes; the knobs
               # in $2 as NAME=MODULE.ATTR=VALUE,... lists, default those three)
    for run in ${2:-built one_pass=dsjax.engine.sampler.ONE_PASS=True graphs=dsjax.engine.runner.STEP_KERNEL_GRAPHS=True both=dsjax.engine.sampler.ONE_PASS=True,dsjax.engine.runner.STEP_KERNEL_GRAPHS=True}; do
      name=${run%%=*}; sets=${run#"$name"}; sets=${sets#=}
      echo "== $name ($sets)"
      timeout 170 python -c "import sys, importlib
for s in filter(None, '$sets'.split(',')):
    path, value = s.split('='); module, attr = path.rsplit('.', 1)
    setattr(importlib.import_module(module), attr, eval(value))
from dsjax.bench.__main__ import main; main(sys.argv[1:])" decode-curve --batches 1 2 --prompts 128 --steps 96 \
        --out-dir "$OUT" --tag "h200_b1b2_$name" | grep "decode-curve b"
    done ;;
  round36)  # the five kernel knobs on as built (session 52): the engine at batch 1 and 2 (96 timed tokens, one process
            # each) as built, with the one-pass sampler, and with it and the step kernel's bucket as a CUDA graph; then
            # the GPU tests of the as-built step (the whole layers' kernel at both positions, the model's one-token
            # steps through the kernels, the greedy program, the samplers) (~9 minutes)
    bash "$0" knobs-curve "built one_pass=dsjax.engine.sampler.ONE_PASS=True both=dsjax.engine.sampler.ONE_PASS=True,dsjax.engine.runner.STEP_KERNEL_GRAPHS=True"
    rm -f "$OUT"/*.png "$OUT"/e2e_summary_*.md  # the device tool brings back 8 files a call: the JSONs and the log
    timeout 200 python -m pytest tests/gpu tests/engine/test_llm.py -q -p no:cacheprovider -rf \
      -k "test_moe_layer_chain_gpu or through_the_step_kernel or greedy_steps_in_one_program or sampler" 2>&1 \
      | tee "$OUT/gpu_tests_round36.log" | tail -3 ;;
  xla-flags)  # round 34: outside the step kernel a batch-1 step is ~24 small launches (norms as a reduce and a scale,
             # split-K sums, residual adds; ~60 µs at their boundaries): does one of XLA's experimental fusion passes
             # make fewer of them? The compiled step in one process a setting (the compiled step alone moves ~3 µs
             # between processes, round 33), settings in $2 (default all five; ~2 minutes each): built,
             # block_level (xla_gpu_experimental_enable_fusion_block_level_rewriter), heroless
             # (..._enable_triton_heroless_priority_fusion), all_triton (..._all_fusions_with_triton), same_shape
             # (..._enable_same_shape_multi_output_fusion)
    for setting in ${2:-built block_level heroless all_triton same_shape}; do
      case $setting in
        built) flags= ;;
        block_level) flags=--xla_gpu_experimental_enable_fusion_block_level_rewriter=true ;;
        heroless) flags=--xla_gpu_experimental_enable_triton_heroless_priority_fusion=true ;;
        all_triton) flags=--xla_gpu_experimental_all_fusions_with_triton=true ;;
        same_shape) flags=--xla_gpu_experimental_enable_same_shape_multi_output_fusion=true ;;
        *) echo "xla-flags: setting $setting; accepted: built block_level heroless all_triton same_shape" >&2; exit 2 ;;
      esac
      echo "== $setting ($flags)"
      XLA_FLAGS=$flags timeout 200 python -m benchmarks.step_profile --preset deepseek-v2-lite --batch 1 \
        --num-kv-blocks 2048 --rounds 2 --variant "$setting" --out "$OUT/step_xla_flags_${setting}_b1_h200.json" \
        2>&1 | grep -E "^round|Error"
    done ;;
  step-kernel-trace)  # the batch-1 step kernel's per-scope trace in the engine (dispatch.STEP_KERNEL_TRACE): its
                     # first ~7 layers' scopes phase by phase (the trace stops when its buffer is full; ~3 minutes)
    timeout 250 python -m benchmarks.step_profile --preset deepseek-v2-lite --batch 1 --num-kv-blocks 2048 \
      --kernel-trace "$OUT/kernel_trace" 2>&1 | grep -v "^WARNING" | tail -120 | tee "$OUT/step_kernel_trace_b1.txt" ;;
  step-profile)  # the batch-1 step's device ops with the step kernel on, each with its line of the step's optimized
                 # HLO (what it computes; the whole HLO in $OUT/trace/step_hlo.txt), ~2 minutes
    timeout 200 python -m benchmarks.step_profile --preset deepseek-v2-lite --batch 1 --num-kv-blocks 2048 \
      --trace-dir "$OUT/trace" --top 40 2>&1 | grep -v "^WARNING" | tail -90 | tee "$OUT/step_profile_b1.txt" ;;
  step-router)  # round 28: the batch-1 compiled step with the router's bf16 parts prepared once (round 26: 1.972 ms
                # with the split in every step), the launches beside it; the in-model step-kernel GPU test (~5 minutes)
    timeout 100 python -m pytest tests/gpu -q -p no:cacheprovider -rf -k "through_the_step_kernel" 2>&1 \
      | tee "$OUT/gpu_tests_step_router.log" | tail -2
    timeout 300 python -m benchmarks.step_profile --preset deepseek-v2-lite --batch 1 --num-kv-blocks 2048 \
      --rounds 3 --variant built --variant "launches: dsjax.model.dispatch.STEP_KERNEL=False" \
      --out "$OUT/step_ab_router_parts_b1_h200.json" 2>&1 | grep -E "^\||Error" ;;
  step-traces)  # per-scope traces, 2 layers each, of the whole layer, the layer tail and the attention chain
                # (phase 3's chunk split into its wait, scores, values and stores): where the whole layer's ~11 µs
                # over its halves go, and what makes a 64-token chunk ~16 µs traced (~5 minutes)
    timeout 280 python -m benchmarks.megakernel_probe --layer-chain 2 --trace "$OUT/trace" \
      --out "$OUT/layer_chain_traces_h200.json" 2>&1 | grep -v "^ptxas warning" | tail -70
    timeout 200 python -m benchmarks.megakernel_probe --attention-chain 2 --trace "$OUT/trace" \
      --out "$OUT/attention_chain_traces_h200.json" 2>&1 | tail -30 ;;
  pdl)        # programmatic dependent launch between Mosaic GPU kernels (benchmarks/pdl_probe.py, ~2 minutes)
    timeout 150 python benchmarks/pdl_probe.py --out "$OUT/pdl_probe_default.json" 2>&1 | grep -v Warn | tail -12
    XLA_FLAGS=--xla_gpu_enable_pdl=true timeout 150 python benchmarks/pdl_probe.py \
      --out "$OUT/pdl_probe_enable_pdl.json" 2>&1 | grep -v Warn | tail -12 ;;
  persistent) # a chain of weight-streaming phases: one launch each vs one persistent kernel with grid barriers (~3 minutes)
    timeout 300 python benchmarks/persistent_probe.py --out "$OUT/persistent_probe.json" 2>&1 | grep -v Warn | tail -16 ;;
  attention-decode)   # MLA decode sweep, every row profiled (about 4 minutes; results/attention_h200_decode.json)
    timeout 560 python benchmarks/kernels_attention.py --only decode --out "$OUT/attention_h200_decode.json" | tail -20 ;;
  attention-prefill)  # MLA prefill sweep (results/attention_h200_prefill.json); attention_h200.json joins the halves
    timeout 560 python benchmarks/kernels_attention.py --only prefill --out "$OUT/attention_h200_prefill.json" | tail -12 ;;
  moe)        # routing, grouped SwiGLU, down projection, whole layer, dense SwiGLU (results/moe_h200.json)
    timeout 560 python benchmarks/kernels_moe.py --out "$OUT/moe_h200" | tail -40 ;;
  moe-focus)  # MoE targets only: grouped kernels, whole layer at V2-Lite T=256 and T=8192 (about a minute)
    timeout 300 python benchmarks/kernels_moe.py --focus --out "$OUT/moe_h200_focus" | tail -30 ;;
  moe-waves)  # one-token moe_decode over program counts at equal bytes: HBM- or spread-bound? (a minute)
    timeout 150 python benchmarks/kernels_gemv.py --only moe_waves --out "$OUT/gemv_moe_waves_h200" | tail -12 ;;
  gemv)       # decode-step kernels: stacked GEMV tiles, shared MLP, per-head w_uk/w_uv, one-launch MoE (results/gemv_h200.json)
    timeout 480 python benchmarks/kernels_gemv.py --out "$OUT/gemv_h200" | tail -60 ;;
  decode)     # engine decode throughput and a device-op profile on the V2-Lite preset
    timeout 200 python -m benchmarks.decode_probe --preset deepseek-v2-lite --batches 1 32 64 --prompt 128 \
      --steps 24 --out decode_probe_v2lite | grep -E "^\||setup"
    cp benchmarks/results/decode_probe_v2lite.json "$OUT/" 2>/dev/null
    for b in 1 64; do
      timeout 150 python -m benchmarks.step_profile --preset deepseek-v2-lite --batch $b --num-kv-blocks 2048 \
        --trace-dir /tmp/trace_b$b | grep -vi warn | head -28 | tee "$OUT/profile_b$b.txt"
    done ;;
  train)      # the embedded default model (issue 9): train, export, and ship the export back in 15 MB parts
    set -o pipefail
    timeout 570 python -m dsjax.train --config configs/train/default-model.yaml --out /tmp/export/default \
      --no-progress 2>&1 | tee "$OUT/train.log" | grep -vE "^\{" | tail -30
    tar -C /tmp/export -cf - default | split -b 15M -d - "$OUT/default.tar." ;;
  e2e)        # decode curve + roofline, mixed/templated workloads, HF generate baseline (python -m dsjax.bench)
    timeout 580 python -m dsjax.bench all --out-dir "$OUT" | tail -30 ;;
  kvquant)    # 8-bit KV caches: capacity, accuracy, V2-Lite logit error, kernel bandwidth, memory wall
    timeout 580 python -m benchmarks.kvquant --gpu-parts --out "$OUT/kvquant" | grep -v WARNING | tail -45 ;;
  kvquant-kernels)  # only the decode kernel's bandwidth table: each cache format, byte pairs, two pools (a minute)
    timeout 200 python -m benchmarks.kvquant --kernels-only --out "$OUT/kvquant_kernels_h200" | grep -v WARNING | tail -16 ;;
  kvquant-sweep)  # the decode kernel over bf16 / int8 / fp8 caches: tiles x dot operand dtypes (about 2 minutes)
    timeout 300 python -m benchmarks.kvquant --decode-sweep --out "$OUT/kvquant_decode_sweep_h200" | grep -v WARNING | tail -30 ;;
  mla8)       # the 8-bit Mosaic GPU decode kernel: per-variant errors, variant timings, its own trace (~3 minutes)
    timeout 420 python -m benchmarks.mla_8bit_probe 2>&1 | grep -v Warning | grep -v "^  " | tee "$OUT/mla8_probe.txt" | tail -80 ;;
  mla8-fence) # the 8-bit kernel's proxy fence before each ring reload (mla_decode_8bit_mgpu.RELEASE_FENCE, on since
              # session 53, found by the interpret mode's race detection): its GPU test, then unfenced / fenced in turns
    timeout 200 python -m pytest -q -x tests/gpu/test_kernels_gpu.py -k "test_mla_decode_8bit_mosaic_gpu" 2>&1 | tail -3
    timeout 200 python -m benchmarks.mla_8bit_probe --release-fence 2>&1 | grep -v Warning | tee "$OUT/mla8_fence.txt" | tail -20 ;;
  wgmma)      # one wgmma's cost by N (few-head decode's heads): 1-2 warpgroups an SM, A in smem / registers (a minute)
    timeout 200 python -m benchmarks.wgmma_probe --out "$OUT/wgmma_probe_h200.json" 2>&1 | grep -v Warning | tail -24 ;;
  mla8-many)  # the many-head Mosaic decode kernel over bf16 / int8 / fp8 caches, traces of bf16 and int8 (a minute)
    timeout 200 python -m benchmarks.mla_8bit_probe --many-heads 2>&1 | grep -v Warning | tee "$OUT/mla8_many.txt" | tail -60 ;;
  l2-staging) # batch 1's expert launch after its shared (or two routed) experts were read into L2 (a minute)
    timeout 200 python -m benchmarks.l2_staging_probe --out "$OUT/l2_staging_h200.json" 2>&1 | grep -v Warning | tail -12 ;;
  tma-stream) # weights streamed into shared memory by TMA alone, CTAs x box x ring depth, beside XLA's reduction (a minute)
    timeout 200 python -m benchmarks.tma_stream_probe --out "$OUT/tma_stream_h200.json" 2>&1 | grep -v Warn | tail -13 ;;
  l2-experts) # the expert launch in an 8-layer scan: shared programs first or last, its shared experts staged in
              # L2 just before or not (benchmarks/l2_staging_probe.py --target experts-chain; a minute)
    timeout 200 python -m benchmarks.l2_staging_probe --target experts-chain --out "$OUT/l2_experts_chain_h200.json" \
      2>&1 | grep -v Warning | tail -8 ;;
  l2-chain)   # the attention chain's norm + q + kv_a and o_proj launches in a 27-layer scan: one layer's weights,
              # each layer's, L2 flushed, pages touched, weights staged then N MB (benchmarks/l2_staging_probe.py)
    timeout 200 python -m benchmarks.l2_staging_probe --target chain --out "$OUT/l2_chain_h200.json" \
      2>&1 | grep -v Warning | tail -14 ;;
  parallel)   # 2 GPUs (kind nvidia-h200-x2): one GPU, TP=2, EP=2 at batch 256 / 1024, op profiles at 1024 (~3 min)
    timeout 560 python -m benchmarks.parallel_h200x2 --runs 1gpu tp2 ep2 --batches 256 1024 --profile-batch 1024 \
      --timeout 150 | tail -30
    cp benchmarks/results/parallel_h200x2.json "$OUT/" 2>/dev/null || true ;;
  multi-step-tests)  # multi-step chunks (num_scheduler_steps): the engine's GPU test, chunks of 4 through the step
                    # kernel against single steps (~2 minutes)
    timeout 300 python -m pytest tests/gpu -q -p no:cacheprovider -rf -k "multi_step_chunks" 2>&1 \
      | tee "$OUT/gpu_tests_multi_step.log" | tail -3 ;;
  multi-step-curve)  # the engine at batch 1 and 2 in chunks of 1 (as built), 4 and 8 decode steps a launch, one
                    # process each, and chunks of 4 as CUDA graphs: does the batch-1 step reach the compiled step
                    # once the host launches a quarter as often (~8 minutes)
    for k in ${2:-1 4 8 4g}; do  # 4g: chunks of 4 as CUDA graphs (runner.CHUNK_GRAPHS)
      # 96 timed tokens a sequence at every k: the same contexts (~190 on average)
      timeout 170 python -c "import sys, dsjax.engine.runner as r; r.CHUNK_GRAPHS = '$k'.endswith('g')
from dsjax.bench.__main__ import main; main(sys.argv[1:])" decode-curve --batches 1 2 --prompts 128 \
        --num-scheduler-steps ${k%g} --steps $((96 / ${k%g})) --out-dir "$OUT" --tag h200_b1b2_chunk$k \
        | grep "decode-curve b"
    done ;;
  host-swing)  # round 33's finding: the batch-1 engine step swings ±0.05 ms from one process to the next while the
              # compiled step holds. Three processes of host_overhead --device (async, 300 steps): each step's wall
              # time (p10 / median / p90), its launch and fetch calls (wall and the thread's CPU), the rest; which
              # of them moves between a fast process and a slow one (~5 minutes)
    for i in 1 2 3; do
      timeout 170 python -m benchmarks.host_overhead --device --async-scheduling --preset deepseek-v2-lite \
        --dtype bfloat16 --block-size 64 --batches 1 --prompt 128 --steps 300 --profile 0 \
        --out "$OUT/host_swing_b1_run${i}_h200" 2>&1 | grep -E "^\||Error"
    done ;;
  engine-trace)  # round 51's open question: why the engine's batch-1 steps alternate on the H200. Three processes
                 # of benchmarks/engine_trace.py (as built, runner.COPY_AT_DISPATCH on, as built again): the
                 # engine's steps by elapsed time, then traced (the device's cycles matched to the host's
                 # dispatches), then the compiled step back to back, traced; then step_profile's own engine (block
                 # tables 358 tokens wide, the benchmark's 4160) traced at the same context (~7 minutes;
                 # `engine-trace short`: the first two processes alone, ~4 minutes; `engine-trace one`: one)
    if [ "${2:-all}" = one ]; then  # one process: the copy's A/B in turns inside it, then the traces (~3 minutes)
      timeout 250 python -m benchmarks.engine_trace --batch 1 --prompt 128 --steps 48 --copy-ab 2 \
        --out /tmp/engine_trace_1 2>&1 | grep -v -i warn | tee "$OUT/engine_trace_b1_one.txt" | tail -40
      cp /tmp/engine_trace_1/engine_trace.json "$OUT/engine_trace_b1_one_h200.json"
      cp "$(ls -t /tmp/engine_trace_1/engine/plugins/profile/*/*perfetto_trace.json.gz | head -1)" \
        "$OUT/engine_trace_b1_one_perfetto.json.gz"
      exit
    fi
    runs=("1:" "2:dsjax.engine.runner.COPY_AT_DISPATCH=True")
    [ "${2:-all}" = short ] || runs+=("3:")
    for run in "${runs[@]}"; do
      i=${run%%:*} knobs=${run#*:}
      timeout 150 python -m benchmarks.engine_trace --batch 1 --prompt 128 --steps 48 --out /tmp/engine_trace_$i \
        ${knobs:+--set "$knobs"} 2>&1 | grep -v -i warn | tee "$OUT/engine_trace_b1_run$i.txt" | tail -30
      cp /tmp/engine_trace_$i/engine_trace.json "$OUT/engine_trace_b1_run${i}_h200.json"
    done
    cp "$(ls -t /tmp/engine_trace_1/engine/plugins/profile/*/*perfetto_trace.json.gz | head -1)" \
      "$OUT/engine_trace_b1_run1_perfetto.json.gz"
    if [ "${2:-all}" != short ]; then
      timeout 110 python -m benchmarks.step_profile --preset deepseek-v2-lite --batch 1 --prompt 128 --num-kv-blocks \
        2048 --top 6 2>&1 | grep -v -i warn | tee "$OUT/step_profile_b1_p128.txt" | head -12
    fi ;;
  host)       # the engine's Python work per decode step on this machine's CPU, the device stood in for (a minute)
    timeout 300 python -m benchmarks.host_overhead --out "$OUT/host_overhead_h200" | grep -v WARNING | tail -16 ;;
  *) echo "usage: $0 PART, PART one of: $(sed -n 4p "$0" | tr -d '#.) ')" >&2
     exit 2 ;;
esac

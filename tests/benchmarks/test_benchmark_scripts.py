"""The GPU benchmark scripts stay runnable: their --quick mode runs tiny shapes in interpret mode."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from benchmarks import kernels_attention, kernels_gemv, kernels_moe, pdl_probe, persistent_probe, wgmma_probe


def test_attention_benchmark_quick(capsys):
    kernels_attention.main(["--quick"])
    assert "mla_decode" in capsys.readouterr().out


def test_attention_benchmark_halves_join(tmp_path):
    decode, prefill, joined = tmp_path / "d.json", tmp_path / "p.json", tmp_path / "joined.json"
    kernels_attention.main(["--quick", "--only", "decode", "--out", str(decode)])
    kernels_attention.main(["--quick", "--only", "prefill", "--out", str(prefill)])
    payload = kernels_attention.main(["--join", str(decode), str(prefill), "--out", str(joined)])
    assert payload["decode"] and payload["prefill"] and set(payload["sources"]) == {"decode", "prefill"}
    assert payload["best_decode"] and payload["best_prefill"]
    assert json.loads(joined.read_text())["decode"] == payload["decode"]


def test_gemv_benchmark_quick():
    payload = kernels_gemv.main(["--quick"])
    assert {r["shape"] for r in payload["sweep"]} == {"quick"}
    assert [r["impl"] for r in payload["shared_mlp"]] == ["grouped kernels", "stacked GEMVs"]
    assert [r["rows"] for r in payload["rows_vs_xla"]] == [1, 20]
    assert [(r["weight"], r["rows"]) for r in payload["head_products"]] == [("w_uk", 1), ("w_uk", 20), ("w_uv", 1),
                                                                              ("w_uv", 20)]
    fused = payload["fused_launches"]
    assert {r["launch"] for r in fused} == {"quick"} and any(r["default"] for r in fused)
    assert [(r["tokens"], r["impl"].split()[0]) for r in payload["moe_one_launch"]] == [
        (t, impl) for t in (1, 2) for impl in ("grouped", "moe_decode")]
    # top-k 2 / 4 / 6 alone and with the shared experts: 3 tiles an expert of 48 columns, 6 shared tiles
    assert [(r["top_k"], r["shared"], r["programs"]) for r in payload["moe_waves"]] == [
        (k, shared, 3 * k + 6 * shared) for k in (2, 4, 6) for shared in (False, True)]
    only = kernels_gemv.main(["--quick", "--only", "moe_one_launch"])
    assert "moe_one_launch" in only and "sweep" not in only and only["table"].startswith("| tokens | impl | us |")


def test_pdl_probe_lowers_each_variant_for_hopper():
    """The PDL probe's kernels lower for an abstract H200 on CPU; only the grid-dependency variants ask
    for a programmatic launch (the Mosaic GPU module's uses_pdl attribute)."""
    result = pdl_probe.main(["--quick", "--tiles", "8"])
    assert {v: r["uses_pdl"] for v, r in result.items()} == {"serial": False, "pdl": True, "pdl_trigger": True}
    assert all(r["mosaic_calls"] > 0 for r in result.values())


def test_persistent_probe_lowers_each_variant_for_hopper():
    """The persistent-chain probe's kernels (one launch a phase; one kernel whose CTAs meet at a global
    semaphore between phases, with and without prefetched weight slabs) lower for an abstract H200 on CPU."""
    result = persistent_probe.main(["--quick", "--ctas", "8", "--stages", "2"])
    assert set(result) == {"launches/1/tma", *(f"{v}/{rows}" for v in ("barrier/1", "persistent/1", "prefetch/2")
                                              for rows in ("tma", "ld"))}
    assert all(r["mosaic_calls"] > 0 for r in result.values())


def test_megakernel_probe_lowers_each_variant_and_checks_its_arguments():
    """The one-kernel-a-step probe (a layer's weight stream with grid barriers between its phases, the
    stream alone, the barriers alone) lowers for an abstract H200 on CPU, one config of each variant (each
    lowering unrolls 79 boxes a layer: all 17 take minutes); its schedule is V2-Lite's."""
    from benchmarks import megakernel_probe as probe

    names = ["barriers/8/halves_lag2/producer", "stream/12/lag", "chain/12/none"]
    result = probe.main(["--quick", "--only", *names])
    assert set(result) == set(names) and all(result.values())
    with pytest.raises(ValueError, match="--only"):
        probe.main(["--quick", "--only", "barriers/99/none"])
    assert probe._starts()[-1] == 79 and sum(probe.BARRIER_AFTER) == 7
    x, w = probe._inputs(2, 4, abstract=True)
    with pytest.raises(ValueError, match="ring=32: accepted 1 to 31"):
        jax.eval_shape(lambda x, w: probe.layer_chain(x, w, variant="barriers", ring=32), x, w)
    with pytest.raises(ValueError, match="variant='fast'; accepted: barriers, stream, chain"):
        jax.eval_shape(lambda x, w: probe.layer_chain(x, w, variant="fast", ring=4), x, w)
    with pytest.raises(ValueError, match="products='async'; accepted: none, serial, lag, halves, halves_lag, halves_lag2"):
        jax.eval_shape(lambda x, w: probe.layer_chain(x, w, variant="stream", ring=4, products="async"), x, w)
    with pytest.raises(ValueError, match="streams nothing"):
        jax.eval_shape(lambda x, w: probe.layer_chain(x, w, variant="chain", ring=4, producer=True), x, w)
    # each barrier reads the right neighbour's row + 1
    x0 = jnp.arange(3 * 8 * 128, dtype=jnp.float32).reshape(3, 8, 128)
    assert bool(jnp.all(probe.expected_rows(x0, 1) == jnp.roll(x0, -7, axis=0) + 7))


def test_wgmma_probe_lowers_each_variant_for_hopper():
    """The wgmma probe's kernels (A in shared memory for N = 16 ... 256 within shared memory, A in
    registers at N = 16; one and two warpgroups) lower for an abstract H200 on CPU."""
    result = wgmma_probe.main(["--quick"])
    assert (16, 512, "registers", 2) in result and (256, 128, "smem", 1) in result
    assert (256, 512, "smem", 1) not in result  # B [256, 512] alone is 256 KiB of shared memory
    assert all(count > 0 for count in result.values())


def test_persistent_probe_refuses_bad_slabs():
    with pytest.raises(ValueError, match="slab_kb=24: accepted multiples of 16"):
        persistent_probe.main(["--quick", "--slab-kb", "24"])


def test_moe_benchmark_quick(capsys):
    kernels_moe.main(["--quick"])
    assert "grouped_swiglu" in capsys.readouterr().out


def test_moe_benchmark_focus_quick(capsys):
    payload = kernels_moe.main(["--quick", "--focus"])
    out = capsys.readouterr().out
    assert "grouped_matmul_scatter" in out and "xla_dense_reference" in out
    assert {row["section"] for row in payload["rows"]} == {"grouped", "layer"}
    assert all("us" in row for row in payload["rows"]), payload["rows"]


def test_parallel_benchmark_runs_one_device_with_a_profile(tmp_path):
    """The two-GPU benchmark's plumbing on CPU: its one-device run in a child process, the decode
    measurement and the op profile (no GPU ops on CPU: the list is empty, the timings are not)."""
    from benchmarks import parallel_h200x2

    out = tmp_path / "parallel"
    parallel_h200x2.main(["--preset", "tiny", "--runs", "1gpu", "--batches", "2", "--steps", "3", "--prompt", "8",
                          "--prefill-chunk", "16", "--kv-cache-gib", "0.01", "--profile-batch", "2",
                          "--out", str(out)])
    (run,) = json.loads(out.with_suffix(".json").read_text())["runs"]
    assert "error" not in run, run.get("error")
    assert run["rows"][0]["batch"] == 2 and run["rows"][0]["tok_per_s"] > 0
    assert run["profile"]["batch"] == 2 and run["profile"]["device_ms"] > 0


def test_host_overhead_benchmark_times_the_engine_without_its_device(tmp_path):
    from benchmarks import host_overhead

    payload = host_overhead.main(["--batches", "8", "--steps", "3", "--profile", "2", "--out", str(tmp_path / "host")])
    (row,) = payload["rows"]
    assert row["batch"] == 8 and row["cpu_ms"] > 0 and row["us_per_sequence"] > 0
    assert row["python_calls_per_step"] > 8 and any("_complete" in e["function"] for e in row["top"])
    assert json.loads((tmp_path / "host.json").read_text())["rows"][0]["batch"] == 8


def test_host_overhead_with_the_device_times_its_launch_and_fetch(tmp_path):
    """--device keeps the (CPU) device: every step's launch and fetch are timed; async scheduling queues a step
    before reading the last one's samples."""
    from benchmarks import host_overhead

    payload = host_overhead.main(["--batches", "1", "--steps", "4", "--profile", "0", "--device", "--async-scheduling",
                                  "--out", str(tmp_path / "host")])
    (row,) = payload["rows"]
    assert payload["device"] and payload["async_scheduling"]
    assert 0 < row["launch_ms"] <= row["launch_max_ms"] and row["fetch_ms"] > 0 and row["launch_alone_ms"] > 0
    assert row["wall_min_ms"] <= row["wall_ms"] <= row["wall_max_ms"] and "| launch_ms |" in payload["table"]
    assert row["wall_p10_ms"] <= row["wall_p90_ms"] and 0 < row["launch_cpu_ms"] and 0 <= row["fetch_cpu_ms"]
    assert row["other_ms"] < row["wall_ms"] and payload["host"]["cpus_usable"] >= 1


def test_transfer_wait_probe_times_each_case_and_the_engines_step(tmp_path):
    """The probe's synthetic cases, each behind a busy program and idle, the two-launch anatomy, and with
    --engine the engine's step from host inputs, placed once and its forward alone; the forward's HLO written."""
    import json

    from benchmarks import transfer_wait

    out, hlo = tmp_path / "wait.json", tmp_path / "forward.txt"
    payload = transfer_wait.main(["--reps", "2", "--size", "64", "--chain", "2", "--engine", "--preset", "tiny",
                                  "--rounds", "1", "--repeats", "10", "--out", str(out), "--hlo", str(hlo)])
    rows = {row["case"]: row for row in payload["rows"]}
    for case in ("tiny(device array)", "tiny(numpy array)", "device_put(numpy)",
                 "busy donating the output of a pending busy"):
        assert rows[case]["behind_busy_us"] > 0
    assert rows["tiny(numpy array)"]["idle_us"] > 0
    for case in ("anatomy: busy program", "anatomy: engine forward, inputs placed once"):
        assert 0 < rows[case]["first_returns_us"] < rows[case]["second_returns_us"] < rows[case]["second_ready_us"]
    engine = [row for row in payload["rows"] if "round" in row]
    assert {row["case"] for row in engine} == {"inputs from host (runner.launch)", "inputs placed once",
                                              "the forward alone, inputs placed once"}
    assert all(row["step_ms"] > 0 and row["launch_call_ms"] > 0 for row in engine)
    assert json.loads(out.read_text())["probe"] == "transfer_wait" and "ENTRY" in hlo.read_text()


def test_step_profile_engine_decodes_after_a_prompt_of_the_asked_length():
    """--prompt: each sequence's prompt has that many tokens, prefilled in one step, and every sequence decodes
    when the step is taken (4 tokens as before by default)."""
    import argparse

    from benchmarks.step_profile import _decoding_engine

    for prompt in (4, 40):
        args = argparse.Namespace(preset="tiny", batch=2, kernel_backend="auto", num_kv_blocks=64, prompt=prompt)
        llm, host = _decoding_engine(args)
        running = llm.engine.scheduler.running
        assert len(running) == 2 and len(host) == 10
        assert all(seq.num_prompt_tokens == prompt and seq.is_decoding for seq in running)
        assert llm.engine.config.max_model_len >= prompt + 200


def test_step_profile_reads_the_latest_trace(tmp_path):
    """A reused trace folder keeps earlier runs' traces: the profile reads the one written last."""
    import os

    from benchmarks.step_profile import latest_trace

    assert latest_trace(str(tmp_path)) is None
    paths = []
    for run, age in (("2026_12_02_05_30_00", 10), ("2026_12_02_05_25_59", 100), ("2026_12_02_05_40_00", 50)):
        path = tmp_path / "plugins" / "profile" / run / "perfetto_trace.json.gz"
        path.parent.mkdir(parents=True)
        path.write_bytes(b"")
        os.utime(path, (1e9 - age, 1e9 - age))
        paths.append(str(path))
    assert latest_trace(str(tmp_path)) == paths[0]


def test_l2_staging_probe_quick():
    from benchmarks import l2_staging_probe

    payload = l2_staging_probe.main(["--quick"])
    assert [r["staged"] for r in payload["rows"]] == list(l2_staging_probe.STAGED)
    assert payload["rows"][0]["staged_mb"] == 0 and all(r["staged_mb"] > 0 for r in payload["rows"][1:])


def test_l2_staging_probe_chain_quick():
    from benchmarks import l2_staging_probe

    payload = l2_staging_probe.main(["--quick", "--target", "chain"])
    assert [r["variant"] for r in payload["rows"]] == list(l2_staging_probe.CHAIN)
    assert payload["layers"] == l2_staging_probe.CHAIN_QUICK_LAYERS


def test_l2_staging_probe_experts_chain_quick():
    """--target experts-chain: every variant (the shared experts staged in L2 or not) gives the same
    chained result (the probe compares them) and the table names each."""
    from benchmarks import l2_staging_probe

    payload = l2_staging_probe.main(["--quick", "--target", "experts-chain"])
    assert [r["variant"] for r in payload["rows"]] == list(l2_staging_probe.EXPERTS_CHAIN)


def test_touch_pages_reads_one_element_a_stride_of_the_layer():
    import jax.numpy as jnp
    import numpy as np
    from benchmarks import l2_staging_probe

    ws = [jnp.arange(3 * 4 * 64, dtype=jnp.float32).reshape(3, 4, 64), jnp.ones((3, 8, 8), jnp.bfloat16)]
    got = l2_staging_probe.touch_pages(ws, 2, stride_bytes=256, programs=3, interpret=True)
    flat = np.asarray(ws[0][2]).reshape(-1)
    want = flat[::64].sum() + 1.0  # 256 bytes: every 64th f32 of layer 2; the bf16 weight's 128 bytes, one
    np.testing.assert_allclose(np.asarray(got), np.full((3, 16), want))


def test_step_profile_ab_recompiles_each_variant_and_restores_the_knobs(tmp_path, monkeypatch):
    """--variant: each variant's settings hold while the step compiles and is timed, in turns over the
    rounds; the knobs are as built afterwards."""
    from benchmarks import step_profile
    from dsjax.model import dispatch

    built = dispatch.STACKED_GEMV_MAX_TOKENS
    built_tiles = dispatch.MOE_DECODE_TILES
    seen = []
    original_ab = step_profile.ab_compiled_steps

    def recording_ab(engine, variants, **kw):
        inner = engine.runner.compile_all
        monkeypatch.setattr(engine.runner, "compile_all",
                            lambda sizes=None, **kw: (seen.append((dispatch.STACKED_GEMV_MAX_TOKENS,
                                                                   dispatch.MOE_DECODE_TILES, sizes, kw)),
                                                      inner(sizes, **kw))[1])
        rows = original_ab(engine, variants, **kw)
        assert not engine.runner._compiled  # the step as built compiles again at the next launch
        return rows

    monkeypatch.setattr(step_profile, "ab_compiled_steps", recording_ab)
    out = tmp_path / "ab.json"
    payload = step_profile.main(["--preset", "tiny", "--batch", "2", "--num-kv-blocks", "64", "--rounds", "2",
                                 "--repeats", "2", "--variant", "built",
                                 "--variant", "off: dsjax.model.dispatch.STACKED_GEMV_MAX_TOKENS=0 "
                                 "dsjax.model.dispatch.MOE_DECODE_TILES.num_warps=8",
                                 "--out", str(out)])
    assert [(r["variant"], r["round"]) for r in payload["rows"]] == [("built", 0), ("off", 0), ("built", 1),
                                                                      ("off", 1)]
    # the timed bucket's greedy step only; the first "built" times the engine's own programs (nothing compiled)
    assert all(sizes is not None and len(sizes) == 1 and kw == {"greedy_only": True} for *_, sizes, kw in seen)
    assert [r["compile_s"] == 0 for r in payload["rows"]] == [True, False, False, False]
    changed = (0, built_tiles._replace(num_warps=8))
    assert [knobs for *knobs, _, _ in seen] == [[*changed], [built, built_tiles], [*changed]]
    assert (dispatch.STACKED_GEMV_MAX_TOKENS, dispatch.MOE_DECODE_TILES) == (built, built_tiles)
    assert all(r["device_ms"] > 0 for r in payload["rows"])
    assert "| off |" in payload["table"] and "| launch call ms |" in payload["table"]
    assert all(r["launch_call_ms"] > 0 for r in payload["rows"]) and json.loads(out.read_text())["rows"] == payload["rows"]
    with pytest.raises(SystemExit):
        step_profile.main(["--preset", "tiny", "--variant", "bad: dispatch.X=not a literal"])
    with pytest.raises(ValueError, match="dispatch.NO_SUCH'.*importable module"):
        original_ab(None, [("x", {"dsjax.model.dispatch.NO_SUCH": 1})], rounds=1, repeats=1)


def test_step_profile_ab_drops_the_other_variants_programs(monkeypatch):
    """A variant's programs do not outlive it: with runner.GREEDY_IN_FORWARD off in one variant (the step kernel's
    bucket forced to 1), the built variant after it times the step with the forward + sampler program again, and
    that variant without it."""
    from benchmarks import step_profile
    from dsjax.engine import runner as runner_module

    monkeypatch.setattr(runner_module.ModelRunner, "runs_step_kernel", lambda self, t: t == 1)
    seen, timed = [], step_profile.time_compiled_step

    def recording(engine, t, inputs, repeats):
        seen.append(sorted(engine.runner._greedy_forwards))
        return timed(engine, t, inputs, repeats)

    monkeypatch.setattr(step_profile, "time_compiled_step", recording)
    step_profile.main(["--preset", "tiny", "--batch", "1", "--num-kv-blocks", "64", "--rounds", "2", "--repeats", "2",
                       "--variant", "built", "--variant", "two programs: dsjax.engine.runner.GREEDY_IN_FORWARD=False"])
    assert seen == [[1], [], [1], []] and runner_module.GREEDY_IN_FORWARD is True


def test_step_profile_kernel_trace_says_why_the_kernel_did_not_run(tmp_path):
    """--kernel-trace: the engine's steps under dispatch.STEP_KERNEL_TRACE (put back after); on the CPU no step
    kernel runs, and the error says why (the model's own reason)."""
    from benchmarks import step_profile
    from dsjax.model import dispatch

    with pytest.raises(SystemExit, match=r"no trace in .*: the step kernel did not run \(kernel_backend='reference'"):
        step_profile.main(["--preset", "tiny", "--num-kv-blocks", "64", "--kernel-trace", str(tmp_path / "trace")])
    assert dispatch.STEP_KERNEL_TRACE is None


def test_tma_stream_probe_lowers_every_config_for_hopper():
    from benchmarks import tma_stream_probe

    result = tma_stream_probe.main(["--quick"])
    assert set(result) == {f"{c}/{b}/{s}" for c, b, s in tma_stream_probe.CONFIGS} and all(result.values())
    few = tma_stream_probe.main(["--quick", "--few"])  # a few CTAs alone
    assert set(few) == set(tma_stream_probe.FEW_CONFIGS) and all(few.values())
    experts = tma_stream_probe.main(["--quick", "--experts"])  # the expert launch's stream, strided or not
    assert set(experts) == {"strided/4", "strided/6", "contiguous/4", "contiguous/6"} and all(experts.values())
    with pytest.raises(ValueError, match="box_kb"):
        tma_stream_probe._box(24)


def test_ptx_census_counts_instruction_families():
    from benchmarks import ptx_census

    ptx = """
    @%p1 cp.async.cg.shared.global [ %r1 + 0 ], [ %rd1 + 0 ], 0x10, %r2;
    cp.async.cg.shared.global [ %r3 + 0 ], [ %rd2 + 0 ], 8, %r2;
    cp.async.commit_group;
    cp.async.wait_group 2;
    ld.global.v4.b32 { %r4, %r5, %r6, %r7 }, [ %rd3 + 0 ];
    @!%p2 ld.global.b16 { %rs1 }, [ %rd4 + 0 ];
    mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {...};
    bar.sync 0;
    """
    counts = ptx_census.census(ptx)
    assert counts["cp.async 16 B (cache global)"] == 1 and counts["cp.async (cache global)"] == 2
    assert counts["cp.async commit"] == 1 and counts["cp.async wait"] == 1
    assert counts["ld.global v4"] == 1 and counts["ld.global scalar"] == 1 and counts["ld.global v2"] == 0
    assert counts["mma"] == 1 and counts["bar.sync"] == 1 and counts["wgmma"] == 0


def test_ptx_census_captures_the_triton_modules_of_a_lowering():
    """The capture needs no GPU and no triton package: moe_decode at V2-Lite's layer is one Triton module,
    with the engine tiles' warps and stages."""
    from benchmarks import ptx_census
    from dsjax.model import dispatch

    fn, args = ptx_census.KERNELS["moe_decode"]()
    (module,) = ptx_census.capture_triton_modules(fn, *args)
    assert module["name"] == "moe_decode" and module["ttir"].startswith("module @moe_decode")
    assert (module["num_warps"], module["num_stages"]) == (dispatch.MOE_DECODE_TILES.num_warps,
                                                          dispatch.MOE_DECODE_TILES.num_stages)


def test_moe_mgpu_probe_lowers_the_mosaic_launch():
    from benchmarks import moe_mgpu_probe

    assert moe_mgpu_probe.main(["--quick", "--variant", "RING=3,BLOCK_I=64"]) == {
        "built": 1, "RING=3,BLOCK_I=64": 1}


def test_code_size_reads_the_kernels_text_sections():
    """benchmarks.code_size sizes a cubin's kernels by its ELF64 section headers: an ELF built here with a
    kernel's .text section among others gives that section's size, under the kernel's name."""
    import struct

    from benchmarks.code_size import text_bytes

    names = b"\0.shstrtab\0.text.kernel_a\0.nv.info\0"
    header_at = 64 + len(names)
    sections = [(0, 0, 0), (1, 64, len(names)), (11, 0, 48 * 16), (26, 0, 40)]  # (name at, offset, size)
    elf = bytearray(b"\x7fELF" + bytes(60))
    struct.pack_into("<Q", elf, 0x28, header_at)
    struct.pack_into("<HHH", elf, 0x3A, 64, len(sections), 1)
    elf += names
    for name, offset, size in sections:
        elf += struct.pack("<IIQQQQIIQQ", name, 1, 0, 0, offset, size, 0, 0, 1, 0)
    assert text_bytes(bytes(elf)) == {"kernel_a": 768}


def test_sass_lines_counts_instructions_by_the_line_info_before_them():
    """benchmarks.sass_lines reads nvdisasm -g: each instruction counts for the last ``//## File`` line info above
    it (the file's base name), none before any; against a base, the lines by the change's size first, then each
    file's totals."""
    import collections

    from benchmarks.sass_lines import count_lines, rows

    sass = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        '        //## File "/w/pallas_kernels/decode_step_attention.py", line 577',
        "        /*0010*/                   STG.E.64.STRONG.GPU desc[UR4][R2.64], R4 ;",
        "        /*0020*/                   STG.E.64.STRONG.GPU desc[UR4][R2.64+0x400], R6 ;",
        '        //## File "/w/pallas_kernels/flag_words.py", line 120',
        "        /*0030*/                   LDG.E.64.STRONG.GPU R8, desc[UR4][R2.64] ;",
        "  .L_x_12:",
        "        /*0040*/                   BRA `(.L_x_12) ;"])
    counts = count_lines(sass)
    assert counts == {None: 1, ("decode_step_attention.py", 577): 2, ("flag_words.py", 120): 2}
    base = collections.Counter({("decode_step_attention.py", 577): 1, ("decode_step_attention.py", 600): 4})
    table = rows(counts, base, top=2)
    assert [r["line"] for r in table[:2]] == ["decode_step_attention.py:600", "flag_words.py:120"]
    assert table[0]["change"] == -4 and table[1]["change"] == 2 and table[1]["base"] == 0
    totals = {r["line"]: r["change"] for r in table[2:]}
    assert totals == {"(none) (all)": 1, "decode_step_attention.py (all)": -3, "flag_words.py (all)": 2}


def test_megakernel_probe_settings_name_a_kernel_constant():
    """--setting NAME=VALUE names one of decode_step_moe's module constants and a Python literal; anything
    else stops the probe with the accepted form."""
    from benchmarks import megakernel_probe as probe

    assert probe._setting("EXPERT_PLAN='split'") == ("EXPERT_PLAN", "split")
    assert probe._setting("EXPERT_PLAN='dealt'") == ("EXPERT_PLAN", "dealt")
    assert probe._setting("decode_step_attention.MERGE_GROUP=4") == ("decode_step_attention.MERGE_GROUP", 4)
    from pallas_kernels import decode_step_attention, decode_step_moe  # several settings, one variant

    seen = probe._under_all("EXPERT_PLAN='dealt'; decode_step_attention.MERGE_GROUP=4",
                            lambda: (decode_step_moe.EXPERT_PLAN, decode_step_attention.MERGE_GROUP))()
    assert seen == ("dealt", 4) and (decode_step_moe.EXPERT_PLAN, decode_step_attention.MERGE_GROUP) == ("split", 8)
    for bad in ("EXPERT_PLAN", "NO_SUCH=1", "expert_plan='split'", "no_module.RING=4", "decode_step_mgpu.NOPE=1"):
        with pytest.raises(SystemExit, match="expected NAME=VALUE"):
            probe._setting(bad)


def test_code_lines_counts_a_kernels_ops_by_source_line():
    """benchmarks.code_lines lowers a step kernel for an abstract H200 (no GPU) and counts its Mosaic GPU
    module's ops by the pallas_kernels line each comes from: the GEMV chain's products come from _unit_sums'
    wgmma line; a module's text with a callsite location resolves to the innermost kernel line."""
    from benchmarks import code_lines

    payload = code_lines.main(["--kernel", "gemv", "--top", "5"])
    rows = payload["rows"]
    assert rows[0]["line"] == "(all)" and rows[0]["ops"] > 1000
    assert len(rows) == 6 and sum(r["ops"] for r in rows[1:]) < rows[0]["ops"]
    assert any(r["line"].startswith("decode_step_mgpu.py:") for r in rows[1:])
    asm = "\n".join(['#loc1 = loc("/x/pallas_kernels/k.py":7:3)', '#loc2 = loc("/x/jax/core.py":9:1)',
                     '#loc3 = loc(callsite(#loc1 at #loc2))', '%0 = arith.addi %a, %b : i32 loc(#loc3)',
                     '%1 = arith.constant 1 : i32 loc(#loc3)', '"nvvm.fence"() : () -> () loc(#loc2)'])
    assert code_lines.ops_by_line(asm) == {"k.py:7": 1, None: 1}


def test_megakernel_probe_can_leave_the_products_or_the_store_waits_out():
    """--without products / store_waits traces the whole layer with wgmma, or the TMA stores' waits and the proxy
    fences, as no-ops (diagnostics of what they cost): the lowered module has none of them, the kernel as built
    has them, and the originals are restored afterwards."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from benchmarks import code_lines
    from benchmarks import megakernel_probe as probe
    from pallas_kernels import decode_step_mgpu

    fn, operands = code_lines.kernel_call("attention", layers=1)
    originals = (plgpu.wgmma, plgpu.wait_smem_to_gmem, decode_step_mgpu.proxy_fence)
    built = "".join(code_lines.lowered_modules(fn, *operands))
    for what, instruction in (("products", "wgmma.mma_async"), ("store_waits", "fence.proxy.async.global")):
        stubbed = "".join(code_lines.lowered_modules(probe._without(what, fn), *operands))
        assert instruction in built and instruction not in stubbed
    assert (plgpu.wgmma, plgpu.wait_smem_to_gmem, decode_step_mgpu.proxy_fence) == originals
    with pytest.raises(SystemExit, match="accepted: products, store_waits"):
        probe._without("barriers", fn)


def test_step_profile_names_what_each_device_op_computes(tmp_path):
    """The profile writes the step's optimized HLO beside its trace and gives each device op its HLO line
    (shape, op, operands), found by the op's name; on the CPU the trace has no GPU ops, but the HLO is there."""
    from benchmarks import step_profile

    text = ("HloModule jit_step\n\nfused_computation.1 {\n  ROOT %x = f32[2]{0} add(%a, %b)\n}\n\n"
            "ENTRY %main {\n  %input_concatenate_fusion = bf16[26,2,2048,64]{3,2,1,0} fusion(f32[26,2048,64]{2,1,0} "
            "%p), kind=kInput, calls=%fused_computation.1\n  ROOT %t = (f32[2]) tuple(%x)\n}\n")
    lines = step_profile.hlo_lines(text)
    assert lines["input_concatenate_fusion"].startswith("bf16[26,2,2048,64]{3,2,1,0} fusion(f32[26,2048,64]")
    assert lines["x"] == "f32[2]{0} add(%a, %b)" and lines["t"].startswith("(f32[2]) tuple")
    sampler = "HloModule jit_sample\n\nENTRY %main {\n  ROOT %x = s32[1]{0} convert(%l)\n}\n"
    assert step_profile.hlo_lines(text, sampler)["x"] == "f32[2]{0} add(%a, %b) | s32[1]{0} convert(%l)"
    step_profile.main(["--preset", "tiny", "--batch", "1", "--num-kv-blocks", "64", "--trace-dir", str(tmp_path)])
    hlo = (tmp_path / "step_hlo.txt").read_text()
    assert "HloModule" in hlo and hlo.count("HloModule") >= 2  # the forward and its sampler


def test_step_profile_finds_a_programs_device_copies_and_their_sources():
    """A program that returns a constant copies it into a fresh output buffer every call (a GPU profile's
    MemcpyD2D): ``device_copies`` finds that copy in XLA's optimized HLO and names its source; a copy inside a
    fusion's body is part of that fusion's kernel and is not listed."""
    from benchmarks import step_profile

    program = jax.jit(lambda x: (x + 1, jnp.zeros((1, 0), jnp.int32)))
    copies = step_profile.device_copies(program.lower(jnp.ones(3)).compile().as_text())
    assert [(c["shape"], c["source_line"].split(" ")[1]) for c in copies] == [("s32[1,0]{1,0}", "constant({")]
    fused = ("HloModule m\n\n%fused_computation (p: f32[2]) -> f32[2] {\n  %p = f32[2]{0} parameter(0)\n"
             "  ROOT %copy.1 = f32[2]{0} copy(%p)\n}\n\nENTRY %main (a: f32[2]) -> f32[2] {\n"
             "  %a = f32[2]{0} parameter(0)\n"
             "  ROOT %f = f32[2]{0} fusion(%a), kind=kLoop, calls=%fused_computation\n}\n")
    assert step_profile.device_copies(fused) == []
    unfused = fused.replace("ROOT %f = f32[2]{0} fusion(%a), kind=kLoop, calls=%fused_computation",
                            "ROOT %copy.2 = f32[2]{0} copy(f32[2]{0} %a)")
    assert step_profile.device_copies(unfused) == [
        {"name": "copy.2", "shape": "f32[2]{0}", "source": "a", "source_line": "f32[2]{0} parameter(0)"}]


def test_route_linear_probe_counts_choices_that_differ_from_the_models():
    """Routing from the router's linear parts chooses what an f32 path with the norm chooses (a positive scale
    keeps the top-k), and both differ from the model's bf16-rounded path on a small share of tokens."""
    from benchmarks import route_linear_probe

    row = route_linear_probe.chosen_sets_differ(3000)
    assert row["linear_vs_f32"] < 0.005
    assert 0 < row["linear_parts"] < 0.1 and abs(row["linear_parts"] - row["f32_path"]) < 0.005
    payload = route_linear_probe.main(["--tokens", "500"])
    assert [r["path"].split(" ")[0] for r in payload["rows"]] == ["linear", "f32"]


def test_step_profile_reads_one_step_and_one_launch_from_a_trace(tmp_path):
    """device_timeline: the ops between the 2nd and 3rd starts of the op with the most time, with the gaps
    between them; host_spans: the median launch on the host with the spans nested in it, by depth."""
    import gzip

    from benchmarks.step_profile import device_timeline, host_spans

    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
    device, host = [], []
    for step in range(4):  # a kernel of 100 us, a gap of 5, a small op of 2, then 13 idle
        t0 = step * 120.0
        device += [{"ph": "X", "pid": 1, "tid": 7, "name": "kernel", "ts": t0, "dur": 100.0},
                   {"ph": "X", "pid": 1, "tid": 7, "name": "small", "ts": t0 + 105.0, "dur": 2.0}]
        length = (50.0, 80.0, 60.0, 70.0)[step]  # launches of 50-80 us: the median is the 70 us one
        host += [{"ph": "X", "pid": 2, "tid": 3, "name": "$runner.py:329 launch", "ts": t0, "dur": length},
                 {"ph": "X", "pid": 2, "tid": 3, "name": "Execute", "ts": t0 + 1.0, "dur": length - 10.0},
                 {"ph": "X", "pid": 2, "tid": 3, "name": "update", "ts": t0 + 2.0, "dur": 30.0},
                 {"ph": "X", "pid": 2, "tid": 3, "name": "tiny", "ts": t0 + 40.0, "dur": 1.0}]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": meta + device + host}, f)
    timeline = device_timeline(str(path))
    assert [(r["name"], r["start_us"], r["gap_us"], r["dur_us"]) for r in timeline] == [
        ("kernel", 0.0, 0.0, 100.0), ("small", 105.0, 5.0, 2.0), ("kernel", 120.0, 13.0, 100.0)]
    spans = host_spans(str(path), min_us=5.0)
    assert [(r["depth"], r["dur_us"], r["name"]) for r in spans] == [
        (0, 70.0, "$runner.py:329 launch"), (1, 60.0, "Execute"), (2, 30.0, "update")]
    assert host_spans(str(path), root="absent") == []


def test_step_profile_set_applies_knobs_before_the_engine(monkeypatch):
    """--set 'module.ATTR=LITERAL ...' sets the knobs before the engine is built (here the run stops there)."""
    from benchmarks import step_profile
    from dsjax.engine import runner

    monkeypatch.setattr(runner, "STEP_KERNEL_GRAPHS", runner.STEP_KERNEL_GRAPHS)  # put back after the test

    class Built(Exception):
        pass

    def engine(args):
        raise Built(runner.STEP_KERNEL_GRAPHS)

    monkeypatch.setattr(step_profile, "_decoding_engine", engine)
    with pytest.raises(Built) as seen:
        step_profile.main(["--preset", "tiny", "--set", "dsjax.engine.runner.STEP_KERNEL_GRAPHS=True"])
    assert seen.value.args == (True,)
    with pytest.raises(SystemExit):
        step_profile.main(["--preset", "tiny", "--set", "no_dot=1"])


def test_run_h200_lists_exactly_its_targets():
    """benchmarks/run_h200.sh's usage line names every target its case statement has, and no other."""
    import pathlib
    import re

    script = (pathlib.Path(__file__).parents[2] / "benchmarks" / "run_h200.sh").read_text()
    usage = re.search(r"^# ([a-z0-9|-]+)\)\.$", script, re.M).group(1).split("|")
    cases = re.findall(r"^  ([a-z0-9-]+)\)", script, re.M)
    assert len(usage) == len(set(usage)) and sorted(usage) == sorted(cases)


def test_signal_sass_assembles_every_signal_and_shows_the_release_fence(capsys):
    """``benchmarks.signal_sass``: every way of signalling a semaphore assembles for sm_90a; with a disassembler at
    hand, the release add's machine code holds the MEMBAR that round 44 priced and the relaxed add's none. Skipped
    without ptxas (a CUDA toolkit or the nvidia-cuda-nvcc wheel)."""
    from benchmarks import code_size, signal_sass

    try:
        code_size.ptxas()
    except SystemExit:
        pytest.skip("no ptxas on this machine")
    signal_sass.main([])
    out = capsys.readouterr().out
    for name in signal_sass.VARIANTS:
        assert f"## {name}: ptxas rc 0" in out, name
    if signal_sass.disassembler():
        release, relaxed = out.split("## red.release")[1], out.split("## relaxed")[1].split("## ")[0]
        assert "MEMBAR.ALL.GPU" in release.split("## ")[0] and "MEMBAR" not in relaxed

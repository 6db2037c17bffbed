"""Scenario mixed: the design notes' mixed workload (the classes and ratios of
dsjax/loadtest/workload.py) offline through LLM.generate, then a templated variant of it for the prefix
cache. Run by benchmarks/e2e.py.

Offline means every request arrives at once: TTFT includes the wait behind earlier requests. TPOT is
(finished - first token) / (tokens - 1) per request, from RequestOutput.metrics.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np

from benchmarks.common import markdown_table
from dsjax import SamplingParams
from dsjax.loadtest.workload import MIXED, PROMPT_CLASSES, Workload

COLUMNS = ["workload", "requests", "prompt_tokens", "output_tokens", "output_tok_per_s", "total_tok_per_s",
           "ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p99_ms", "batch_efficiency", "prefix_hit_rate",
           "template_share", "num_steps", "preemptions"]
PREFIX_HIT_TARGET = 0.9  # the design notes' bar for templated prompts


def workload(settings, vocab_size: int) -> Workload:
    # Byte-range ids (3..258) are valid in every preset's vocabulary, the tiny one's 512 included.
    return Workload(MIXED, scale=settings.mixed_scale, max_tokens=(settings.mixed_max_tokens,) * 2,
                    token_ids=(3, min(258, vocab_size - 1)))


def sample_requests(settings, vocab_size: int) -> list[tuple[str, list[int], int]]:
    """(class, prompt ids, max_tokens) per request, drawn as the load generator draws them."""
    rng = random.Random(settings.seed)
    w = workload(settings, vocab_size)
    return [w.sample(rng) for _ in range(settings.mixed_requests)]


def templated_prompts(requests, num_templates: int, unique_fraction: float, vocab_size: int,
                      seed: int) -> tuple[list[list[int]], int]:
    """The same prompt lengths, each now the head of one of ``num_templates`` shared templates (request
    i takes template i mod num_templates) followed by max(1, round(length x unique_fraction)) tokens of its
    own: a system prompt or few-shot template with a short user turn. -> (prompts, template tokens in them)."""
    rng = np.random.default_rng(seed)
    hi = min(259, vocab_size)
    longest = max(len(ids) for _, ids, _ in requests)
    templates = [rng.integers(3, hi, longest).tolist() for _ in range(num_templates)]
    prompts, shared = [], 0
    for i, (_, ids, _) in enumerate(requests):
        unique = max(1, round(len(ids) * unique_fraction))
        prompts.append(templates[i % num_templates][:len(ids) - unique] + rng.integers(3, hi, unique).tolist())
        shared += len(ids) - unique
    return prompts, shared


def run_workload(llm, name: str, prompts: list[list[int]], max_tokens: list[int]) -> tuple[dict, dict]:
    """One offline LLM.generate of every prompt: (summary row, per-request samples). Engine counters are
    read before and after, so earlier work on the same engine does not leak into the numbers."""
    engine = llm.engine
    runner, pool, scheduler = engine.runner, engine.block_manager, engine.scheduler
    before = (runner.num_useful_tokens, runner.num_padded_tokens, pool.num_prefix_query_tokens,
              pool.num_prefix_hit_tokens, engine.num_steps, scheduler.num_preemptions)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    useful, padded, queried, hits, steps, preemptions = (
        now - then for now, then in zip((runner.num_useful_tokens, runner.num_padded_tokens,
                                          pool.num_prefix_query_tokens, pool.num_prefix_hit_tokens,
                                          engine.num_steps, scheduler.num_preemptions), before))
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    tpot = [(o.metrics.finished_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
            for o in outs if len(o.outputs[0].token_ids) > 1]
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = sum(map(len, prompts))
    pct = lambda values, q, scale=1.0: float(np.percentile(values, q)) * scale if values else None
    row = {
        "workload": name, "requests": len(prompts), "prompt_tokens": prompt_tokens, "output_tokens": generated,
        "seconds": seconds, "output_tok_per_s": generated / seconds,
        "total_tok_per_s": (generated + prompt_tokens) / seconds,
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "tpot_p50_ms": pct(tpot, 50, 1e3), "tpot_p99_ms": pct(tpot, 99, 1e3),
        # tokens the steps needed over tokens they computed once padded to their bucket
        "batch_efficiency": useful / padded if padded else None,
        "prefix_hit_rate": hits / queried if queried else 0.0, "prefix_hit_tokens": hits,
        "num_steps": steps, "preemptions": preemptions,
    }
    return row, {"ttft_s": ttft, "tpot_s": tpot}


def run_mixed(llm, settings) -> dict:
    vocab = llm.model.config.vocab_size
    requests = sample_requests(settings, vocab)
    max_tokens = [m for _, _, m in requests]
    kinds = {kind: sum(k == kind for k, _, _ in requests) for kind in PROMPT_CLASSES}
    mixed, mixed_samples = run_workload(llm, "mixed", [ids for _, ids, _ in requests], max_tokens)
    print(f"  mixed: {mixed['output_tok_per_s']:.0f} output tok/s, TTFT P50 {mixed['ttft_p50_s']:.3f}s", flush=True)
    # Cold cache for the templated run: its hit rate counts each template's first sight as a miss.
    llm.engine.block_manager.reset_prefix_cache()
    prompts, shared = templated_prompts(requests, settings.templates, settings.template_unique, vocab,
                                        settings.seed + 1)
    templated, templated_samples = run_workload(llm, "templated", prompts, max_tokens)
    # The most a cache could serve: every template token (block rounding and first sightings aside).
    mixed["template_share"], templated["template_share"] = 0.0, shared / templated["prompt_tokens"]
    print(f"  templated: prefix hit rate {templated['prefix_hit_rate']:.1%}", flush=True)
    rows = [mixed, templated]
    w = workload(settings, vocab)
    return {
        "rows": rows, "table": markdown_table(rows, COLUMNS),
        "samples": {"mixed": mixed_samples, "templated": templated_samples},
        "workload": {"classes": {k: w.prompt_range(k) for k in w.mix}, "mix": w.mix, "scale": w.scale,
                     "max_tokens": settings.mixed_max_tokens, "requests_per_class": kinds,
                     "templates": settings.templates, "template_unique_fraction": settings.template_unique,
                     "arrivals": "offline: every request at once, so TTFT includes queueing"},
        "prefix_hit_target": PREFIX_HIT_TARGET,
        "prefix_hit_target_met": templated["prefix_hit_rate"] > PREFIX_HIT_TARGET,
    }


def plot_mixed(payload: dict, directory: Path, name: str) -> list[Path]:
    """<name>.png: TTFT and TPOT distributions (CDFs) of the plain and the templated run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    rows = {r["workload"]: r for r in payload["rows"]}
    for ax, key, unit, scale in ((axes[0], "ttft_s", "s", 1.0), (axes[1], "tpot_s", "ms", 1e3)):
        for workload_name, samples in payload["samples"].items():
            values = np.sort(np.asarray(samples[key], float)) * scale
            if not len(values):
                continue
            row = rows[workload_name]
            stat = key.split("_")[0]
            p50, p99 = row[f"{stat}_p50_{unit}"], row[f"{stat}_p99_{unit}"]
            ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post",
                    label=f"{workload_name}: P50 {p50:.3g}, P99 {p99:.3g} {unit}")
        ax.set_xlabel(f"{key.split('_')[0].upper()} ({unit})")
        ax.set_ylabel("fraction of requests")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{payload['preset']} mixed workload, offline ({payload['rows'][0]['requests']} requests), "
                 f"{payload['device']}", fontsize=10)
    fig.tight_layout()
    path = Path(directory) / f"{name}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]

"""Scenario hf-baseline: Hugging Face transformers ``generate`` against dsjax's ``LLM.generate`` on the
same config, the same device and the same requests (B prompts of --hf-prompt tokens, --hf-new-tokens
greedy tokens each, prefill included). Run by benchmarks/e2e.py.

Weights: ``same`` exports the dsjax model (dsjax.checkpoint.save_hf) and loads it in transformers, and
then the greedy tokens of both must agree; ``random`` builds the transformers model from the same
config.json with torch's random init, directly on the device (a 15.7B model is 31 GB of safetensors to
write and read back otherwise): throughput does not depend on the weight values. ``auto`` takes
``same`` on CPU and ``random`` on an accelerator. torch and transformers are optional (the ``hf``
extra): without them the scenario records why it was skipped.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks.common import markdown_table
from dsjax import SamplingParams

COLUMNS = ["batch", "prompt", "new_tokens", "hf_tok_per_s", "dsjax_tok_per_s", "speedup", "hf_seconds",
           "dsjax_seconds"]
WEIGHTS = ("auto", "same", "random")


def missing_dependency() -> str | None:
    for name in ("torch", "transformers"):
        if importlib.util.find_spec(name) is None:
            return f"{name} is not installed (pip install -e '.[hf]'): the Hugging Face baseline needs torch and transformers"
    return None


def build_hf_model(llm, weights: str, device: str, seed: int):
    """(transformers model in the dsjax model's dtype on ``device``, how its weights were made)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, np.dtype(llm.model.dtype).name)
    with tempfile.TemporaryDirectory() as directory:
        if weights == "same":
            from dsjax.checkpoint.export import save_hf
            save_hf(llm.model, directory)
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device)
            how = "same: the dsjax weights, exported with dsjax.checkpoint.save_hf and loaded by from_pretrained"
        else:
            Path(directory, "config.json").write_text(json.dumps(llm.model.config.to_hf()))
            torch.manual_seed(seed)
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), dtype=dtype)
            how = ("random: torch's init from the same config.json, built on the device (not the dsjax weights; "
                   "throughput does not depend on weight values)")
    return model.eval(), how


def hf_generate(model, prompts: np.ndarray, new_tokens: int, pad_token_id: int) -> tuple[np.ndarray, float]:
    """(generated ids [B, new_tokens], seconds) of one greedy generate; EOS is held off, as dsjax's
    min_tokens does, so both produce exactly new_tokens."""
    import torch

    ids = torch.as_tensor(prompts, dtype=torch.long, device=model.device)
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_token_id)
    sync()
    return out[:, prompts.shape[1]:].cpu().numpy(), time.perf_counter() - start


def dsjax_generate(llm, prompts: np.ndarray, new_tokens: int) -> tuple[np.ndarray, float]:
    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0)
    start = time.perf_counter()
    outs = llm.generate(prompts.tolist(), params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return np.asarray([o.outputs[0].token_ids for o in outs]), seconds


def run_hf_baseline(llm, settings) -> dict:
    missing = missing_dependency()
    if missing:
        print(f"  hf-baseline: skipped ({missing})", flush=True)
        return {"skipped": missing, "rows": []}
    import torch
    import transformers

    on_accelerator = jax.default_backend() != "cpu"
    if on_accelerator and not torch.cuda.is_available():
        reason = f"JAX runs on {jax.default_backend()} but this torch ({torch.__version__}) sees no CUDA device"
        print(f"  hf-baseline: skipped ({reason})", flush=True)
        return {"skipped": reason, "rows": []}
    device = "cuda" if on_accelerator else "cpu"
    weights = settings.hf_weights if settings.hf_weights != "auto" else ("random" if on_accelerator else "same")
    start = time.perf_counter()
    model, how = build_hf_model(llm, weights, device, settings.seed)
    build_s = time.perf_counter() - start
    config = llm.model.config
    pad = config.eos_token_ids[0] if config.eos_token_ids else 0
    rng = np.random.default_rng(settings.seed)
    n, p = settings.hf_new_tokens, settings.hf_prompt
    rows, greedy, skipped = [], [], []
    for batch in settings.hf_batches:
        # First-call work at this shape (kernel selection, allocator growth) stays out of the numbers; other
        # prompts, so the timed ones find nothing in dsjax's prefix cache.
        warm = rng.integers(3, config.vocab_size, (batch, p))
        prompts = rng.integers(3, config.vocab_size, (batch, p))
        try:
            hf_generate(model, warm, 2, pad)
            hf_tokens, hf_s = hf_generate(model, prompts, n, pad)
        except torch.OutOfMemoryError as e:
            # transformers beside the engine's weights and KV pool (one process: a device under ~100 GB):
            # this batch is recorded as skipped, the rest of the run goes on.
            said = ". ".join(str(e).splitlines()[0].split(". ")[:2]).rstrip(".")  # torch's first two sentences
            reason = (f"transformers ran out of device memory beside the dsjax engine ({said}.); a "
                      "smaller engine (--kv-cache-gib, XLA_PYTHON_CLIENT_MEM_FRACTION) leaves it more")
            skipped.append({"batch": batch, "reason": reason})
            print(f"  hf-baseline b{batch}: skipped ({reason})", flush=True)
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
            continue
        dsjax_generate(llm, warm, 2)
        ours, ours_s = dsjax_generate(llm, prompts, n)
        rows.append({"batch": batch, "prompt": p, "new_tokens": n, "hf_seconds": hf_s, "hf_tok_per_s": batch * n / hf_s,
                     "dsjax_seconds": ours_s, "dsjax_tok_per_s": batch * n / ours_s, "speedup": hf_s / ours_s})
        greedy.append({"batch": batch, "rows_equal": int((hf_tokens == ours).all(axis=1).sum()),
                       "first_hf": hf_tokens[0].tolist(), "first_dsjax": ours[0].tolist()})
        print(f"  hf-baseline b{batch}: HF {rows[-1]['hf_tok_per_s']:.1f} tok/s, dsjax "
              f"{rows[-1]['dsjax_tok_per_s']:.1f} tok/s", flush=True)
    info = {"transformers": transformers.__version__, "torch": torch.__version__, "device": device,
            "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu", "weights": how,
            "dtype": str(model.dtype), "attn_implementation": model.config._attn_implementation,
            "experts_implementation": getattr(model.config, "_experts_implementation", None), "build_s": build_s}
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()  # give the memory back before anything else runs in this process
    check = None
    if weights == "same":
        check = {"checked": "greedy tokens of every row, HF generate against dsjax LLM.generate (same weights)",
                 "rows_equal": sum(g["rows_equal"] for g in greedy), "rows": sum(r["batch"] for r in rows),
                 "per_batch": greedy}
        check["match"] = check["rows_equal"] == check["rows"]
    return {"rows": rows, "table": markdown_table(rows, COLUMNS), "hf": info, "greedy_check": check,
            "skipped_batches": skipped}


def plot_hf_baseline(payload: dict, directory: Path, name: str) -> list[Path]:
    """<name>.png: tok/s of both at each batch."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ax.bar(x - 0.2, [r["hf_tok_per_s"] for r in rows], 0.4, label=f"transformers {payload['hf']['transformers']} generate")
    ax.bar(x + 0.2, [r["dsjax_tok_per_s"] for r in rows], 0.4, label="dsjax LLM.generate")
    for i, r in enumerate(rows):
        ax.annotate(f"{r['speedup']:.1f}x", (i + 0.2, r["dsjax_tok_per_s"]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, [f"batch {r['batch']}" for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("generated tokens/s (prefill included)")
    ax.set_title(f"{payload['preset']}: {rows[0]['prompt']}-token prompts, {rows[0]['new_tokens']} new tokens, "
                 f"{payload['device']}", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(directory) / f"{name}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]

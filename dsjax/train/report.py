"""What a finished run leaves for people: the loss curve, a greedy sample and the model card."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)


def greedy_completion(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """Greedy continuation of ``prompt`` (stops at an EOS id), by full forwards over one fixed-size
    buffer: one compile, and causal attention makes the not-yet-written tail irrelevant."""
    prompt_ids = tokenizer.encode(prompt)
    buffer = np.zeros((1, len(prompt_ids) + max_new_tokens), np.int32)
    buffer[0, :len(prompt_ids)] = prompt_ids
    generated = []
    for pos in range(len(prompt_ids), buffer.shape[1]):
        next_id = int(jnp.argmax(model.logits(buffer)[0, pos - 1]))
        if next_id in tokenizer.eos_token_ids:
            break
        buffer[0, pos] = next_id
        generated.append(next_id)
    return prompt + tokenizer.decode(generated)


def plot_losses(history: list[dict], path: str | Path, title: str = "") -> Path | None:
    """Train loss (per logged interval) and held-out loss against steps; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no loss curve (pip install matplotlib)")
        return None
    train = [(r["step"], r["loss"]) for r in history if r["kind"] == "train"]
    held = [(r["step"], r["eval_loss"]) for r in history if r["kind"] == "eval"]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train", lw=1.2)
    if held:
        ax.plot(*zip(*held), "o-", label="held-out", ms=3, lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("next-token cross-entropy (nats)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def model_card(s: dict) -> str:
    """README.md of the exported directory, from the run summary ``s`` (see pipeline.summarize)."""
    data, cfg, model = s["data"], s["train"], s["model"]
    best, ppl = s["best_eval_loss"], math.exp(min(s["best_eval_loss"], 50.0))
    epochs = s["tokens_seen"] / max(data["train_tokens"], 1)
    routing = (f"{model['n_routed_experts']} routed experts (top-{model['num_experts_per_tok']}, "
               f"{model['n_group']} groups, top-{model['topk_group']} groups) + {model['n_shared_experts']} "
               f"shared, sigmoid scores with `e_score_correction_bias` (noaux_tc)")
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags: [deepseek_v3, moe, mla, dsjax, code]",
        "---",
        "",
        f"# {s['name']}: a {s['num_params'] / 1e6:.3g}M-parameter DeepSeek-V3 model of Python's standard library",
        "",
        "A small DeepSeek-V3-architecture language model (multi-head latent attention + DeepSeekMoE) "
        "trained from scratch by `python -m dsjax.train` on the Python standard library, so that dsjax "
        "ships a model that writes Python-looking text without downloading anything. It is a "
        "demonstration model: it knows stdlib idioms, not facts, and has never seen a conversation.",
        "",
        "## Model",
        "",
        f"- {s['num_params'] / 1e6:.2f}M parameters, {s['active_params'] / 1e6:.2f}M active per token; "
        f"`model.safetensors` {s['safetensors_bytes'] / 2**20:.1f} MiB ({cfg['export_dtype']}, router in float32)",
        f"- {model['num_hidden_layers']} layers ({model['first_k_dense_replace']} dense, the rest MoE), "
        f"hidden {model['hidden_size']}, {model['num_attention_heads']} heads",
        f"- MLA: q_lora_rank {model['q_lora_rank']}, kv_lora_rank {model['kv_lora_rank']}, "
        f"qk_nope_head_dim {model['qk_nope_head_dim']}, qk_rope_head_dim {model['qk_rope_head_dim']}, "
        f"v_head_dim {model['v_head_dim']}",
        f"- MoE: {routing}; expert width {model['moe_intermediate_size']}, dense width "
        f"{model['intermediate_size']}",
        f"- context: trained on {cfg['seq_len']}-token windows (max_position_embeddings "
        f"{model['max_position_embeddings']})",
        "",
        "## Corpus and tokenizer",
        "",
        f"- CPython {data['python']} standard library `*.py` (no test directories, no site-packages): "
        f"{data['train_files']} training files, {data['train_bytes'] / 1e6:.1f} MB, "
        f"{data['train_tokens'] / 1e6:.2f}M tokens",
        f"- held out: {', '.join(data['heldout_modules'])} ({data['heldout_files']} files, "
        f"{data['heldout_tokens'] / 1e3:.0f}k tokens)",
        f"- byte-level BPE trained on the training files with `tokenizers`: {data['vocab_size']} ids, "
        f"{data['bytes_per_token']:.2f} bytes per token; specials `<|bos|>` 0, `<|eos|>` 1, `<|pad|>` 2, "
        "`<|system|>` `<|user|>` `<|assistant|>` (chat template in tokenizer_config.json). Each file is "
        "one `<|bos|> ... <|eos|>` document.",
        "",
        "## Recipe",
        "",
        f"- {s['steps']} steps of {cfg['batch_size']} x {cfg['seq_len']} tokens "
        f"({s['tokens_seen'] / 1e6:.3g}M tokens, {epochs:.2g} epochs), windows at random offsets",
        f"- AdamW (b1 {cfg['beta1']}, b2 {cfg['beta2']}, weight decay {cfg['weight_decay']} on matrices), "
        f"peak learning rate {cfg['learning_rate']:g} after {cfg['warmup_steps']} linear warm-up steps, "
        f"cosine decay to {cfg['min_learning_rate']:g}; global-norm clipping at {cfg['grad_clip']}",
        f"- {cfg['dtype']} compute, float32 master weights; expert balancing without auxiliary loss "
        f"(DeepSeek-V3): after each step every layer's router bias moves by {cfg['bias_update_speed']:g} "
        "toward its under-loaded experts",
        f"- exported: the parameters of the lowest held-out loss (step {s['best_step']} of {s['steps']})",
        "",
        "## Results",
        "",
        "| | |",
        "|---|---|",
        f"| held-out loss (nats/token) | {best:.3f} |",
        f"| held-out perplexity | {ppl:.2f} |",
        f"| held-out bits per byte | {best / math.log(2) * data['heldout_tokens'] / data['heldout_bytes']:.3f} |",
        f"| final train loss (last interval) | {s['final_train_loss']:.3f} |",
        f"| mean max/mean expert load (last interval) | {s['final_max_load']:.2f} |",
        f"| training throughput | {s['tokens_per_second']:,.0f} tokens/s |",
        f"| wall time | data {s['data_seconds']:.0f} s, train {s['train_seconds']:.0f} s (first step, compile "
        f"included, {s['compile_seconds']:.0f} s), total {s['total_seconds']:.0f} s |",
        f"| device | {s['device']} |",
        "",
        "![loss curve](loss.png)" if s.get("loss_png") else "",
        "",
        f"Greedy completion of `{cfg['sample_prompt']}` ({cfg['sample_tokens']} tokens at most):",
        "",
        "```python",
        s["sample"].rstrip(),
        "```",
        "",
        "## Use",
        "",
        "```python",
        "import dsjax",
        "model = dsjax.load_model(\"path/to/this/dir\")",
        "tokenizer = dsjax.load_tokenizer(\"path/to/this/dir\")",
        "# or transformers: AutoModelForCausalLM.from_pretrained(dir), AutoTokenizer.from_pretrained(dir)",
        "```",
        "",
        f"Reproduce: `{s['command']}` (train_config.yaml holds the settings; train_log.jsonl the curve).",
        "",
    ]
    if s.get("note"):
        lines += [f"Note: {s['note']}", ""]
    return "\n".join(lines)

"""``python -m dsjax.demo``: load a model (the embedded ``default`` model by default), print its logits and a greedy
continuation computed with full forward passes (no cache)."""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

import dsjax


def greedy(model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens from full causal forwards over one fixed-size buffer (a single compile)."""
    buffer = np.zeros((1, len(prompt_ids) + max_tokens), np.int32)
    buffer[0, :len(prompt_ids)] = prompt_ids
    for pos in range(len(prompt_ids), buffer.shape[1]):
        buffer[0, pos] = int(np.argmax(model.logits(buffer)[0, pos - 1]))
    return buffer[0, len(prompt_ids):].tolist()


def run(model_name: str = dsjax.loader.DEFAULT_MODEL, prompt: str = "def fibonacci(n):", max_tokens: int = 16,
        dtype: str = "float32") -> list[int]:
    start = time.perf_counter()
    model = dsjax.load_model(model_name, dtype=dtype)
    tokenizer = dsjax.load_tokenizer(model_name)
    c = model.config
    print(f"model {model_name}: {c.model_type}, {c.num_params() / 1e6:.1f}M parameters, "
          f"{c.num_hidden_layers} layers ({c.num_dense_layers} dense), {c.n_routed_experts} routed experts "
          f"(top-{c.num_experts_per_tok}), MLA latent {c.kv_lora_rank}+{c.qk_rope_head_dim}; "
          f"loaded in {time.perf_counter() - start:.1f}s on {jax.devices()[0].device_kind}")
    ids = tokenizer.encode(prompt)
    logits = np.asarray(model.logits(np.asarray([ids], np.int32)))
    top = np.argsort(-logits[0, -1])[:5]
    print(f"prompt {prompt!r} -> {len(ids)} tokens; logits {logits.shape} float32")
    print("next-token top-5: " + ", ".join(f"{int(t)} ({logits[0, -1, t]:+.3f})" for t in top))
    out = greedy(model, ids, max_tokens)
    print(f"greedy tokens: {out}")
    print(f"greedy text: {tokenizer.decode(out)!r}")
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=dsjax.loader.DEFAULT_MODEL,
                        help="embedded model (default), preset name or checkpoint directory")
    parser.add_argument("--prompt", default="def fibonacci(n):")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    run(args.model, args.prompt, args.max_tokens, args.dtype)


if __name__ == "__main__":
    main()

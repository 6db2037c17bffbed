"""Could the step kernel choose a layer's experts before its o_proj is summed? (docs/decode_step_kernel.md,
"route from the router's linear parts"; CPU, seconds.)

RMSNorm scales a row by one positive scalar, which changes neither the softmax's order nor a greedy top-k, so
the top-k could come from (x * g) @ W_r + attn @ (W_o * g @ W_r), linear in what exists after the attention.
The model instead rounds x_mid = x + attn @ W_o and the normed rows to bf16 before its f32 router. This probe
draws V2-Lite-shaped layers (D = 2048, 16 x 128 attention rows, 64 experts, top-6) and counts the tokens whose
chosen set differs from the model's, for the linear parts and for a plain f32 path without the roundings.

    python -m benchmarks.route_linear_probe --tokens 20000 --out benchmarks/results/route_linear_cpu.json
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks.common import markdown_table, write_probe
from pallas_kernels.common import rms_norm


def chosen_sets_differ(tokens: int, seed: int = 0, hidden: int = 2048, experts: int = 64, top_k: int = 6,
                       eps: float = 1e-6) -> dict:
    """Shares of ``tokens`` random tokens whose top-k expert set differs from the model's (bf16 x_mid, bf16
    normed rows, f32 router): with the linear parts, and with an f32 path; between those two; and the median
    gap between the model's k-th and (k+1)-th logits."""
    keys = iter(jax.random.split(jax.random.key(seed), 5))
    f32, bf16 = jnp.float32, jnp.bfloat16
    w_o = (jax.random.normal(next(keys), (hidden, hidden)) * hidden ** -0.5).astype(bf16)
    g = (1 + jax.random.uniform(next(keys), (hidden,)) / 4).astype(bf16)
    w_r = jax.random.normal(next(keys), (hidden, experts)) * hidden ** -0.5
    x = jax.random.normal(next(keys), (tokens, hidden)).astype(bf16)
    attn = (jax.random.normal(next(keys), (tokens, hidden)) / 8).astype(bf16)
    with jax.default_matmul_precision("highest"):
        mid = x.astype(f32) + attn.astype(f32) @ w_o.astype(f32)
        model = rms_norm(mid.astype(bf16), g, eps).astype(f32) @ w_r  # the model's roundings
        linear = (x.astype(f32) * g.astype(f32)) @ w_r + attn.astype(f32) @ ((w_o.astype(f32) * g.astype(f32)) @ w_r)
        plain = (mid * jax.lax.rsqrt(jnp.mean(mid * mid, -1, keepdims=True) + eps) * g.astype(f32)) @ w_r
    chosen = lambda logits: jnp.sort(jax.lax.top_k(logits, top_k)[1], axis=-1)
    want = chosen(model)
    differ = lambda logits: float(jnp.mean(jnp.any(chosen(logits) != want, axis=-1)))
    ranked = jnp.sort(model, axis=-1)
    return dict(tokens=tokens, linear_parts=differ(linear), f32_path=differ(plain),
                linear_vs_f32=float(jnp.mean(jnp.any(chosen(linear) != chosen(plain), axis=-1))),
                median_gap=float(jnp.median(ranked[:, -top_k] - ranked[:, -top_k - 1])))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    row = chosen_sets_differ(args.tokens, args.seed)
    rows = [dict(path="linear parts (no norm, no roundings)", tokens=row["tokens"], set_differs=row["linear_parts"]),
            dict(path="f32 (norm, no bf16 roundings)", tokens=row["tokens"], set_differs=row["f32_path"])]
    return write_probe(rows, markdown_table(rows, ["path", "tokens", "set_differs"]), args.out,
                       median_gap=row["median_gap"], linear_vs_f32=row["linear_vs_f32"],
                       command=f"python -m benchmarks.route_linear_probe --tokens {args.tokens} --seed {args.seed}")


if __name__ == "__main__":
    main()

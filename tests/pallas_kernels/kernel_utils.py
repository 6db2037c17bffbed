"""Helpers the kernel tests share: fast CPU compiles of interpret-mode kernels, GPU lowering checks, the
relative error of a result, the 8-bit decode kernel's softmax-slack cases and their check."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsjax.model.dispatch import compiler_options
from pallas_kernels.common import lower_for_h200  # noqa: F401 (the kernel tests import it from here)


def run_fast(fn, *args):
    """jit with dispatch.compiler_options (XLA -O1): interpret-mode kernels become large CPU programs
    that compile faster so."""
    return jax.jit(fn, compiler_options=compiler_options("interpret"))(*args)


def relative_error(got, want) -> float:
    """||got - want|| / ||want|| in f32, after checking that got is finite."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def check_max_slack(kind: str, interpret: bool):
    """mla_decode_8bit_mgpu with ``max_slack=8`` over ``slack_cases`` against the reference, with one split and
    with partials merged by combine_splits; in interpret mode also no data race."""
    from pallas_kernels import mgpu_interpret
    from pallas_kernels.mla_decode import combine_splits
    from pallas_kernels.mla_decode_8bit_mgpu import mla_decode_8bit_mgpu

    for name, args, want in slack_cases(kind):
        for splits in (1, 2):
            out = mla_decode_8bit_mgpu(*args, 0.1, num_splits=splits, max_slack=8.0, interpret=interpret)
            assert not (interpret and mgpu_interpret.races_found()), (name, splits)
            if splits > 1:
                m, l, acc = out
                out = combine_splits(m, l, acc.swapaxes(2, 3), jnp.float32, splits_axis=1,
                                     interpret=interpret).swapaxes(1, 2)
            assert relative_error(out.swapaxes(1, 2), want) < 1e-2, (name, splits)


def slack_cases(kind: str):
    """Inputs that exercise the 8-bit decode kernel's ``max_slack`` both ways, with the reference: (name, args
    of mla_decode_8bit_mgpu before its softmax scale, want [T, H, 512] f32). Every head's query is one vector
    u; two queries, contexts of 130 tokens over 3 shuffled 64-token pages and of 1 token. "jump": the last
    step's two keys lie along u, ~195 log2 units above the rest, so a step that kept the stale reference point
    would put 2^195 into P (inf in f32). "small": queries scaled down keep every later step within 8 units of
    the first step's max, so those steps keep its reference point."""
    from pallas_kernels.kv_quant import quantize_latent
    from pallas_kernels.mla_decode import mla_paged_reference

    rng = np.random.default_rng(33)
    c_kv = jnp.asarray(rng.standard_normal((8, 64, 512)), jnp.float32)
    k_pe = jnp.asarray(rng.standard_normal((8, 64, 64)), jnp.bfloat16)
    tables = jnp.asarray(rng.permutation(8)[:6].reshape(2, 3), jnp.int32)
    u = rng.standard_normal(512).astype(np.float32)
    q_pe = jnp.asarray(rng.standard_normal((2, 16, 64)), jnp.float32)
    seq_ids, lengths = jnp.arange(2, dtype=jnp.int32), jnp.asarray([130, 1], jnp.int32)
    jump = c_kv.at[tables[0, 2], :2].set(jnp.asarray(60.0 * u / np.linalg.norm(u)))
    for name, keys, q_scale in (("jump", jump, 1.0), ("small", c_kv, 0.02)):
        q_latent = jnp.asarray(np.broadcast_to(u * q_scale, (2, 16, 512)), jnp.bfloat16)
        q_rope = (q_pe * q_scale).astype(jnp.bfloat16)
        stored, scale = quantize_latent(keys, kind, 1)
        want = mla_paged_reference(q_latent.astype(jnp.float32), q_rope.astype(jnp.float32), stored,
                                   k_pe.astype(jnp.float32), tables, seq_ids, lengths - 1, 0.1, scale)
        yield name, (q_latent, q_rope, stored, k_pe, scale, tables, seq_ids, lengths), want

"""Helpers the kernel tests share: fast CPU compiles of interpret-mode kernels, GPU lowering checks, the
relative error of a result, ``flag_words``' round-trip kernel."""

from __future__ import annotations

import jax
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


def flag_words_round_trip():
    """A one-CTA Mosaic GPU kernel of ``flag_words`` alone: (x f32[128, 16], v f32[64]) -> f32[2, 64], x's two
    [64, 16] halves stored from the WGMMA layout and v from the wgmma rows' layout twice (v, 2 v) as words carrying
    flag 1, then read back by ``load_words``: x's column 5 a row a thread, plus 100 v[3] + 10000 (2 v[3]) (two
    single words as scalars). A grid of one names the scratch's scope as the grid's (without one, JAX 0.11 sizes
    the scratch as its largest array, not their sum)."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels import flag_words

    def body(x_ref, v_ref, out_ref):
        words = flag_words.words((128, 16))
        ml = flag_words.words((64, 2))
        halves = [plgpu.load(x_ref.at[pl.ds(64 * i, 64)], layout=plgpu.Layout.WGMMA, optimized=False)
                  for i in range(2)]
        v = plgpu.load(v_ref, layout=flag_words.ROW, optimized=False)
        flag_words.store([(halves[0], words.at[pl.ds(0, 64)]), (halves[1], words.at[pl.ds(64, 64)]),
                          (v, ml.at[:, 0]), (v * 2, ml.at[:, 1])], 1)
        column, m, l = flag_words.load_words([[words.at[:, 5], ml.at[3, pl.ds(0, 2)]]], 1, (2, 64))
        out_ref[...] = column + m * 100 + l * 10000

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((2, 64), jnp.float32), grid=(1,), grid_names=("c",))

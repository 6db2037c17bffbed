"""Logical axis names -> mesh axes: every parameter, the KV cache and the step's inputs get a
PartitionSpec from one table.

  heads, mlp, moe_mlp, vocab -> tensor   (attention heads, dense/shared MLP columns, each expert's
                                           columns, the embedding and lm_head rows/columns)
  expert                     -> expert   (routed experts)
  everything else            -> replicated (norms, the low-rank q/kv projections, the router)

The KV cache [L, num_blocks, block_size, dim] is split by blocks over ('data', 'expert'): each of
those ranks owns the blocks of its own sequences (data-parallel attention), and the tensor ranks of a
group hold the same latents, since MLA's cache has no head axis to split (docs/parallelism.md).
"""

from __future__ import annotations

import math

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dsjax.config import ConfigError
from dsjax.parallel.mesh import BATCH_AXES, EXPERT, TENSOR

RULES: dict[str | None, str | None] = {
    "layers": None, "vocab": TENSOR, "embed": None, "heads": TENSOR, "q_lora": None, "kv_lora": None,
    "qk_head": None, "v_head": None, "mlp": TENSOR, "expert": EXPERT, "moe_mlp": TENSOR, None: None,
}

CACHE_SPEC = P(None, BATCH_AXES, None, None)  # [L, num_blocks, block_size, dim]


def checks_vma(kernel_backend: str) -> bool:
    """shard_map's varying-axes type check (it catches a missing collective at trace time) needs
    every op typed; Pallas calls are not, so the check runs with the reference ops only (CPU tests)."""
    return kernel_backend == "reference"


def batch_spec(ndim: int = 1) -> P:
    """Leading axis split over the data-parallel attention ranks (tokens, sequence rows)."""
    return P(BATCH_AXES, *([None] * (ndim - 1)))


def logical_to_spec(axes: tuple[str | None, ...]) -> P:
    unknown = [a for a in axes if a not in RULES]
    if unknown:
        raise ValueError(f"logical axis names {unknown} have no sharding rule; known: "
                         f"{', '.join(str(a) for a in RULES)}")
    return P(*(RULES[a] for a in axes))


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def logical_axes(variable: nnx.Variable) -> tuple[str | None, ...]:
    """The names dsjax.model.params.param stores in the variable's ``out_sharding`` metadata."""
    return tuple(variable.get_metadata().get("out_sharding") or ())


def param_specs(state):
    """A PartitionSpec for every variable of an nnx state (a prefix tree of the state)."""
    return jax.tree.map(lambda v: logical_to_spec(logical_axes(v)), state, is_leaf=_is_variable)


def param_shardings(state, mesh: Mesh):
    """NamedShardings for an nnx state on ``mesh``; refuses a dimension the mesh cannot split evenly."""
    def one(path, variable):
        spec = logical_to_spec(logical_axes(variable))
        check_divisible(jax.tree_util.keystr(path, simple=True, separator="."), variable.shape, spec, mesh)
        return NamedSharding(mesh, spec)

    return jax.tree.map_with_path(one, state, is_leaf=_is_variable)


def check_divisible(name: str, shape: tuple[int, ...], spec: P, mesh: Mesh) -> None:
    for dim, (size, axes) in enumerate(zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)))):
        if axes is None:
            continue
        axes = axes if isinstance(axes, tuple) else (axes,)
        ways = math.prod(mesh.shape[a] for a in axes)
        if size % ways:
            sizes = ", ".join(f"{a}={mesh.shape[a]}" for a in axes)
            raise ConfigError(f"parameter {name} dimension {dim} has {size} entries, which {sizes} cannot "
                              f"split evenly; accepted: a parallel size that divides {size}")

"""The device mesh: ('data', 'expert', 'tensor') over the devices of every process.

tensor is the innermost axis (neighbouring device ids, the fastest links): it carries two all-reduces
per layer. expert carries the MoE token exchange; data only splits the batch.
"""

from __future__ import annotations

import logging
import os

import jax
from jax.sharding import AxisType, Mesh

from dsjax.config import ConfigError, ParallelConfig

try:  # JAX has no public way to ask whether its backend has started (and read XLA_FLAGS)
    from jax._src.xla_bridge import backends_are_initialized
except ImportError:  # a later JAX: assume not; a flag added too late then has no effect, silently
    def backends_are_initialized() -> bool:
        return False

log = logging.getLogger(__name__)

DATA, EXPERT, TENSOR = "data", "expert", "tensor"
AXES = (DATA, EXPERT, TENSOR)
BATCH_AXES = (DATA, EXPERT)  # sequences, their tokens and their KV blocks are split over these


# NCCL collectives recorded into XLA's command buffers (CUDA graphs) with the kernels around them. On
# two H200s (benchmarks/results/parallel_h200x2.json, EP=2 batch 256, the -cbc runs against ep2-nocb)
# the device step is 4-6% shorter and the host queues ahead again: engine steps of 10.0-10.9 ms for a
# 10.0 ms device step, against 16-23 ms for 10.6-11.1 without. XLA:CPU accepts and ignores the option.
MESH_XLA_FLAGS = ("--xla_gpu_enable_command_buffer=+COLLECTIVES",)


def prepare_process(parallel: ParallelConfig) -> None:
    """Before anything touches a device: MESH_XLA_FLAGS for a mesh (unless XLA_FLAGS already sets
    them, or the backend has started and read its flags), then jax.distributed for several processes."""
    if parallel.num_devices > 1:
        _add_xla_flags(MESH_XLA_FLAGS)
    initialize_distributed(parallel)


def _add_xla_flags(flags: tuple[str, ...]) -> None:
    current = os.environ.get("XLA_FLAGS", "")
    missing = [f for f in flags if f.split("=")[0] not in current]
    if not missing:
        return
    if backends_are_initialized():
        if jax.default_backend() == "gpu":
            log.warning("the XLA backend has already started: %s not applied (set XLA_FLAGS before the "
                        "first device use to apply them)", " ".join(missing))
        return
    os.environ["XLA_FLAGS"] = " ".join([current, *missing]).strip()


def initialize_distributed(parallel: ParallelConfig) -> None:
    """jax.distributed.initialize for a multi-process run; call before anything touches a device."""
    if parallel.num_processes == 1 or jax.distributed.is_initialized():
        return
    log.warning("jax.distributed: process %d of %d, coordinator %s", parallel.process_id,
                parallel.num_processes, parallel.coordinator_address)
    jax.distributed.initialize(coordinator_address=parallel.coordinator_address,
                               num_processes=parallel.num_processes, process_id=parallel.process_id)


def make_mesh(parallel: ParallelConfig, devices=None) -> Mesh | None:
    """The mesh for ``parallel`` over the first num_devices of ``devices`` (default: every process's
    devices); None for a single device, which then runs without shard_map."""
    if parallel.num_devices == 1:
        return None
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < parallel.num_devices:
        raise ConfigError(
            f"data_parallel_size={parallel.data_parallel_size} x expert_parallel_size="
            f"{parallel.expert_parallel_size} x tensor_parallel_size={parallel.tensor_parallel_size} needs "
            f"{parallel.num_devices} devices; {len(devices)} are visible (accepted: a product <= {len(devices)})")
    shape = (parallel.data_parallel_size, parallel.expert_parallel_size, parallel.tensor_parallel_size)
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES),
                         devices=devices[:parallel.num_devices])


def check_mesh(mesh: Mesh) -> Mesh:
    if tuple(mesh.axis_names) != AXES:
        raise ConfigError(f"mesh axes {tuple(mesh.axis_names)} are not supported; accepted: {AXES} "
                          "(dsjax.parallel.make_mesh builds one)")
    return mesh


def parallel_config_of(mesh: Mesh | None, base: ParallelConfig | None = None) -> ParallelConfig:
    """The ParallelConfig whose sizes are the mesh's (other fields from ``base``)."""
    base = base or ParallelConfig()
    if mesh is None:
        return base
    sizes = dict(check_mesh(mesh).shape)
    return base.replace(data_parallel_size=sizes[DATA], expert_parallel_size=sizes[EXPERT],
                        tensor_parallel_size=sizes[TENSOR])


def num_batch_shards(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape[DATA] * mesh.shape[EXPERT]

"""Meshes, sharding rules and expert-parallel dispatch (docs/parallelism.md)."""

from dsjax.parallel.mesh import (AXES, BATCH_AXES, DATA, EXPERT, TENSOR, check_mesh, initialize_distributed,
                                 make_mesh, num_batch_shards, parallel_config_of, prepare_process)

__all__ = ["AXES", "BATCH_AXES", "DATA", "EXPERT", "TENSOR", "check_mesh", "initialize_distributed", "make_mesh",
           "num_batch_shards", "parallel_config_of", "prepare_process"]

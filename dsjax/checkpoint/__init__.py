from dsjax.checkpoint.export import save_hf
from dsjax.checkpoint.hf import load_hf_checkpoint
from dsjax.checkpoint.orbax_io import load_orbax, save_orbax
from dsjax.checkpoint.safetensors_io import CheckpointError

__all__ = ["CheckpointError", "load_hf_checkpoint", "load_orbax", "save_hf", "save_orbax"]

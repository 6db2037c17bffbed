"""Pallas GPU kernels for dsjax. Each module holds a kernel beside its pure-jnp ``*_reference``."""

"""``python -m dsjax.bench``: the end-to-end benchmark scenarios of benchmarks/e2e.py (run from the checkout)."""

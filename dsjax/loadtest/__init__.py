"""Load testing a dsjax server (or any OpenAI-compatible one on loopback): ``python -m dsjax.loadtest``."""

"""OpenAI-compatible HTTP serving: ``python -m dsjax.serve`` (see dsjax/serve/config.py for the settings)."""

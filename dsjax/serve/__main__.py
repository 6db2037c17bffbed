"""``python -m dsjax.serve [--config configs/serve/NAME.yaml] [--model default] [--port 8000] ...``"""

from __future__ import annotations

import os
import sys

from dsjax.config import ConfigError
from dsjax.serve.config import config_from_args
from dsjax.serve.server import run_server


def main(argv: list[str] | None = None) -> None:
    try:
        config = config_from_args(argv, env=dict(os.environ))
    except ConfigError as e:
        sys.exit(f"error: {e}")
    run_server(config)


if __name__ == "__main__":
    main()

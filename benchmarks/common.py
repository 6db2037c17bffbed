"""Shared pieces of the benchmark scripts: environment header and result files."""

from __future__ import annotations

import datetime
import json
import platform
from pathlib import Path

import jax

RESULTS = Path(__file__).resolve().parent / "results"


def environment() -> dict:
    device = jax.devices()[0]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device.device_kind,
        "platform": device.platform,
        "num_devices": jax.device_count(),
        "jax": jax.__version__,
        "python": platform.python_version(),
    }


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def write_result(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path

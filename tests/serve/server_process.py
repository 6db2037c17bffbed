"""A real server in a subprocess (uvicorn on 127.0.0.1, a free port, the tiny preset on a small engine).

Every server here uses configs/serve/tiny-cpu.yaml's engine shape, so after the first run its step
programs come from the persistent compile cache and a server is up in ~10 s.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVE_CONFIG = REPO / "configs" / "serve" / "tiny-cpu.yaml"
STARTUP_TIMEOUT_S = 240  # a cold compile cache on 2 cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *flags: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="dsjax-serve-", suffix=".log", delete=False)
        environ = os.environ | {
            "JAX_PLATFORMS": "cpu",
            "JAX_COMPILATION_CACHE_DIR": str(REPO / ".jax_cache"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        } | (env or {})
        cmd = [sys.executable, "-m", "dsjax.serve", "--config", str(SERVE_CONFIG), "--port", str(self.port),
               "--log-level", "warning", *flags]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=environ, stdout=self.log, stderr=subprocess.STDOUT)

    def log_tail(self, num_chars: int = 4000) -> str:
        return Path(self.log.name).read_text()[-num_chars:]

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log_tail()}")

    def get_json(self, path: str, api_key: str | None = None) -> dict:
        request = urllib.request.Request(self.url + path)
        if api_key:
            request.add_header("Authorization", f"Bearer {api_key}")
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def wait_idle(self, api_key: str | None = None, timeout: float = 30) -> dict:
        """Engine stats once nothing is running, waiting or in flight."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.get_json("/debug/stats", api_key)
            if stats["num_running"] == stats["num_waiting"] == stats["num_in_flight"] == 0:
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"server still busy after {timeout}s: {stats}")
            time.sleep(0.1)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # drains; an idle server exits at once
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


@contextlib.contextmanager
def running_server(*flags: str, env: dict[str, str] | None = None):
    server = ServerProcess(*flags, env=env)
    try:
        yield server.wait_ready()
    except BaseException:
        print(server.log_tail(), file=sys.stderr)
        raise
    finally:
        server.stop()

"""Orbax checkpoints of the whole training state (params, optimizer state, step, rng, best params),
under ``<work_dir>/checkpoints/<step>/``, with the run's identity in ``run.json`` so that a resume
refuses a checkpoint of another model or corpus."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from dsjax.config import ConfigError

RUN_FILE = "run.json"


class CheckpointStore:
    def __init__(self, directory: str | Path, run_identity: dict, max_to_keep: int = 3):
        self.directory = Path(directory).resolve()
        self.run_identity = run_identity
        self.max_to_keep = max_to_keep
        self._manager = None

    @property
    def manager(self) -> ocp.CheckpointManager:
        if self._manager is None:
            # Synchronous saves: the next step donates the state's buffers.
            options = ocp.CheckpointManagerOptions(max_to_keep=self.max_to_keep, create=True,
                                                   enable_async_checkpointing=False)
            self._manager = ocp.CheckpointManager(self.directory, options=options)
        return self._manager

    def latest_step(self) -> int | None:
        if not self.directory.is_dir():
            return None
        return self.manager.latest_step()

    def clear(self) -> None:
        self.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    def save(self, step: int, state) -> None:
        run_file = self.directory / RUN_FILE
        self.manager.save(step, args=ocp.args.StandardSave(state), force=True)
        run_file.write_text(json.dumps(self.run_identity, indent=2, sort_keys=True))

    def restore(self, like_state):
        """The latest checkpoint, read into the structure, shapes and dtypes of ``like_state``."""
        saved = json.loads((self.directory / RUN_FILE).read_text()) if (self.directory / RUN_FILE).is_file() else {}
        for key, value in self.run_identity.items():
            if saved.get(key) != value:
                raise ConfigError(f"cannot resume from {self.directory}: its {key} differs from this run's "
                                  f"({saved.get(key)!r} vs {value!r}); drop --resume to start over")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like_state)
        step = self.manager.latest_step()
        return self.manager.restore(step, args=ocp.args.StandardRestore(abstract))

    def close(self) -> None:
        if self._manager is not None:
            self._manager.close()
            self._manager = None

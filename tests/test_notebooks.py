"""The numbered notebooks run top to bottom on CPU (nbclient, kernel "python3", cwd notebooks/)."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOK_NAMES = sorted(p.name for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def test_every_numbered_notebook_is_collected():
    assert NOTEBOOK_NAMES == ["01_model_tour.ipynb", "02_kernels.ipynb", "03_sharding.ipynb", "04_train_tiny.ipynb"]


@pytest.mark.parametrize("name", NOTEBOOK_NAMES)
def test_notebook_runs(name, monkeypatch):
    # The kernel shares the tests' persistent compilation cache (tests/conftest.py): the notebooks
    # build engines and models the tests also compile.
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", jax.config.jax_compilation_cache_dir)
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                       str(jax.config.jax_persistent_cache_min_compile_time_secs))
    book = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(book, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()  # raises CellExecutionError, with the failing cell and traceback, on any error
    errors = [o for cell in book.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors

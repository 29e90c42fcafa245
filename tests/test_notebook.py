"""The walk-through notebook is executed, so it cannot rot; it is stored with its outputs, the tree picture inline."""

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "walkthrough.ipynb"


def test_walkthrough_notebook_runs():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    ).execute()
    outputs = "".join(o.get("text", "") for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "median speedup" in outputs and "accepted nodes" in outputs
    assert _images(notebook), "the tree picture is not shown inline (a non-interactive matplotlib backend?)"


def _images(notebook) -> int:
    return sum(
        "image/png" in o.get("data", {}) for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )


def test_walkthrough_is_stored_with_its_outputs():
    nbformat = pytest.importorskip("nbformat")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    assert all(c.get("outputs") for c in notebook.cells if c.cell_type == "code"), (
        "store the notebook executed: jupyter nbconvert --to notebook --execute --inplace notebooks/walkthrough.ipynb"
    )
    assert _images(notebook) == 1

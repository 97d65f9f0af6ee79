"""The notebooks in ``notebooks/``: committed without outputs, and each runs top to bottom in a
clean Jupyter kernel (a failing cell fails the test), drawing its figures into the folder
named by ``DSS_NOTEBOOK_FIGURES``, where they must be valid PNG images.

Each notebook is executed by nbclient in a fresh ``python3`` kernel of this environment, in
the ``notebooks/`` folder, as a person running it in Jupyter would.
"""

from __future__ import annotations

import struct
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
FIGURES = {
    "01-tour.ipynb": [],
    "02-vllm-speedup.ipynb": ["02-ttft.png"],
    "03-versions.ipynb": ["03-version-tree.png", "03-storage.png"],
    "04-tiers.ipynb": ["04-host-share.png", "04-tiers-stacked.png"],
    "05-forget-user.ipynb": ["05-pages-per-user.png"],
}
"""The figures each notebook saves."""
PNG = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """Width and height of a PNG file, read from its header (``AssertionError`` if it is no PNG)."""
    data = path.read_bytes()
    assert data[:8] == PNG and data[12:16] == b"IHDR", f"{path.name} is not a PNG image"
    assert data[-12:] == b"\x00\x00\x00\x00IEND\xaeB`\x82", f"{path.name} is cut short"
    return struct.unpack(">II", data[16:24])


def test_every_notebook_is_listed_with_its_figures() -> None:
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(FIGURES)


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_notebook_is_committed_without_outputs(name: str) -> None:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    dirty = [
        i
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)
    ]
    assert dirty == [], f"{name}: cells {dirty} have outputs; clear them before committing"
    assert nb.cells[0].cell_type == "markdown" and "**Needs:** `pip install -e .[notebooks" in nb.cells[0].source


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_notebook_runs_in_a_clean_kernel_and_saves_its_figures(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DSS_NOTEBOOK_FIGURES", str(tmp_path))
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    start = time.monotonic()
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    print(f"{name}: {time.monotonic() - start:.1f} s")
    errors = [
        out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs if out.output_type == "error"
    ]
    assert errors == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(FIGURES[name])
    for figure in FIGURES[name]:
        width, height = png_size(tmp_path / figure)
        assert width >= 400 and height >= 200, (figure, width, height)

"""docs/example.ipynb runs offline on the tiny pipeline with mixed routes; ``Report.plot()`` draws."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "docs" / "example.ipynb"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("DDO_CACHE_DIR", str(ROOT / ".ddo_cache"))
    monkeypatch.setenv("MPLBACKEND", "Agg")


def test_notebook_executes_with_nbclient(monkeypatch):
    monkeypatch.delenv("DDO_CACHE_DIR")  # as a user runs it: the notebook chooses where the tiny model goes
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "docs")}}).execute()
    html = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if "text/html" in o.get("data", {})]
    assert html, "the report cell should render as HTML"
    assert not (ROOT / "docs" / ".ddo_cache").exists(), "the notebook left a model cache next to itself"


def test_notebook_uses_only_public_names():
    code = "".join("".join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"] if c["cell_type"] == "code")
    assert "blocks.runner" not in code and "._" not in code


def test_notebook_code_runs_in_process():
    """The same cells, run in one namespace (for machines without a Jupyter kernel)."""
    import matplotlib

    matplotlib.use("Agg")
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    code = [("".join(c["source"])) for c in cells if c["cell_type"] == "code"]
    assert len(code) >= 4
    ns: dict = {}
    for i, src in enumerate(code):
        exec(compile(src, f"{NOTEBOOK.name}[{i}]", "exec"), ns)
    report = ns["reports"]["denoise"]["transformer"]
    assert "<table>" in report._repr_html_()
    fig = ns["fig"]
    assert len(fig.axes) == 2
    assert fig.axes[0].collections, "the linear route's report has a per-call timeline"
    import matplotlib.pyplot as plt

    plt.close("all")


def test_plot_without_a_timeline():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    import ddo_blocks
    from ddo_blocks.tiny import tiny_autoencoder_kl

    vae = tiny_autoencoder_kl()
    with ddo_blocks.offload(vae, route="resident", device="cpu") as handle:
        with torch.no_grad():
            vae.decode(torch.zeros(1, 4, 4, 4))
        fig = handle.report().plot()
    assert [a.get_title() for a in fig.axes][1] == "memory"
    plt.close(fig)

"""benchmarks.pipeline on the tiny components (CPU): the classic pipeline through offload_pipeline,
identical to the resident one, written as JSON and Markdown."""

from __future__ import annotations

import json


def test_pipeline_benchmark_runs_on_the_tiny_components(tmp_path):
    from benchmarks.pipeline import main

    rc = main(["--tiny", "--device", "cpu", "--vram-budget", "600KiB", "--steps", "2", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "pipeline.json").read_text())
    assert rc == 0 and [r["exact"] for r in doc["rows"]] == [True, True]
    off = doc["rows"][1]
    assert off["planned_gpu_bytes"] <= off["vram_budget"] == 600 * 1024
    assert off["policies"]["transformer"].startswith("linear")
    assert "| offload_pipeline |" in (tmp_path / "pipeline.md").read_text()


def test_sdnq_benchmark_runs_on_the_tiny_transformer(tmp_path):
    import pytest

    pytest.importorskip("sdnq")
    from benchmarks.sdnq import main

    rc = main(["--tiny", "--device", "cpu", "--budgets", "100KiB", "--formats", "bf16,int8", "--repeats", "1",
               "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "sdnq.json").read_text())
    assert rc == 0 and all(r["exact"] for r in doc["rows"])
    streamed = {r["format"]: r for r in doc["rows"] if r["budget"]}
    assert streamed["int8"]["route"] == "sdnq" and streamed["bf16"]["route"] == "linear"
    assert streamed["int8"]["weight_bytes"] < streamed["bf16"]["weight_bytes"]

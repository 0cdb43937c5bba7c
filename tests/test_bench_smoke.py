"""The benchmark harness end to end on the CPU with the tiny model: ``python -m benchmarks.run
--device cpu --tiny`` writes results.json, results.md and results.png, every row has the fields the
tables use, each row ran in its own process, and a run merges with ``python -m benchmarks.merge``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

ROW_KEYS = {
    "route",
    "preset",
    "budget",
    "status",
    "step_s",
    "roofline_s",
    "ratio",
    "gpu_peak_allocated",
    "gpu_peak_reserved",
    "host_peak_rss",
    "pinned_bytes",
    "setup_s",
    "first_call_s",
    "predicted_step_s",
    "streamed_bytes",
    "speedup_vs_diffusers_block",
    "speedup_vs_ddo_rc2",
}


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bench") / "run"
    _run(["-m", "benchmarks.run", "--device", "cpu", "--tiny", "--out", str(out)])
    return out


def test_outputs_exist(tiny_run: Path):
    for name in ("results.json", "results.md", "results.png"):
        assert (tiny_run / name).stat().st_size > 0, name
    assert (tiny_run / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tiny_run / "results.md").read_text()
    assert "| route | preset | budget | step s |" in md
    assert "all weights resident" in md and "ddo_blocks linear one_shot_fast" in md


def test_rows_have_the_fields(tiny_run: Path):
    doc = json.loads((tiny_run / "results.json").read_text())
    for key in ("gpu_name", "driver", "torch", "diffusers", "cpu_count", "ram_bytes"):
        assert key in doc["machine"], key
    assert doc["created"] and doc["command"].startswith("python -m benchmarks.run")
    bw = doc["bandwidth"]
    assert bw["pinned_h2d_gb_s"] > 0 and set(bw["host_copy_gb_s"]) == {"1", "4", "8", "16"}
    rows = doc["rows"]
    for r in rows:
        assert set(r) >= ROW_KEYS, (r.get("id"), ROW_KEYS - set(r))
    ok = {(r["route"], r["preset"] or r["offload_type"], r["budget"]) for r in rows if r["status"] == "ok"}
    for preset in ("one_shot_fast", "low_ram_safe", "warm_process"):
        assert ("ours", preset, "min") in ok, preset
    assert ("resident", None, None) in ok
    # the staged preset's row is read against both bounds: its own and the pinned link's
    assert "x of the pinned-link roofline" in (tiny_run / "results.md").read_text()
    assert ("diffusers", "block_level", None) in ok and ("diffusers", "leaf_level", None) in ok
    # DDO rc2 is CUDA-only: its rows are skipped with a note, not errors
    ddo = [r for r in rows if r["route"] == "ddo"]
    assert ddo and all(r["status"] == "skipped" and r["note"] for r in ddo)
    assert not [r for r in rows if r["status"] == "error"], [
        r.get("error") for r in rows if r["status"] == "error"
    ]
    # one process per row
    pids = [r["pid"] for r in rows if r["status"] == "ok"]
    assert len(set(pids)) == len(pids) and os.getpid() not in pids
    for r in rows:
        if r["status"] == "ok":
            assert r["step_s"] > 0 and r["roofline_s"] > 0 and r["ratio"] > 0
            assert r["host_peak_rss"] > 0 and r["setup_s"] >= 0 and r["first_call_s"] > 0
            if r["route"] == "ours":
                assert r["predicted_step_s"] is not None and r["pinned_bytes"] == 0  # no pinning on the CPU
                assert r["streamed_bytes"] > 0
    warm = [r for r in rows if r["preset"] == "warm_process" and r["status"] == "ok"]
    assert warm and all(r["warm_reused"] for r in warm)
    assert doc["comparisons"]


def test_merge(tiny_run: Path, tmp_path: Path):
    out = tmp_path / "merged"
    _run(["-m", "benchmarks.merge", str(tiny_run), str(tiny_run), "--out", str(out), "--no-plot"])
    merged = json.loads((out / "results.json").read_text())
    first = json.loads((tiny_run / "results.json").read_text())
    assert len(merged["rows"]) == len(first["rows"])
    assert (out / "results.md").exists()


def test_merge_keeps_measured_rows_and_each_run_s_bandwidth(tiny_run: Path):
    from benchmarks import results as R

    first = json.loads((tiny_run / "results.json").read_text())
    later = json.loads(json.dumps(first))
    later["bandwidth"]["pinned_h2d_gb_s"] = first["bandwidth"]["pinned_h2d_gb_s"] * 2
    ours = next(i for i, r in enumerate(later["rows"]) if r["route"] == "ours")
    later["rows"][ours] = {**later["rows"][ours], "status": "failed", "step_s": None}
    for r in later["rows"]:  # a negligible compute bound, so that the link term decides every roofline
        if r["route"] == "resident":
            r["step_s"] = 1e-12
    doc = R.derive(R.merge([first, later], ["a", "b"]))
    rows = {R.row_key(r): r for r in doc["rows"]}
    kept = rows[R.row_key(first["rows"][ours])]
    assert kept["source_run"] == "a" and kept["step_s"] == first["rows"][ours]["step_s"]  # measured row kept
    replaced = next(r for r in doc["rows"] if r["source_run"] == "b" and r.get("streamed_bytes"))
    # each row's roofline uses its own run's link: the later run's doubled link halves its transfer term
    link_b = later["bandwidth"]["pinned_h2d_gb_s"] * 1e9
    assert replaced["roofline_pinned_s"] == pytest.approx(
        max(doc["derived"]["compute_s"], replaced["streamed_bytes"] / link_b), rel=1e-12)
    # ... and the kept row of the first run still uses the first run's link
    link_a = first["bandwidth"]["pinned_h2d_gb_s"] * 1e9
    assert kept["roofline_pinned_s"] == pytest.approx(
        max(doc["derived"]["compute_s"], kept["streamed_bytes"] / link_a), rel=1e-12)
    assert kept["roofline_pinned_s"] != pytest.approx(kept["streamed_bytes"] / link_b, rel=1e-3)
    assert kept["streamed_bytes"] / link_a > doc["derived"]["compute_s"]


@pytest.mark.slow
def test_spawn_isolation(tmp_path: Path):
    """The fallback where forking is unsafe: every row (and the builder) a fresh interpreter."""
    out = tmp_path / "spawn"
    _run(
        [
            "-m",
            "benchmarks.run",
            "--device",
            "cpu",
            "--tiny",
            "--isolation",
            "spawn",
            "--routes",
            "resident",
            "--no-plot",
            "--no-bandwidth",
            "--repeats",
            "2",
            "--out",
            str(out),
        ]
    )
    doc = json.loads((out / "results.json").read_text())
    (row,) = doc["rows"]
    assert row["status"] == "ok" and row["isolation"] == "spawn" and row["step_s"] > 0


def test_loading_and_nvme_benchmarks_run_on_the_cpu(tmp_path):
    """The two disk benchmarks (run on the GPU machine for real) end to end on the tiny model."""
    import json
    import subprocess
    import sys

    model_dir = tmp_path / "model"
    load_out = tmp_path / "loading"
    subprocess.run([sys.executable, "-m", "benchmarks.loading", "--device", "cpu", "--tiny", "--dir", str(model_dir),
                    "--out", str(load_out)], check=True, capture_output=True, text=True)
    doc = json.loads((load_out / "loading.json").read_text())
    assert doc["load"]["exact"] and doc["read"]["seq_read_bytes"] > 0 and doc["ratio_ready_to_seq_read"] > 0
    nvme_out = tmp_path / "nvme"
    subprocess.run([sys.executable, "-m", "benchmarks.nvme", "--device", "cpu", "--tiny", "--dir", str(model_dir),
                    "--vram-budgets", "0.5x", "--ram-budgets", "0", "--repeats", "2", "--no-diffusers",
                    "--out", str(nvme_out)], check=True, capture_output=True, text=True)
    rows = json.loads((nvme_out / "nvme.json").read_text())["rows"]
    assert len(rows) == 1 and rows[0]["exact"] is True and rows[0]["step_s"] > 0
    assert (nvme_out / "nvme.md").is_file()


def test_profile_analysis_splits_idle_time():
    """Compute kernels at 0-10 and 20-30 us, one copy at 5-25 us, a call window of 0-40 us: compute
    is busy 20, the link 20; compute idles 10 while the copy runs and 10 with both idle."""
    from benchmarks.profile import analyse

    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "ts": 0, "dur": 10},
        {"ph": "X", "cat": "kernel", "ts": 20, "dur": 10},
        {"ph": "X", "cat": "gpu_memcpy", "ts": 5, "dur": 20},
        {"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 40},
    ]}
    (row,) = analyse(trace, [(0.0, 40.0)])
    assert row["span_s"] == pytest.approx(40e-6, abs=1e-12)
    assert row["compute_busy_s"] == pytest.approx(20e-6, abs=1e-12)
    assert row["link_busy_s"] == pytest.approx(20e-6, abs=1e-12)
    assert row["compute_idle_link_busy_s"] == pytest.approx(10e-6, abs=1e-12)
    assert row["idle_both_s"] == pytest.approx(10e-6, abs=1e-12)


@pytest.mark.parametrize("kernel", ["ddo_decode12", "ddo_decode_tiered", "ddo_decode_huffman"])
def test_profile_puts_either_decode_kernel_in_its_own_lane(kernel):
    from benchmarks.profile import analyse

    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "ts": 0, "dur": 10, "name": "gemm"},
        {"ph": "X", "cat": "kernel", "ts": 10, "dur": 5, "name": kernel},
        {"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 20},
    ]}
    (row,) = analyse(trace, [(0.0, 20.0)])
    assert row["compute_busy_s"] == pytest.approx(10e-6, abs=1e-12)
    assert row["decode_busy_s"] == pytest.approx(5e-6, abs=1e-12)


def test_profile_splits_the_copies_by_the_compute_beside_them_and_keeps_the_lanes(tmp_path):
    """Two 2 MiB copies of 100 us, one under a kernel for 80 us, one alone (a 512 KiB copy is left out):
    their rates are reported apart, and the lanes file keeps every GPU event and the call."""
    import gzip
    import json

    from benchmarks.profile import analyse, write_lanes

    mib2 = 2 << 20
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "ts": 0, "dur": 80, "name": "gemm", "args": {"stream": 7}},
        {"ph": "X", "cat": "gpu_memcpy", "ts": 0, "dur": 100, "name": "Memcpy HtoD", "args": {"bytes": mib2}},
        {"ph": "X", "cat": "gpu_memcpy", "ts": 200, "dur": 50, "name": "Memcpy HtoD", "args": {"bytes": mib2}},
        {"ph": "X", "cat": "gpu_memcpy", "ts": 300, "dur": 10, "name": "Memcpy HtoD", "args": {"bytes": 1 << 19}},
        {"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 400, "name": "ddo_call"},
    ]}
    (row,) = analyse(trace, [(0.0, 400.0)])
    beside = row["copies_by_compute_beside"]
    assert beside["compute_over_half"]["count"] == beside["compute_under_half"]["count"] == 1
    assert beside["compute_over_half"]["gb_per_s"] == pytest.approx(mib2 / 100e-6 / 1e9)
    assert beside["compute_under_half"]["gb_per_s"] == pytest.approx(mib2 / 50e-6 / 1e9)
    write_lanes(trace, tmp_path / "lanes.json.gz")
    with gzip.open(tmp_path / "lanes.json.gz", "rt") as f:
        lanes = json.load(f)
    assert [r[0] for r in lanes] == ["k", "mem", "mem", "mem", "call"]
    assert lanes[1][5] == mib2 and lanes[0][4] == 7


def test_read_pipeline_benchmark_runs_on_the_cpu(tmp_path):
    out = tmp_path / "readpipe"
    subprocess.run([sys.executable, "-m", "benchmarks.readpipe", "--dir", str(tmp_path / "scratch"), "--file-gib",
                    "0.05", "--unit-mib", "4", "--repeats", "1", "--out", str(out)], check=True, capture_output=True,
                   text=True)
    doc = json.loads((out / "readpipe.json").read_text())
    (row,) = doc["rows"]
    assert row["units"] == 11  # 51.2 MiB cut into 4 MiB units, the last one left out
    assert row["pipeline_gb_s"] > 0 and row["probe_gb_s"] > 0


def test_nvme_cgroup_stats_read_v2_and_v1_files(tmp_path):
    from benchmarks.nvme import cgroup_stats

    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.events").write_text("low 0\nhigh 0\nmax 515006\noom 1\noom_kill 1\n")
    (v2 / "memory.peak").write_text("4294967296\n")
    assert cgroup_stats(v2) == {"max": 515006, "oom_kill": 1, "peak_bytes": 4294967296}
    v1 = tmp_path / "v1"
    v1.mkdir()
    (v1 / "memory.max_usage_in_bytes").write_text("373018624\n")
    (v1 / "memory.failcnt").write_text("3\n")
    (v1 / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    assert cgroup_stats(v1) == {"max": 3, "oom_kill": 2, "peak_bytes": 373018624}
    assert cgroup_stats(tmp_path / "missing") == {}


def test_auto_budget_benchmark_runs_on_the_cpu(tmp_path):
    _run(["-m", "benchmarks.auto_budget", "--device", "cpu", "--tiny", "--resolutions", "128", "--repeats", "1",
          "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "auto_budget.json").read_text())
    (row,) = doc["rows"]
    assert row["status"] == "ok" and row["exact"] and row["first_budget_bytes"] > 0
    # the CPU engine's "free memory" is the host's: the tiny model fits whole at the first budget
    assert "nothing streams" in row["reason"]


def test_host_contention_probe_says_it_needs_cuda_without_one(capsys):
    import torch

    from benchmarks import host_contention

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run the probe itself (docs/gpu.md)")
    assert host_contention.main(["--gib", "0.01"]) == 2
    assert "needs CUDA" in capsys.readouterr().err


def test_graph_host_benchmark_runs_on_the_cpu(tmp_path):
    from benchmarks import graph_host

    assert graph_host.main(["--device", "cpu", "--calls", "2", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "graph_host.json").read_text())
    assert doc["modules"] == 1279 and doc["plan"]["units"] == 57  # Flux-dev's structure
    assert doc["host_call_s"] > 0 and doc["graph"]["status"].startswith("off: CUDA graphs need a CUDA device")
    assert "function calls" in (tmp_path / "graph_host.txt").read_text()


def test_codec_sweep_runs_its_rows_on_the_cpu(tmp_path):
    from benchmarks import codec_sweep

    rows = "min:off,min:fixed:4,min:tiered:0:replan,min@2048:lossless"
    assert codec_sweep.main(["--device", "cpu", "--rows", rows, "--repeats", "1", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "codec_sweep.json").read_text())
    got = {(r["codec"], r["ring"], r["replan"]): r for r in doc["rows"]}
    assert set(got) == {("off", "default", False), ("fixed", 4, False), ("tiered", "default", True),
                        ("lossless", "default", False)}
    lossless = got[("lossless", "default", False)]
    # another input size, its own resident run; on the CPU lossless codes nothing
    assert lossless["resolution"] == 2048 and set(doc["resident_step_s_by_resolution"]) == {"1024", "2048"}
    assert lossless["chosen"] == "off" and lossless["lossless"]["chosen_with"] == "the planner's prior"
    assert all("error" not in r and r["exact"] for r in doc["rows"]), doc["rows"]
    off = got[("off", "default", False)]
    for key in (("fixed", 4, False), ("tiered", "default", True)):  # the codecs send fewer bytes
        assert got[key]["link_bytes"] < off["link_bytes"] == off["streamed_bytes"]
    assert got[("tiered", "default", True)]["replanned"] in (True, False)
    assert "| min | fixed | 4 (" in (tmp_path / "codec_sweep.md").read_text()
    png = tmp_path / "codec_sweep.png"
    assert png.read_bytes()[:4] == b"\x89PNG"
    png.unlink()  # --replot draws it again from the JSON alone
    assert codec_sweep.main(["--replot", str(tmp_path / "codec_sweep.json")]) == 0 and png.exists()


def test_staging_sweep_says_it_needs_cuda_without_one(capsys):
    import torch

    from benchmarks import staging

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run the sweep itself (docs/gpu.md)")
    assert staging.main(["--buffers", "2"]) == 2
    assert "needs CUDA" in capsys.readouterr().err


def test_a_replan_row_replans_before_its_timing(tmp_path: Path):
    out = tmp_path / "replan"
    _run(["-m", "benchmarks.run", "--device", "cpu", "--tiny", "--routes", "ours:one_shot_fast+tiered+replan",
          "--budgets", "min", "--no-plot", "--no-bandwidth", "--repeats", "2", "--out", str(out)])
    doc = json.loads((out / "results.json").read_text())
    (row,) = doc["rows"]
    assert row["status"] == "ok" and row["id"] == "ours-one_shot_fast_tiered_replan-min", row
    assert isinstance(row["replanned"], bool) and row["replan_s"] >= 0 and row["step_s"] > 0
    assert row["report"]["codec"]["codec"] == "tiered"


@pytest.mark.filterwarnings("ignore:Already found a `peft_config` attribute:UserWarning")
def test_lora_benchmark_runs_on_the_tiny_transformer(tmp_path):
    """benchmarks.lora end to end on the CPU: every unfused row equals the resident model's."""
    import json

    from benchmarks import lora

    rc = lora.main(["--tiny", "--device", "cpu", "--rank", "4", "--resolution", "128", "--repeats", "2",
                    "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "lora.json").read_text())
    exact = [r["exact"] for r in doc["rows"] if "exact" in r]
    assert rc == 0 and exact == [True, True, True]
    assert doc["edits"]["adapters"] > 0


def test_quantized_benchmark_runs_on_the_tiny_transformer(tmp_path):
    """benchmarks.quantized end to end on the CPU: GGUF Q8_0 streams exactly, torchao's int8 is refused
    by our rows and runs under diffusers' group offloading."""
    import json

    from benchmarks import quantized

    rc = quantized.main(["--tiny", "--device", "cpu", "--resolution", "128", "--repeats", "1", "--budgets", "2",
                         "--out", str(tmp_path)])
    rows = {(r["format"], r["row"]): r for r in json.loads((tmp_path / "quantized.json").read_text())["rows"]}
    assert rc == 0
    assert rows[("gguf-q8_0", "ours 2 GiB")]["exact"] is True
    assert "torchao" in rows[("torchao-int8", "ours 2 GiB")]["refused"]
    assert rows[("torchao-int8", "diffusers group offloading (block, streams)")]["exact"] is True

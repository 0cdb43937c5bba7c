"""benchmarks.pipeline on the tiny components (CPU): the classic pipeline through offload_pipeline,
identical to the resident one, written as JSON and Markdown."""

from __future__ import annotations

import json

import pytest


def test_pipeline_benchmark_runs_on_the_tiny_components(tmp_path):
    from benchmarks.pipeline import main

    rc = main(["--tiny", "--device", "cpu", "--budgets", "600KiB", "--routes",
               "linear,vmm,linear+fixed,model_cpu_offload,group_offload", "--steps", "2", "--generations", "2",
               "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "pipeline.json").read_text())
    resident, linear, vmm, coded, cpu_offload, group = doc["rows"]
    assert coded["exact"] and "codec=fixed" in coded["policies"]["transformer"]
    assert rc == 0 and resident["exact"] and linear["exact"] and linear["latents_exact"] and coded["latents_exact"]
    assert linear["peak_device_weights"] <= linear["vram_budget"] == 600 * 1024
    assert linear["policies"]["transformer"].startswith("linear")
    assert len(linear["generations"]) == 2 and all(g["denoise_s"] > 0 and g["uploaded_bytes"] > 0
                                                   for g in linear["generations"])
    assert "needs a CUDA device" in vmm["error"]  # the vmm route has no CPU path
    assert cpu_offload["route"] == "model_cpu_offload" and group["route"] == "group_offload"
    assert cpu_offload["exact"] and group["exact"] and len(group["generations"]) == 2
    md = (tmp_path / "pipeline.md").read_text()
    assert "| offload_pipeline linear |" in md and "needs a CUDA device" in md


def test_the_pipeline_benchmark_s_other_peers(tmp_path):
    from benchmarks.pipeline import main

    def row(*routes: str) -> dict:
        main(["--tiny", "--device", "cpu", "--routes", ",".join(routes), "--steps", "2", "--slow-peer-steps", "1",
              "--generations", "1", "--out", str(tmp_path)])
        return json.loads((tmp_path / "pipeline.json").read_text())["rows"][1]

    assert "needs a CUDA device" in row("ddo")["error"]  # a peer that cannot run here is a row that says so
    assert "needs a CUDA device" in row("mmgp")["error"]
    main(["--tiny", "--device", "cpu", "--budgets", "auto", "--routes", "linear,vmm", "--steps", "1",
          "--generations", "1", "--out", str(tmp_path)])
    _, linear, vmm = json.loads((tmp_path / "pipeline.json").read_text())["rows"]
    assert "fitted to the card" in linear["error"] and "needs a CUDA device" in vmm["error"]
    seq = row("sequential_cpu_offload")
    # accelerate's sequential offload may fail on the CPU (a TypeError in set_module_tensor_to_device with
    # this torch): then its row says so; where it runs, one step is run and the denoise scaled to two
    assert seq.get("error") or (seq["steps_run"] == 1 and seq["exact"] is None and "1 steps run" in seq["pipeline"])
    with pytest.raises(SystemExit, match="put it last"):
        main(["--tiny", "--device", "cpu", "--routes", "group_offload,model_cpu_offload", "--out", str(tmp_path)])


def test_identical_latents_decoded_otherwise_are_told_apart():
    import torch

    from benchmarks.pipeline import _compared, _exact_label

    z, img = torch.zeros(2), torch.ones(3)
    refs = [(img, z), (img, z)]
    assert _compared([(img, z), (img + 1, z)], refs) == {"exact": False, "latents_exact": True}
    assert _compared([(img, z), (img, z + 1)], refs) == {"exact": True, "latents_exact": False}
    assert _compared([(img, None)], refs[:1])["latents_exact"] is False  # nothing recorded: not claimed
    assert "latents are identical, the decode differs" in _exact_label({"exact": False, "latents_exact": True})
    assert _exact_label({"exact": False, "latents_exact": False}) == "NO"


def test_the_vmm_gain_is_set_against_the_bytes_it_did_not_upload():
    from benchmarks.pipeline import gains

    def row(route, budget, totals, sent, link=50.0):
        return {"route": route, "asked_budget": budget, "link_gb_s": link,
                "generations": [{"total_s": t, "uploaded_bytes": b} for t, b in zip(totals, sent)]}

    rows = [{"route": "resident"}, row("linear", "auto", [9.0, 8.0, 8.2], [9e10, 5e10, 5e10]),
            row("vmm", "auto", [12.0, 7.0, 7.2], [9e10, 3e10, 3e10]), row("vmm", 8 << 30, [1, 1], [1, 1]),
            {"route": "linear", "asked_budget": 8 << 30, "error": "BudgetError"}]
    (line,) = gains(rows)  # the first generation left out; the 8 GiB vmm row has no linear row to meet
    assert "8.10 -> 7.10 s per image (gain 1.000 s)" in line
    assert "20.0 GB fewer = 0.400 s at the link's 50.0 GB/s); gain / that = 2.50" in line


def test_each_peer_is_set_against_our_fastest_row_at_or_below_its_peak():
    from benchmarks.pipeline import against_peers

    gib = 2**30

    def row(pipeline, route, budget, totals, peak):
        return {"pipeline": pipeline, "route": route, "vram_budget": budget, "peak_driver_used": peak * gib,
                "generations": [{"total_s": t} for t in totals]}

    rows = [row("resident", "resident", None, [5.0, 5.0], 34),
            row("vmm", "vmm", 8 * gib, [9.0, 8.6, 8.6], 13.5), row("vmm", "vmm", 16 * gib, [7.0, 5.6, 5.7], 21.5),
            row("linear", "linear", 8 * gib, [9.0, 8.9, 8.9], 13.5),
            row("model offload", "model_cpu_offload", None, [12.0, 11.0, 11.0], 24.0),
            row("sequential offload", "sequential_cpu_offload", None, [120.0], 1.8),
            {"pipeline": "mmgp", "route": "mmgp", "vram_budget": None, "error": "out of memory"}]
    model, sequential = against_peers(rows)  # the failed peer has no line; the resident row is no peer
    assert model.startswith("model offload (11.00 s per image at 24.00 GiB driver-used): our fastest at or below "
                            "its peak is vmm at 16.00 GiB, 5.65 s at 21.50 GiB: 1.95x faster")
    assert sequential == ("sequential offload (120.00 s per image at 1.80 GiB driver-used): no row of ours at or below "
                          "its peak (our lowest: vmm at 8.00 GiB, 13.50 GiB)")


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


def test_the_phase_activations_are_each_phase_s_peak_over_its_start(monkeypatch):
    """_Phases on a CUDA device (faked counters): encode, each step (with the scheduler's work after
    it) and decode get PyTorch's peak in their segment less what was allocated when it began."""
    import torch

    from benchmarks import pipeline

    # (allocated at the boundary, peak since the last boundary) at each boundary of one call of
    # two steps: start, step 1 begins, ends, step 2 begins, ends, call ends
    script = iter([(100, 100), (150, 400), (160, 900), (150, 700), (160, 950), (100, 3100)])
    state = {}

    def boundary(*_a, **_k):
        state["now"], state["peak"] = next(script)

    monkeypatch.setattr(torch.cuda, "synchronize", boundary)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *_: (0, 0))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *_: state["peak"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *_: state["now"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *_: None)
    denoiser = torch.nn.Identity()
    phases = pipeline._Phases(denoiser, torch.device("cuda", 0))

    def call():
        denoiser(torch.zeros(1))
        denoiser(torch.zeros(1))

    phases.run(call)
    phases.close()
    # encode: 400 - 100; steps: 900 - 150 and 950 - 150 (the gap 700 - 160 counted with step 1);
    # decode: 3100 - 160
    assert phases.activations == {"encode": 300, "denoise": 800, "decode": 2940}
    assert phases.alloc_peak == 3100


def test_a_generation_runs_again_after_an_auto_offload_attached_smaller(monkeypatch):
    """The first call of a ``vram_budget="auto"`` transformer runs out of device memory (raised here):
    the offload attaches its smallest plan and says to call again; the benchmark runs that generation
    again, says so in the row, and its images equal the resident pipeline's. An out-of-memory error
    without that note is the row's own."""
    import torch
    from diffusers import FluxPipeline

    import ddo_blocks
    from benchmarks import pipeline
    from ddo_blocks import autobudget
    from ddo_blocks.tiny_pipeline import CALL_DEFAULTS, tiny_components

    pipe = FluxPipeline(**tiny_components("flux"))
    call = {**CALL_DEFAULTS["flux"], "num_inference_steps": 2}
    call.pop("prompt", None)
    cpu = torch.device("cpu")
    refs, _, _ = pipeline._generations(pipe, cpu, call, 2)
    weights = sum(p.numel() * p.element_size() for p in pipe.transformer.parameters())
    monkeypatch.setattr(autobudget, "free_bytes", lambda device: int(0.8 * weights))
    monkeypatch.setattr(autobudget, "MARGIN_BYTES", 0)
    raised = []

    def out_of_memory(module, args):
        if handle.vram_budget > handle._smallest:
            raised.append(handle.vram_budget)
            raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")

    h = pipe.transformer.transformer_blocks[-1].register_forward_pre_hook(out_of_memory)
    handle = ddo_blocks.offload(pipe.transformer, vram_budget="auto", device="cpu", component="transformer")
    outs, gens, _ = pipeline._generations(pipe, cpu, call, 2)
    assert len(raised) == 1 and "attached at its smallest plan" in gens[0]["out_of_memory_before"][0]
    assert "out_of_memory_before" not in gens[1]
    assert pipeline._compared(outs, refs) == {"exact": True, "latents_exact": True}
    doc = {"machine": "cpu", "date": "-", "commit": "-", "command": "-", "weights": {"transformer": weights},
           "call": {}, "prompts": [], "rows": [{"pipeline": "auto", "route": "linear", "vram_budget": "auto",
                                                 "generations": gens, "peak_gpu_allocated": 0,
                                                 "host_rss_over_baseline": 0, "exact": True, "latents_exact": True}]}
    assert "auto, generation 1: ran out of device memory and ran again" in pipeline.markdown(doc)
    h.remove()
    handle.remove()

    def plain(module, args):
        raise torch.OutOfMemoryError("CUDA out of memory (raised by the test, no note)")

    h = pipe.transformer.transformer_blocks[-1].register_forward_pre_hook(plain)
    with pytest.raises(torch.OutOfMemoryError, match="no note"):
        pipeline._generations(pipe, cpu, call, 1)
    h.remove()

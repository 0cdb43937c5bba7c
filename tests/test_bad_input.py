"""Bad input gets a clear DdoError naming what was wrong and what would work, and reports never
claim the impossible."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import ddo_blocks
from ddo_blocks import ConfigError


# -- sizes ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [2**64, 2**63, 1e99, float("inf"), "1e99", "99999999999TiB"])
def test_budgets_beyond_any_machine_are_config_errors(flux, budget):
    with pytest.raises(ConfigError, match="vram_budget=.*(larger than any machine|is not a size)"):
        ddo_blocks.offload(flux, vram_budget=budget, device="cpu")
    assert ddo_blocks.get_handle(flux) is None


def test_largest_budget_is_accepted(flux):
    ddo_blocks.offload(flux, vram_budget=2**63 - 1, device="cpu").remove()


# -- environment variables ------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["DDO_LINK_GBPS", "DDO_DISK_GBPS"])
@pytest.mark.parametrize("value", ["abc", "0", "-3", "nan", "inf"])
def test_bandwidth_variables_name_themselves(monkeypatch, name, value):
    from ddo_blocks import env

    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=rf"environment variable {name}='{value}' is not a bandwidth.*positive number"):
        env.gbps(name)


def test_link_variable_reaches_offload_as_a_config_error(monkeypatch, flux):
    monkeypatch.setenv("DDO_LINK_GBPS", "abc")
    with pytest.raises(ConfigError, match="DDO_LINK_GBPS='abc'"):
        ddo_blocks.offload(flux, vram_budget=ddo_blocks.minimum_budget(flux), device="cpu")
    monkeypatch.setenv("DDO_LINK_GBPS", "12.5")
    handle = ddo_blocks.offload(flux, vram_budget=ddo_blocks.minimum_budget(flux), device="cpu")
    assert handle.report()["roofline"]["link_gb_s"] == 12.5  # no call yet: the variable's figure
    handle.remove()


def test_vram_budget_variable(monkeypatch, flux):
    monkeypatch.setenv("DDO_VRAM_BUDGET", "abc")
    with pytest.raises(ConfigError, match="environment variable DDO_VRAM_BUDGET='abc' is not a size"):
        ddo_blocks.enable_offload(flux, device="cpu")
    monkeypatch.setenv("DDO_VRAM_BUDGET", str(ddo_blocks.minimum_budget(flux)))
    result = ddo_blocks.enable_offload(flux, device="cpu")
    assert result.handle.vram_budget == ddo_blocks.minimum_budget(flux)
    assert result.report()["component"] == "transformer"  # one way to ask, as on the handle
    result.remove()


def test_every_variable_is_documented():
    from pathlib import Path

    from ddo_blocks import env

    doc = (Path(__file__).parents[1] / "docs" / "environment.md").read_text()
    for name in env.VARIABLES:
        assert f"`{name}`" in doc, name


# -- checkpoints ----------------------------------------------------------------------------------
def test_float_tensor_stored_as_integer_is_a_checkpoint_error(flux_checkpoints, tmp_path):
    import shutil

    from diffusers import FluxTransformer2DModel
    from safetensors.torch import load_file, save_file

    root = flux_checkpoints[0]
    d = tmp_path / "m"
    shutil.copytree(root / "single", d)
    f = d / "diffusion_pytorch_model.safetensors"
    tensors = load_file(f)
    name = "proj_out.weight"
    stored = tensors[name].float()  # 32 bits, then stored as "I32": same width, another kind
    tensors[name] = stored.view(torch.int32)
    save_file(tensors, f, metadata={"format": "pt"})
    for dtype in (None, torch.float32):
        with pytest.raises(ddo_blocks.CheckpointError,
                           match=rf"{f}: tensor '{name}' is stored as I32 \(torch.int32\) but the model expects"):
            ddo_blocks.from_pretrained(FluxTransformer2DModel, d, device="cpu", progress=False, dtype=dtype)


# -- reports --------------------------------------------------------------------------------------
class _Deep(nn.Module):
    """60 blocks: the shape of a large transformer, small enough for the CPU."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 128))
                                    for _ in range(60))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("fraction", [0.2, 0.6, 0.95])
def test_efficiency_never_exceeds_one(fraction):
    model = _Deep().eval()
    x = torch.randn(64, 128)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    handle = ddo_blocks.offload(model, vram_budget=int(total * fraction), device="cpu")
    with torch.no_grad():
        for _ in range(6):
            model(x)
    roof = handle.report()["roofline"]
    calls = [c["seconds"] for c in handle.report()["timeline"]][1:]
    assert roof["calibrated_compute_s"] is not None and roof["bound_s"] is not None
    assert roof["compute_s"] <= min(calls) and roof["transfer_bound_s"] <= min(calls)
    assert roof["compute_capped"] == (roof["compute_s"] < roof["calibrated_compute_s"])
    assert 0 < roof["efficiency"] <= 1.0
    handle.remove()


def test_plot_draws_only_seconds_on_the_time_axis():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    from ddo_blocks.report import Report, is_seconds

    assert is_seconds("median_call_s") and not is_seconds("h2d_gb_s") and not is_seconds("disk_gb_s")
    report = Report({"component": "t", "route": "linear", "preset": "p", "device": "cpu",
                     "setup": {"seconds": 0.5},
                     "runtime": {"median_call_s": 0.25, "h2d_gb_s": 40.0, "first_call_s": None}})
    fig = report.plot()
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == ["setup_s", "median_call_s"]
    assert not math.isclose(fig.axes[0].get_xlim()[1], 40.0)


def test_offload_result_repr_is_one_line(flux):
    result = ddo_blocks.enable_offload(flux, device="cpu", vram_budget=ddo_blocks.minimum_budget(flux))
    assert repr(result).startswith("OffloadResult(OffloadHandle(transformer") and "\n" not in repr(result)
    result.remove()


@pytest.mark.parametrize("route, preset, match", [
    ("linear", "vmm_fast", "'vmm_fast' is a preset of route 'vmm'"),
    ("vmm", "auto", "route='vmm' needs a VRAM budget"),
    ("linear", "nvme_baseline", "'nvme_baseline' is a preset of route 'nvme'"),
])
def test_presets_of_other_routes_and_missing_budgets_say_so(flux, route, preset, match):
    with pytest.raises(ConfigError, match=match):
        ddo_blocks.offload(flux, route=route, preset=preset, device="cpu")


def test_a_logger_tells_what_happened_and_nothing_prints_unasked(flux, caplog, capsys):
    import logging

    with caplog.at_level(logging.DEBUG, logger="ddo_blocks"):
        handle = ddo_blocks.offload(flux, vram_budget=ddo_blocks.minimum_budget(flux), device="cpu",
                                    component="transformer")
        with torch.no_grad():
            from ddo_blocks.tiny import flux_inputs

            flux(**flux_inputs(flux))
        handle.remove()
    text = caplog.text
    assert "offloaded transformer: route=linear" in text and "removed the offload of transformer" in text
    assert "execution order learned" in text
    assert capsys.readouterr() == ("", "")  # the library prints nothing itself


def test_efficiency_stays_at_most_one_when_calls_run_only_some_units(monkeypatch):
    """A component whose forward uses one of its two block lists is charged what it moved."""

    class Half(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.enc = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
            self.dec = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))

        def forward(self, x):
            for b in self.enc:
                x = b(x)
            return x

    monkeypatch.setenv("DDO_LINK_GBPS", "0.0001")  # a probe far below what the calls achieve
    model = Half().eval()
    handle = ddo_blocks.offload(model, vram_budget=ddo_blocks.minimum_budget(model), device="cpu")
    with torch.no_grad():
        for _ in range(6):
            model(torch.randn(4, 64))
    roof = handle.report()["roofline"]
    assert 0 < roof["efficiency"] <= 1.0, roof
    handle.remove()


def test_min_budget_everywhere(flux):
    from ddo_blocks.blocks.policy import OffloadPolicy

    handle = ddo_blocks.offload(flux, vram_budget="min", device="cpu")
    assert handle.vram_budget == ddo_blocks.minimum_budget(flux)
    assert handle.report()["plan"]["gpu_bytes"] <= handle.vram_budget
    handle.remove()
    with pytest.raises(ConfigError, match="vram_budget='min' is the smallest plan .* route 'resident' does not stream"):
        ddo_blocks.offload(flux, route="resident", vram_budget="min", device="cpu")
    assert OffloadPolicy(route="linear", vram_budget="min").describe() == "linear, budget min"
    with pytest.raises(ConfigError, match="route 'diffusers' does not stream"):
        OffloadPolicy(route="diffusers", vram_budget="min")


@pytest.mark.parametrize("stage_option", [{"codec": "zstd"}, {"graph": "yes"}, {"units": "bogus"}])
def test_wrap_refuses_a_bad_option_value_of_any_stage_before_a_stage_runs(stage_option):
    """The decode stage's bad value is refused by wrap() itself, not when the decode stage runs after
    the others ran and stayed offloaded."""
    from diffusers.modular_pipelines import FluxAutoBlocks

    key, value = next(iter(stage_option.items()))
    with pytest.raises(ddo_blocks.ConfigError, match=f"{key}={value!r}"):
        ddo_blocks.wrap(FluxAutoBlocks(), device="cpu", decode={"route": "linear", key: value})
    with pytest.raises(ddo_blocks.ConfigError, match=f"{key}={value!r}"):
        ddo_blocks.offload(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), device="cpu",
                           **stage_option)


def test_the_smallest_plan_with_a_codec_on_the_cpu_streams_every_unit():
    """On the CPU the codec decodes straight into the slots: ``vram_budget="min"`` plans no GPU landing
    buffers, so every unit streams (coded) as it does without a codec."""
    from ddo_blocks.tiny import flux_inputs, tiny_flux_transformer

    model = tiny_flux_transformer(dtype=torch.bfloat16)
    x = flux_inputs(model)
    with torch.no_grad():
        ref = model(**x)[0]
    assert ddo_blocks.minimum_budget(model, codec="fixed", device="cpu") == ddo_blocks.minimum_budget(model)
    handle = ddo_blocks.offload(model, device="cpu", vram_budget="min", codec="fixed")
    plan = handle.report()["plan"]
    assert plan["resident_units"] == 0 and plan["streamed_units"] > 0
    with torch.no_grad():
        assert torch.equal(model(**x)[0], ref)
    handle.remove()


@pytest.mark.parametrize("kwargs, name, hint", [
    ({"devcie": "cpu"}, "devcie", "device"),
    ({"device": "cpu", "codek": "fixed"}, "codek", "codec"),
    ({"device": "cpu", "route": "diffusers", "bogus": 1}, "bogus", None),
])
def test_an_unknown_keyword_is_named_before_anything_else(flux, kwargs, name, hint):
    """A typo is named (with the closest keyword that exists), not met later as a CUDA error about the
    default device or a route's own refusal."""
    match = f"does not take {name}" + (f" \\(did you mean {hint!r}\\?\\)" if hint else "")
    with pytest.raises(ConfigError, match=match):
        ddo_blocks.offload(flux, **kwargs)
    assert ddo_blocks.get_handle(flux) is None

"""The benchmark harness's parts, without running a benchmark: what every benchmark measures the same
way (``benchmarks/measure.py``), the rows built from the route registry (``benchmarks/rows.py``) and
process isolation (``benchmarks/isolation.py``)."""

from __future__ import annotations

import dataclasses
import os
import statistics

import pytest

from benchmarks import rows
from benchmarks.isolation import FORK_FAILED, Runner, choose_isolation, is_fork_cuda_failure
from benchmarks.measure import GIB, RssSampler, parse_size, time_forward, timed_calls
from ddo_blocks import ConfigError, routes
from ddo_blocks.routes import HostMode, Preset


# -------------------------------------------------------------------------------------------------
# measure
# -------------------------------------------------------------------------------------------------
class _Forward:
    """A forward that logs its calls and counts its outputs alive."""

    def __init__(self):
        self.log: list[str] = []
        self.alive = self.most_alive = 0

    def __call__(self, **inputs):
        self.log.append("call")
        return _Output(self)


class _Output:
    def __init__(self, fwd: _Forward):
        self.fwd = fwd
        fwd.alive += 1
        fwd.most_alive = max(fwd.most_alive, fwd.alive)

    def __del__(self):
        self.fwd.alive -= 1


def test_the_timed_forward_loop_warms_up_then_times_the_repeats():
    fwd = _Forward()
    timing = time_forward(fwd, {"x": 1}, "cpu", warmup=3, repeats=4,
                          after_warmup=lambda: fwd.log.append("after warm-up"), keep_output=True)
    assert fwd.log == ["call"] * 3 + ["after warm-up"] + ["call"] * 4
    assert len(timing.times) == 4 and timing.first_call_s > 0
    assert timing.step_s == statistics.median(timing.times)
    assert isinstance(timing.output, _Output) and fwd.most_alive == 1  # one output alive at a time
    assert time_forward(fwd, {}, "cpu", repeats=1).output is None
    assert len(timed_calls(fwd, {}, "cpu", 2)) == 2


def test_the_peak_rss_is_the_larger_of_the_samples_and_ru_maxrss():
    sampler = RssSampler(0.001).start()
    block = bytearray(64 << 20)  # touched: 64 MiB resident
    rss = sampler.stop()
    del block
    assert rss.start > 0 and rss.sampled >= max(rss.start, rss.end)
    assert rss.peak == max(rss.sampled, rss.ru_maxrss) >= rss.end


def test_sizes_are_read_by_the_package_with_bare_numbers_in_gib_unless_told():
    assert parse_size("2") == 2 * GIB and parse_size(" 1.5GB ") == 1_500_000_000
    assert parse_size("8", bare_unit="B") == 8 and parse_size("8GiB", bare_unit="B") == 8 * GIB
    assert parse_size("0.5x", 1000) == 500 and parse_size("0.5X", 1000) == 500
    with pytest.raises(ConfigError):
        parse_size("1e3")
    with pytest.raises(ValueError, match="fraction"):
        parse_size("0.5x")

# -------------------------------------------------------------------------------------------------
# rows
# -------------------------------------------------------------------------------------------------
PEERS = ["resident", "diffusers:block_level", "diffusers:leaf_level", "ddo:one_shot_fast", "ddo:low_ram_safe"]


def test_the_default_rows_are_the_registry_s_streaming_presets_and_the_peers():
    linear = routes.get("linear")
    ours = [f"ours:{p.name}" for p in linear.presets if p.host is not HostMode.CALLER and p.name != "wsl_compat"]
    assert ours == ["ours:one_shot_fast", "ours:warm_process", "ours:low_ram_safe"]
    assert set(rows.expand_routes("linear")) == set(ours)
    assert set(rows.expand_routes("ours")) == {*ours, "ours:vmm_fast"}  # every streaming route's presets
    # every default family runs, in the priority order (the time limit skips from the end)
    assert rows.expand_routes("all") == list(rows.PRIORITY) and set(rows.PRIORITY) == {*ours, "ours:vmm_fast", *PEERS}


def test_a_preset_added_to_the_registry_becomes_a_row(monkeypatch):
    linear = routes.get("linear")
    disk = Preset("linear", "disk_probe", "a new way of holding weights", HostMode.DISK_STAGED)
    resized = dataclasses.replace(linear.presets[0], name="one_shot_small")  # one_shot_fast's mechanism again
    monkeypatch.setitem(routes.REGISTRY, "linear",
                        dataclasses.replace(linear, presets=(*linear.presets, disk, resized)))
    assert rows.expand_routes("all") == [*rows.PRIORITY, "ours:disk_probe"]
    assert rows.expand_routes("ours:one_shot_small") == ["ours:one_shot_small"]  # by name only


def test_our_selectors_are_checked_against_the_registry():
    assert rows.expand_routes("ours:wsl_compat,ours:auto@2/4,resident") == [
        "resident", "ours:wsl_compat", "ours:auto@2/4"]
    with pytest.raises(SystemExit, match="unknown preset 'bogus'.*takes auto, one_shot_fast"):
        rows.expand_routes("ours:bogus")
    with pytest.raises(SystemExit, match="route 'nvme' streams from the model's files"):
        rows.expand_routes("ours:nvme_baseline")
    with pytest.raises(SystemExit, match="unknown preset 'off'"):
        rows.expand_routes("ours:off")  # attaches nothing: not an offload row
    with pytest.raises(SystemExit, match="only ours and ddo routes take budgets"):
        rows.expand_routes("diffusers@2")


def test_our_specs_name_the_registry_route_and_its_keep_warm():
    budgets = [("2GiB", 2 * GIB)]
    specs = rows.make_specs(rows.expand_routes("ours,resident,ddo"), budgets, [("4GiB", 4 * GIB)])
    ours = {s["preset"]: s for s in specs if s["route"] == "ours"}
    assert {s["ddo_blocks_route"] for s in ours.values()} == {"linear", "vmm"}
    assert {p for p, s in ours.items() if s["keep_warm"]} == {"warm_process"}
    ddo = [s for s in specs if s["route"] == "ddo"]
    assert [s["id"] for s in ddo] == ["ddo-one_shot_fast-2GiB", "ddo-low_ram_safe-4GiB"]
    assert ddo[1]["env"]["DDO_RESIDENT_MODULE_BUDGET_GB"] == "4"
    assert [s["id"] for s in specs][:2] == ["resident", "ours-one_shot_fast-2GiB"]


def test_codec_rows_run_beside_the_uncompressed_ones_and_a_bad_codec_is_refused():
    budgets = [("min", 7), ("4GiB", 4 * GIB)]
    specs = rows.make_specs(rows.expand_routes("resident,ours:one_shot_fast,ours:one_shot_fast+fixed"), budgets, [])
    ids = [s["id"] for s in specs]
    assert ids == ["resident", "ours-one_shot_fast-min", "ours-one_shot_fast-4GiB", "ours-one_shot_fast_fixed-min",
                   "ours-one_shot_fast_fixed-4GiB"]
    assert [s["codec"] for s in specs if s["route"] == "ours"] == ["off", "off", "fixed", "fixed"]
    assert specs[-1]["selector"] == "ours:one_shot_fast+fixed" and specs[-1]["preset"] == "one_shot_fast"
    with pytest.raises(SystemExit, match="unknown codec 'zstd'.*off, fixed"):
        rows.expand_routes("ours:one_shot_fast+zstd")
    assert rows.split_options("one_shot_fast+tiered+replan") == ("one_shot_fast", "tiered", True)
    assert rows.split_options("one_shot_fast+replan") == ("one_shot_fast", "off", True)
    assert rows.split_options("one_shot_fast") == ("one_shot_fast", "off", False)
    assert rows.split_options("one_shot_fast+graph") == ("one_shot_fast", "off", False)
    assert rows.wants_graph("one_shot_fast+graph") and not rows.wants_graph("one_shot_fast+tiered")
    (spec,) = rows.make_specs(rows.expand_routes("ours:one_shot_fast+fixed+replan"), budgets[:1], [])
    assert spec["replan"] and spec["codec"] == "fixed" and spec["id"] == "ours-one_shot_fast_fixed_replan-min"


@pytest.mark.parametrize(("token", "label", "nbytes"), [
    ("2", "2GiB", 2 * GIB),
    ("512 MiB", "512MiB", 512 << 20),
    ("1.5GB", "1.5GB", 1_500_000_000),
    ("0.25x", "0.25x", 250),
    ("min", "min", 7),
])
def test_budget_tokens_keep_their_labels(token, label, nbytes):
    assert rows.parse_budget(token, 1000, 7) == (label, nbytes)


def test_a_budget_that_is_not_a_size_says_how_to_write_one():
    for bad in ("2 apples", "-1", "x", "min"):
        with pytest.raises(SystemExit, match="budget"):
            rows.parse_budget(bad, 1000, None)


# -------------------------------------------------------------------------------------------------
# isolation
# -------------------------------------------------------------------------------------------------
@pytest.fixture
def runner():
    notes: list[str] = []
    r = Runner("fork", os.memfd_create("bench-test-blob"), 10, notes)
    r.model = object()
    yield r
    r.close()


def _fails_when_forked(runner: Runner, calls: list[str]):
    def run(job, timeout=None):
        calls.append(runner.isolation)
        forked = runner.isolation == "fork"
        return {"status": "error" if forked else "ok", "error": "CUDA initialization error" if forked else None,
                "fork_cuda_failure": forked}

    return run


def test_a_forked_child_without_cuda_switches_the_run_to_spawn(runner, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(runner, "run", _fails_when_forked(runner, calls))
    res = runner.run_job({"kind": "row"})
    assert calls == ["fork", "spawn"] and res["status"] == "ok"
    assert runner.isolation == "spawn" and runner.model is None and runner.notes == [FORK_FAILED]


def test_once_the_blob_is_freed_a_fork_failure_is_the_row_s_error(runner, monkeypatch):
    runner.forked_cuda_works()  # an earlier forked CUDA row succeeded: the blob is freed
    assert runner.blob_fd == -1
    calls: list[str] = []
    monkeypatch.setattr(runner, "run", _fails_when_forked(runner, calls))
    res = runner.run_job({"kind": "row"})
    assert calls == ["fork"] and runner.isolation == "fork" and not runner.notes
    assert res["error"].startswith("a forked child could not initialise CUDA after earlier ones did: ")


def test_a_spawned_run_keeps_its_blob_after_a_row(runner):
    runner.isolation = "spawn"
    fd = runner.blob_fd
    runner.forked_cuda_works()
    assert runner.blob_fd == fd


def test_isolation_asked_for_is_kept_and_fork_failures_are_recognised():
    assert choose_isolation("spawn") == ("spawn", None) and choose_isolation("fork") == ("fork", None)
    assert choose_isolation("auto")[0] in ("fork", "spawn")
    assert is_fork_cuda_failure("RuntimeError: Cannot re-initialize CUDA in forked subprocess")
    assert not is_fork_cuda_failure("CUDA out of memory")


def test_replan_rows_have_their_own_key_and_label():
    from benchmarks.results import label, row_key

    plain = {"route": "ours", "preset": "one_shot_fast", "codec": "fixed", "budget": "min"}
    replanned = {**plain, "replan": True, "replanned": True, "replan_predicted_gain": 0.12}
    assert row_key(plain) != row_key(replanned)
    assert label(replanned) == "ddo_blocks linear one_shot_fast codec=fixed re-planned (predicted +12%)"
    assert label({**plain, "replan": True, "replanned": False}).endswith("replan kept the plan")

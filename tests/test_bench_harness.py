"""The benchmark harness's parts, without running a benchmark: process isolation
(``benchmarks/isolation.py``)."""

from __future__ import annotations

import os

import pytest

from benchmarks.isolation import FORK_FAILED, Runner, choose_isolation, is_fork_cuda_failure


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

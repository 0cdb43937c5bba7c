"""Process isolation of ``python -m benchmarks.run``: every job (the builder, then one row at a time)
runs in its own process, so a row's peak GPU memory and host RSS are its own.

``fork``: a child of the orchestrator, which holds the loaded model (copy-on-write); the orchestrator
must never initialise CUDA (:func:`import_diffusers`, :func:`libcuda_loaded`). ``spawn``: a fresh
interpreter (``python -m benchmarks.worker JOB.json``) that reads the weights from the blob, whose
descriptor it inherits. A forked child that cannot initialise CUDA switches the run to ``spawn``
(:meth:`Runner.run_job`). See benchmarks/README.md, "How the rows are isolated".
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import ROOT

FORK_FAILED = "a forked child could not initialise CUDA: rows run as spawned processes"
DRIVER_LOADED = "the CUDA driver was already loaded in the orchestrator: rows run as spawned processes"


def import_diffusers(cuda: bool) -> None:
    """Imports diffusers' models without initialising CUDA here. diffusers asks
    ``torch.accelerator.is_available()`` at import; torch answers through NVML when
    PYTORCH_NVML_BASED_CUDA_CHECK=1, but falls back to ``cudaGetDeviceCount`` (which loads the driver
    and makes forked children unable to use CUDA) when NVML fails. For ``--device cuda`` the answer
    is given without asking the driver during the import."""
    import torch

    real = torch.cuda.is_available
    if cuda:
        torch.cuda.is_available = lambda: True
    try:
        import diffusers  # noqa: F401
        from diffusers import FluxTransformer2DModel  # noqa: F401
    finally:
        torch.cuda.is_available = real


def libcuda_loaded() -> bool:
    """The CUDA driver library is mapped into this process (forked children could not use CUDA)."""
    try:
        with open("/proc/self/maps") as f:
            return any(re.search(r"/libcuda\.so(\.|\s|$)", line) for line in f)
    except OSError:
        return False


def choose_isolation(asked: str) -> tuple[str, str | None]:
    """The isolation for ``--isolation`` (``auto``: fork where it is safe) and the note saying why
    ``auto`` fell back to spawn, if it did."""
    if asked != "auto":
        return asked, None
    if not (hasattr(os, "fork") and sys.platform.startswith("linux")):
        return "spawn", None
    if libcuda_loaded():
        return "spawn", DRIVER_LOADED
    return "fork", None


def is_fork_cuda_failure(text: str) -> bool:
    """An error that says CUDA cannot be initialised in a forked child."""
    t = text.lower()
    return (
        "forked subprocess" in t
        or "initialization error" in t
        or "cuda_error_not_initialized" in t
        or "cudaerrorinitializationerror" in t
    )


class Runner:
    """Runs jobs in isolated processes (fork or spawn) with a timeout. It owns the weight blob's
    descriptor and, in fork isolation, the model loaded in this process (``model``); ``close()``
    frees both and the jobs' folder."""

    def __init__(self, isolation: str, blob_fd: int, timeout: float, notes: list[str]):
        self.isolation = isolation
        self.jobs_dir = Path(tempfile.mkdtemp(prefix="ddo-bench-"))
        self.blob_fd = blob_fd
        self.timeout = timeout
        self.notes = notes
        self.model: Any = None
        self.current_pid: int | None = None
        self.current_proc: subprocess.Popen | None = None

    def run_job(self, job: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """Runs a job. Where a forked child could not initialise CUDA and the blob is still open, the
        run switches to spawn (noted) and the job runs again; once the blob is freed the failure is
        the row's error."""
        res = self.run(job, timeout)
        if not (res.get("fork_cuda_failure") and self.isolation == "fork"):
            return res
        if self.blob_fd < 0:
            res["error"] = "a forked child could not initialise CUDA after earlier ones did: " + str(res.get("error"))
            return res
        self.notes.append(FORK_FAILED)
        self.isolation = "spawn"
        self.model = None
        gc.collect()
        return self.run(job, timeout)

    def forked_cuda_works(self) -> None:
        """A forked CUDA child succeeded: the blob is no longer needed, its memory is freed."""
        if self.isolation == "fork":
            self.free_blob()

    def free_blob(self) -> None:
        if self.blob_fd >= 0:
            os.close(self.blob_fd)
            self.blob_fd = -1

    def close(self) -> None:
        self.free_blob()
        shutil.rmtree(self.jobs_dir, ignore_errors=True)

    def run(self, job: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """Runs a job once and reads its result (a stub row with the error where there is none)."""
        name = job.get("spec", {}).get("id", job["kind"])
        job = dict(
            job,
            isolation=self.isolation,
            blob_fd=self.blob_fd,
            result_path=str(self.jobs_dir / f"{name}.result.json"),
        )
        if os.path.exists(job["result_path"]):
            os.remove(job["result_path"])
        timeout = timeout or self.timeout
        t0 = time.monotonic()
        status = self._fork(job, timeout) if self.isolation == "fork" else self._spawn(job, timeout)
        res = _read_result(job, status)
        if status.startswith("killed"):
            res["status"] = "error"
            res["error"] = status
        res["process_wall_s"] = time.monotonic() - t0
        return res

    def _wait(self, pid: int, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                if os.WIFSIGNALED(st):
                    return f"died of signal {os.WTERMSIG(st)}"
                return f"exit {os.WEXITSTATUS(st)}"
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return f"killed after the {timeout:.0f} s row timeout"
            time.sleep(0.02)

    def _fork(self, job: dict[str, Any], timeout: float) -> str:
        from . import worker

        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                for k, v in job.get("spec", {}).get("env", {}).items():
                    os.environ[k] = str(v)
                worker.run_job(job, self.model)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
        self.current_pid = pid
        try:
            return self._wait(pid, timeout)
        finally:
            self.current_pid = None

    def _spawn(self, job: dict[str, Any], timeout: float) -> str:
        path = self.jobs_dir / f"{job.get('spec', {}).get('id', job['kind'])}.job.json"
        path.write_text(json.dumps(job))
        env = dict(os.environ)
        env.update({k: str(v) for k, v in job.get("spec", {}).get("env", {}).items()})
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.worker", str(path)],
            cwd=str(ROOT),
            env=env,
            pass_fds=(self.blob_fd,),
        )
        self.current_proc = proc
        try:
            proc.wait(timeout=timeout)
            rc = proc.returncode
            return f"died of signal {-rc}" if rc < 0 else f"exit {rc}"
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return f"killed after the {timeout:.0f} s row timeout"
        finally:
            self.current_proc = None

    def kill_current(self) -> None:
        if self.current_pid is not None:
            try:
                os.kill(self.current_pid, signal.SIGKILL)
            except OSError:
                pass
        if self.current_proc is not None:
            self.current_proc.kill()


def _read_result(job: dict[str, Any], status: str) -> dict[str, Any]:
    try:
        with open(job["result_path"]) as f:
            return json.load(f)
    except (OSError, ValueError):
        res = {"kind": job["kind"], "status": "error", "error": f"the process ended without a result ({status})"}
        if "spec" in job:
            from .worker import stub_row

            res = {**stub_row(job["spec"]), **res}
        return res

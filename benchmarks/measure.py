"""What every benchmark measures the same way, in one place:

- the step: :func:`time_forward` runs the warm-up calls (the first one timed: ``first_call_s``), then
  the timed calls, each synchronised before and after (:func:`timed_calls`); the step is their median;
- the peak host RSS: :class:`RssSampler`, a psutil thread every 10 ms, whose :class:`RssPeak` is the
  max of what it saw and ``ru_maxrss``;
- sizes as the command lines take them: :func:`parse_size`, ``ddo_blocks.parse_bytes`` for a size
  (``512MiB``, ``1.5GB``; a bare number in GiB unless told otherwise) or a fraction of the weights
  (``0.25x``).

Importing it imports neither torch nor ddo_blocks (each function imports what it needs).
"""

from __future__ import annotations

import ctypes
import gc
import resource
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

GIB = 1 << 30


# -------------------------------------------------------------------------------------------------
# sizes
# -------------------------------------------------------------------------------------------------
def is_fraction(text: str) -> bool:
    """``0.25x``: a fraction of the weights."""
    return text.strip().lower().endswith("x")


def parse_size(text: str, weight_bytes: int | None = None, *, bare_unit: str = "GiB") -> int:
    """Bytes of a size as the benchmarks' options take it: ``0.25x`` is that fraction of
    ``weight_bytes``; anything else is read by ``ddo_blocks.parse_bytes``, a bare number in
    ``bare_unit`` (``"B"``: bytes, as ``vram_budget`` reads it).

    Raises:
        ValueError: a fraction that is not a number, or one without ``weight_bytes``.
        ddo_blocks.ConfigError: not a size.
    """
    t = text.strip()
    if is_fraction(t):
        if weight_bytes is None:
            raise ValueError(f"{text!r} is a fraction of the weights, and there are none here")
        return int(float(t[:-1]) * weight_bytes)
    from ddo_blocks import parse_bytes

    return parse_bytes(t + bare_unit if t[-1:].isdigit() else t, what="size")


# -------------------------------------------------------------------------------------------------
# the step
# -------------------------------------------------------------------------------------------------
def sync(device: Any) -> None:
    """Waits for the device's queued work (nothing to wait for on the CPU)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fwd: Callable[..., Any], inputs: dict[str, Any], device: Any, n: int,
           host: list[float] | None = None) -> tuple[list[float], Any]:
    """Wall seconds of ``n`` synchronised calls, and their output; ``host`` gets each call's host
    seconds (until ``fwd`` returns, before the device is waited for)."""
    times, out = [], None
    for _ in range(n):
        del out
        sync(device)
        t = time.perf_counter()
        out = fwd(**inputs)
        if host is not None:
            host.append(time.perf_counter() - t)
        sync(device)
        times.append(time.perf_counter() - t)
    return times, out


def timed_calls(fwd: Callable[..., Any], inputs: dict[str, Any], device: Any, n: int) -> list[float]:
    """Wall seconds of ``n`` calls ``fwd(**inputs)``, each synchronised before and after."""
    return _timed(fwd, inputs, device, n)[0]


@dataclass
class Timing:
    """The calls of :func:`time_forward`."""

    first_call_s: float
    """The first warm-up call."""
    times: list[float]
    """The timed calls."""
    output: Any = None
    """The last call's output (``keep_output``)."""
    host_times: list[float] = field(default_factory=list)
    """Each timed call's host seconds: until the call returned, before the device was waited for
    (close to the call's wall time when the host, not the device, sets the pace)."""

    @property
    def step_s(self) -> float:
        """The step: the median of the timed calls."""
        return statistics.median(self.times)

    @property
    def host_s(self) -> float | None:
        """The median host seconds of the timed calls."""
        return statistics.median(self.host_times) if self.host_times else None


def time_forward(
    fwd: Callable[..., Any],
    inputs: dict[str, Any],
    device: Any,
    *,
    repeats: int,
    warmup: int = 1,
    after_warmup: Callable[[], None] | None = None,
    keep_output: bool = False,
) -> Timing:
    """The timed-forward loop, under ``torch.no_grad()``: ``warmup`` calls (at least one; the first
    synchronised and timed, the rest not), ``after_warmup()`` once the device is idle, then
    ``repeats`` timed calls, each synchronised before and after. Only one call's output is alive at
    a time."""
    import torch

    with torch.no_grad():
        (first,), out = _timed(fwd, inputs, device, 1)
        for _ in range(max(0, warmup - 1)):
            del out
            out = fwd(**inputs)
        del out
        sync(device)
        if after_warmup is not None:
            after_warmup()
        host: list[float] = []
        times, out = _timed(fwd, inputs, device, repeats, host)
    return Timing(first, times, out if keep_output else None, host)


# -------------------------------------------------------------------------------------------------
# peak host RSS
# -------------------------------------------------------------------------------------------------
def host_rss() -> int:
    """This process's RSS after a collection and ``malloc_trim`` (freed heap pages returned)."""
    import psutil

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return int(psutil.Process().memory_info().rss)


def ru_maxrss_bytes() -> int:
    """The kernel's peak RSS of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass(frozen=True)
class RssPeak:
    """What an :class:`RssSampler` saw between ``start()`` and ``stop()``."""

    start: int
    end: int
    sampled: int
    """The largest sample."""
    ru_maxrss: int

    @property
    def peak(self) -> int:
        """The peak host RSS: the largest sample or ``ru_maxrss``, whichever is larger."""
        return max(self.sampled, self.ru_maxrss)


class RssSampler:
    """Resident set size of this process, sampled by a thread every ``interval`` seconds (10 ms)."""

    def __init__(self, interval: float = 0.01):
        import psutil

        self.proc = psutil.Process()
        self.interval = interval
        self.start_rss = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def sample(self) -> int:
        rss = self.proc.memory_info().rss
        self.peak = max(self.peak, rss)
        return rss

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def start(self) -> RssSampler:
        self.start_rss = self.sample()
        self._thread.start()
        return self

    def stop(self) -> RssPeak:
        self._stop.set()
        self._thread.join()
        end = self.sample()
        return RssPeak(start=self.start_rss, end=end, sampled=self.peak, ru_maxrss=ru_maxrss_bytes())


# -------------------------------------------------------------------------------------------------
# outputs
# -------------------------------------------------------------------------------------------------
def write_rows(out: str, stem: str, doc: dict[str, Any], markdown: str) -> int:
    """Writes ``<stem>.json`` and ``<stem>.md`` into ``out``, prints the Markdown, and returns the
    exit code: 0 unless a row's output was not exact (``row["exact"]`` False; a row that failed to
    run has none)."""
    import json
    from pathlib import Path

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.json").write_text(json.dumps(doc, indent=2))
    (folder / f"{stem}.md").write_text(markdown)
    print(markdown)
    return 0 if all(r.get("exact") is not False for r in doc["rows"]) else 1


def call_again(exc: BaseException) -> str | None:
    """The note of ddo_blocks on an out-of-memory error saying the component was attached smaller and to
    call it again (``vram_budget="auto"``'s first call), its first line; else ``None`` (the error is the
    run's own)."""
    for note in getattr(exc, "__notes__", None) or []:
        if note.startswith("ddo_blocks:") and "call it again" in note:
            return note.splitlines()[0]
    return None

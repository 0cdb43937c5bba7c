"""Reports: a versioned, JSON-serialisable record of what an offload did, measured.

``Report.to_dict()`` is the record (schema ``ddo_blocks.report/1``); ``str(report)`` is a table for
terminals and ``_repr_html_`` the same table for notebooks. Only measured values and the planner's
prediction (labelled as such) appear; a value not measured is ``None``.
"""

from __future__ import annotations

import html
import json
import resource
from typing import TYPE_CHECKING, Any

import psutil
import torch

from .budget import fmt_bytes

if TYPE_CHECKING:
    from .api import OffloadHandle

SCHEMA = "ddo_blocks.report/1"


class Report:
    """One component's report. Index it like a dict: ``report["runtime"]["median_call_s"]``."""

    def __init__(self, data: dict[str, Any]):
        self.data = data

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(self.data))

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.data, indent=indent)

    def rows(self) -> list[tuple[str, str, str]]:
        """(section, field, value) rows with units, in display order."""
        out: list[tuple[str, str, str]] = []
        for section in ("plan", "setup", "runtime", "memory", "codec", "arena", "graph", "roofline", "auto_budget",
                        "edits"):
            for key, value in self.data.get(section, {}).items():
                out.append((section, key, _fmt(key, value)))
        return out

    def __str__(self) -> str:
        d = self.data
        head = (f"ddo_blocks report: {d['component']} ({d['module_class']}) route={d['route']} "
                f"preset={d['preset']} (asked {d['preset_requested']}) device={d['device']}")
        rows = self.rows()
        w1 = max((len(s) for s, _, _ in rows), default=7)
        w2 = max((len(k) for _, k, _ in rows), default=5)
        lines = [head, "-" * len(head)]
        last = None
        for section, key, value in rows:
            lines.append(f"{section if section != last else '':<{w1}}  {key:<{w2}}  {value}")
            last = section
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        d = self.data
        cells = "".join(
            f"<tr><td>{html.escape(s)}</td><td>{html.escape(k)}</td><td style='text-align:right'>"
            f"{html.escape(v)}</td></tr>"
            for s, k, v in self.rows()
        )
        title = html.escape(f"{d['component']} · {d['route']} / {d['preset']} · {d['device']}")
        return (f"<table><caption><b>{title}</b></caption><thead><tr><th>section</th><th>field</th>"
                f"<th>value</th></tr></thead><tbody>{cells}</tbody></table>")

    def plot(self, ax: Any = None) -> Any:
        """Draws what was measured: per call, the compute time and the copy time at the link's
        bandwidth (a timeline, where the report has per-call data: ``timeline``, written by the DDO
        blocks for the linear route), and the memory figures that were measured. Needs matplotlib
        (imported here, not with the package).

        Args:
            ax: two matplotlib axes to draw into; default: a new figure.

        Returns:
            The matplotlib ``Figure``.
        """
        try:
            import matplotlib.pyplot as plt
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError("Report.plot() needs matplotlib: pip install matplotlib") from exc
        d = self.data
        if ax is None:
            fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(10, 3.2), width_ratios=(3, 2))
        else:
            ax_time, ax_mem = ax
            fig = ax_time.figure
        calls = d.get("timeline") or []
        if calls:
            t = 0.0
            for i, c in enumerate(calls):
                ax_time.broken_barh([(t, c["seconds"])], (1.1, 0.8), color="tab:blue",
                                    label="call (measured)" if i == 0 else None)
                if c.get("copy_s"):
                    ax_time.broken_barh([(t, c["copy_s"])], (0.1, 0.8), color="tab:orange",
                                        label="copies at link GB/s" if i == 0 else None)
                t += c["seconds"]
            ax_time.set_yticks([0.5, 1.5], ["copy", "compute"])
            ax_time.set_xlabel("seconds")
            ax_time.legend(loc="upper right", fontsize="small")
        else:
            runtime = {k: v for k, v in d.get("runtime", {}).items() if is_seconds(k) and v is not None}
            setup = d.get("setup", {}).get("seconds")
            if setup is not None:
                runtime = {"setup_s": setup, **runtime}
            ax_time.barh(list(runtime), list(runtime.values()), color="tab:blue")
            ax_time.set_xlabel("seconds")
        ax_time.set_title(f"{d['component']}: {d['route']}/{d['preset']} on {d['device']}")
        mem = {k: v for k, v in {**d.get("plan", {}), **d.get("memory", {})}.items()
               if v is not None and (k.endswith("_bytes") or k.startswith(("gpu_peak", "host_")))
               and isinstance(v, (int, float)) and k != "h2d_total_bytes"}
        ax_mem.barh(list(mem), [v / 2**20 for v in mem.values()], color="tab:green")
        ax_mem.set_xlabel("MiB")
        ax_mem.set_title("memory")
        fig.tight_layout()
        return fig


def is_seconds(key: str) -> bool:
    """Whether a report field holds seconds (``*_s``, not a rate such as ``h2d_gb_s``)."""
    return key.endswith("_s") and not key.endswith("_gb_s")


def _fmt(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if key.endswith("_bytes") or key in ("vram_budget", "gpu_peak_allocated", "gpu_peak_reserved",
                                         "host_rss", "host_peak_rss"):
        return fmt_bytes(value)
    if key.endswith("_gb_s"):
        return f"{value:.2f} GB/s"
    if key.endswith("_s") or key == "seconds":
        return f"{value:.4f} s"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def roofline_bound(*, link_bytes_per_s: float, streamed_bytes: int, calibrated_compute_s: float | None,
                   fastest_call_s: float | None, call_h2d_bytes: int | None,
                   disk: tuple[float, int] | None = None) -> dict[str, Any]:
    """The roofline ``max(compute, streamed bytes / link, disk bytes / disk)``, built only from
    figures that no call can beat, so ``efficiency = bound / median call <= 1`` by construction:

    - compute: measured on the calibration call (its time less the time it waited for copies), but
      at most the fastest call's time: every call does all the compute, so a calibration call that
      carried one-off costs (first use of a kernel or an allocation) cannot set a compute time that
      a later call beats (``compute_capped`` says when it did);
    - transfer: the bytes the fastest steady call fetched (``call_h2d_bytes``; in a full pass, every
      streamed unit once) over the link: the probe's bandwidth, or the rate that call moved them at
      if that was faster (a probe that underestimates the link cannot make the term exceed a call;
      a component whose calls run only some units, such as a VAE that only decodes, is charged
      only what it moved). Without calls: ``streamed_bytes`` over the probe's bandwidth;
    - disk (``(rate, bytes per call)``, the NVMe route): the disk bytes per call at the disk's
      measured rate, or at the rate a call read them if that was faster.
    """
    fastest = fastest_call_s
    link = link_bytes_per_s
    moved = streamed_bytes if fastest is None or call_h2d_bytes is None else call_h2d_bytes
    if fastest and moved:
        link = max(link, moved / fastest)
    transfer = moved / link if link else None
    fields: dict[str, Any] = {"link_gb_s": link / 1e9, "transfer_bound_s": transfer}
    disk_s = None
    if disk is not None:
        rate, nbytes = disk
        if fastest and nbytes:
            rate = max(rate, nbytes / fastest)
        disk_s = nbytes / rate
        fields.update(disk_gb_s=rate / 1e9, disk_bound_s=disk_s)
    measured = calibrated_compute_s
    compute = min(measured, fastest) if measured is not None and fastest else measured
    bound = max(compute, transfer or 0.0, disk_s or 0.0) if compute is not None else None
    return {
        **fields,
        "calibrated_compute_s": measured,
        "compute_s": compute,
        "compute_capped": measured is not None and compute is not None and compute < measured,
        "bound_s": bound,
    }


def build_report(handle: OffloadHandle) -> Report:
    """The report of an offload: what was asked (the handle), the process's memory, and the
    sections the route's engine contributes (``engine.report_sections()``)."""
    engine = handle.engine
    dev = handle.device
    data: dict[str, Any] = {
        "schema": SCHEMA,
        "component": handle.component,
        "module_class": type(handle.module).__name__,
        "route": handle.route,
        "preset_requested": handle.requested_preset,
        "preset": handle.preset.name,
        "device": str(dev),
        "active": not handle.removed,
    }
    rss = psutil.Process().memory_info().rss
    sections: dict[str, dict[str, Any]] = {
        "plan": {"vram_budget": handle.vram_budget},
        "setup": {"seconds": engine.setup_s},
        "runtime": {},
        "memory": {
            "gpu_peak_allocated": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
            "gpu_peak_reserved": torch.cuda.max_memory_reserved(dev) if dev.type == "cuda" else None,
            "host_rss": rss,
            "host_peak_rss": max(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024),
            "pinned_bytes": 0,
        },
        "roofline": {},
    }
    for section, fields in engine.report_sections().items():
        if isinstance(fields, dict):
            sections.setdefault(section, {}).update(fields)
        else:  # a list, such as the per-call timeline
            sections[section] = fields
    auto = getattr(handle, "auto", None)
    if auto is not None:
        sections["auto_budget"] = auto.section()
    if getattr(handle, "lossless", None):
        sections.setdefault("codec", {}).update(handle.lossless)
    data.update(sections)
    return Report(data)

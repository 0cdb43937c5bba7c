"""``python -m benchmarks.merge DIR [DIR ...] [--out DIR]``: one result from several runs (a run split
over several device calls with ``--routes``/``--budgets``). Rows are keyed by (route, preset,
budget); a later run's row replaces an earlier one unless it failed or was skipped where the earlier
one measured. Rooflines, ratios, speed-ups, the table and the plot are computed again over all rows
(the compute bound comes from whichever run has the resident row)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import results as R


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.merge", description=__doc__)
    p.add_argument(
        "runs", nargs="+", help="run folders (with results.json) or results.json files, oldest first"
    )
    p.add_argument(
        "--out", help="output folder (default: the first run's folder name + '-merged', beside it)"
    )
    p.add_argument("--no-plot", action="store_true")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    docs, sources = [], []
    for run in a.runs:
        path = Path(run)
        if path.is_dir():
            path = path / "results.json"
        if not path.exists():
            print(f"error: {path} does not exist", file=sys.stderr)
            return 2
        docs.append(json.loads(path.read_text()))
        sources.append(str(path.parent))
    doc = R.merge(docs, sources)
    first = Path(sources[0])
    out = Path(a.out) if a.out else first.parent / f"{first.name}-merged"
    paths = R.write(doc, out, with_plot=not a.no_plot)
    print(paths["md"].read_text())
    print(f"merged {len(docs)} runs, {len(doc['rows'])} rows -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

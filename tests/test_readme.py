"""The README's quick start runs as written (on the CPU here)."""

from __future__ import annotations

import re
from pathlib import Path


def test_quick_start_runs_as_written(capsys):
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme[readme.index("## Quick start"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "README.md quick start", "exec"), namespace)
    assert "ddo_blocks report: transformer" in capsys.readouterr().out
    result = namespace["transformer"]
    import ddo_blocks

    handle = ddo_blocks.get_handle(result)
    assert handle is not None and handle.route == "linear"
    handle.remove()


def test_the_readme_preset_table_is_the_registry():
    from ddo_blocks.routes import describe

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert describe(markdown=True) in readme
    assert max(len(line) for line in describe().splitlines()) <= 110

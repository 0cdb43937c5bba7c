"""Shared by the scripts in pipelines/: the argument parser and the runner of ``ddo_blocks.blocks.runner``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the embedded tiny models never need the hub


def main(argv: list[str] | None, *, description: str, family: str, make_blocks: Callable[[], Any],
         output: str = "images", defaults: Any = None, save: Any = None) -> int:
    from ddo_blocks.blocks.runner import add_arguments, run
    from ddo_blocks.errors import DdoError

    parser = argparse.ArgumentParser(description=description)
    add_arguments(parser, family=family, defaults=defaults, output=output.rstrip("s"))
    args = parser.parse_args(argv)
    try:
        return run(args, family=family, make_blocks=make_blocks, output=output, save=save)
    except DdoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

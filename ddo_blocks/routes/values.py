"""The values of the streaming routes' own options, checked without a module: ``offload`` checks
them before anything moves, and a policy (a block's, ``wrap``'s, ``offload_pipeline``'s) when it
is made, so a bad value in any stage is refused before the first stage runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..budget import parse_bytes
from ..errors import ConfigError


def check_values(route: str, options: dict[str, Any], *, codecs: tuple[str, ...] = ()) -> None:
    """Raises ``ConfigError`` for the first option of ``route`` whose value cannot work; ``codecs``:
    the ``codec`` values the route takes."""
    from ..streaming.plan import check_granularity

    if "units" in options:
        check_granularity(options["units"])
    if "graph" in options and not isinstance(options["graph"], bool):
        raise ConfigError(f"graph={options['graph']!r}: pass graph=True (replay steady calls as CUDA graphs) "
                          "or graph=False")
    if "codec" in options:
        codec = options["codec"]
        if not isinstance(codec, str) or codec not in codecs:
            raise ConfigError(f"codec={codec!r} is not a codec of route={route!r}; use one of "
                              f"{', '.join(map(repr, codecs))}")
    if options.get("ram_budget") is not None:
        parse_bytes(options["ram_budget"], what="ram_budget")
    codec_dir = options.get("codec_dir")
    if codec_dir is not None and not Path(codec_dir).is_dir():
        raise ConfigError(f"codec_dir={codec_dir!r} is not a directory; pass an existing writable directory for the "
                          "coded side file, or leave it out (next to the checkpoint)")

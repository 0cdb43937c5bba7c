"""``python -m ddo_blocks`` (also installed as ``ddo``): the command-line tool.

    python -m ddo_blocks presets        list routes and presets with what each does
    python -m ddo_blocks run [...]      the main job (what `make run` runs); --help for options
    python -m ddo_blocks doctor         what this machine offers: CUDA driver, devices, link bandwidth
"""

from __future__ import annotations

import argparse
import importlib.util
import sys


def _doctor() -> int:
    import torch

    from . import __version__, _native

    print(f"ddo_blocks {__version__}, torch {torch.__version__}")
    reason = _native.cuda_unavailable_reason()
    if reason:
        print(f"CUDA: not available: {reason.removeprefix('CUDA is not available: ')}")
        return 0
    print(f"CUDA driver {_native.cuda_driver_version()}, {_native.cuda_device_count()} device(s)")
    if torch.cuda.is_available():
        from .streaming.bandwidth import link_bytes_per_s

        dev = torch.device("cuda", torch.cuda.current_device())
        print(f"{torch.cuda.get_device_name(dev)}: pinned host->device {link_bytes_per_s(dev) / 1e9:.1f} GB/s")
    return 0


def main(argv: list[str] | None = None) -> int:
    from . import mainjob

    parser = argparse.ArgumentParser(prog="ddo", description="ddo_blocks: weight offloading for diffusion models")
    sub = parser.add_subparsers(dest="command", required=True)
    presets = sub.add_parser("presets", help="list routes and presets")
    presets.add_argument("--markdown", action="store_true", help="as the README's Markdown table")
    sub.add_parser("doctor", help="show CUDA driver, devices and link bandwidth")
    run = sub.add_parser("run", help="run the main job on the embedded tiny model and print its report")
    mainjob.add_arguments(run)
    args = parser.parse_args(argv)
    if args.command == "presets":
        from .routes import describe

        print(describe(markdown=args.markdown))
        return 0
    if args.command == "doctor":
        return _doctor()
    from .errors import DdoError

    missing = [name for name in ("transformers", "tokenizers") if importlib.util.find_spec(name) is None]
    if missing:  # the embedded pipeline's text encoders and tokenizers
        print(f"error: `ddo run` builds a tiny pipeline with text encoders, which needs {' and '.join(missing)}: "
              "pip install 'ddo-blocks[pipelines]' (or pip install transformers tokenizers)", file=sys.stderr)
        return 2
    try:
        return mainjob.run(args)
    except DdoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

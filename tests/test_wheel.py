"""The wheel `make wheel` builds installs into a fresh venv, next to the pinned torch and diffusers,
and imports there (outside this checkout) with its extension: what a user without Rust gets."""

from __future__ import annotations

import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv_and_imports(tmp_path):
    subprocess.run(["make", "-s", "wheel", f"VENV={Path(sys.prefix)}"], cwd=ROOT, check=True, capture_output=True)
    built = sorted((ROOT / "dist").glob("ddo_blocks-*-abi3-*.whl"), key=lambda p: p.stat().st_mtime)
    assert built, "make wheel wrote no abi3 wheel into dist/"
    wheel = built[-1]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)  # pip comes via the .pth
    py = venv / "bin" / "python"
    # the fresh venv sees the pinned torch and diffusers of the test environment (a .pth), not this checkout
    purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                             capture_output=True, text=True).stdout.strip()
    Path(purelib, "pinned.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)
    code = ("import ddo_blocks, torch; from ddo_blocks import _native; "
            "assert '/venv/' in ddo_blocks.__file__, ddo_blocks.__file__; "
            "from ddo_blocks.tiny import tiny_flux_transformer; m = tiny_flux_transformer(); "
            "h = ddo_blocks.offload(m, vram_budget=ddo_blocks.minimum_budget(m), device='cpu'); h.remove(); "
            "print(ddo_blocks.__version__, _native.__version__)")
    out = subprocess.run([py, "-c", code], cwd=tmp_path, check=True, capture_output=True, text=True)
    assert out.stdout.split() == ["0.1.0", "0.1.0"]

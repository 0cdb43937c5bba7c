"""The extension's boundary: its exceptions are ordinary, picklable ``ddo_blocks`` classes, and no
caller input (sizes, counts, NaN or negative floats) panics or aborts inside Rust: every bad value
is a ``DdoError`` subclass naming what was asked, what was found and what would work."""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
import traceback

import pytest
import torch
from safetensors.torch import save_file

import ddo_blocks
from ddo_blocks import _native

CLASSES = {
    "DdoError": Exception,
    "ConfigError": ddo_blocks.DdoError,
    "PlanError": ddo_blocks.DdoError,
    "BudgetError": ddo_blocks.PlanError,
    "CudaError": ddo_blocks.DdoError,
    "CudaNotAvailableError": ddo_blocks.CudaError,
    "OffloadMemoryError": ddo_blocks.CudaError,
    "CheckpointError": ddo_blocks.DdoError,
    "OffloadStateError": ddo_blocks.DdoError,
}


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_exception_is_a_picklable_ddo_blocks_class(name):
    cls = getattr(ddo_blocks, name)
    assert cls is getattr(_native, name) is getattr(ddo_blocks.errors, name)
    assert cls.__module__ == "ddo_blocks" and cls.__qualname__ == name
    assert issubclass(cls, CLASSES[name]) and issubclass(cls, ddo_blocks.DdoError if name != "DdoError" else Exception)
    err = cls(f"what was asked, what was found ({name})")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls and str(back) == str(err) and back.args == err.args
    assert repr(err) == f"{name}('what was asked, what was found ({name})')"
    try:
        raise err
    except cls as caught:
        shown = "".join(traceback.format_exception(caught))
    assert f"ddo_blocks.{name}: what was asked" in shown, shown


def test_exception_raised_by_rust_pickles_with_its_message(tmp_path):
    with pytest.raises(ddo_blocks.CheckpointError) as info:
        _native.SafetensorsIndex(tmp_path / "nope.safetensors")
    back = pickle.loads(pickle.dumps(info.value))
    assert type(back) is ddo_blocks.CheckpointError and str(back) == str(info.value)
    assert "nope.safetensors" in str(back)


# ---------------------------------------------------------------------------------------------
# sizes, counts and floats from the caller
# ---------------------------------------------------------------------------------------------
# Calls that, unchecked, abort the process (allocations), crash it (null addresses) or never
# return: run in one child process, one JSON line per call, so a regression fails these tests
# instead of killing the test run.
CHILD = r"""
import ctypes, importlib.machinery, importlib.util, json, sys
path, data_file, st_file = sys.argv[1:4]
loader = importlib.machinery.ExtensionFileLoader("ddo_blocks._native", path)
N = importlib.util.module_from_spec(importlib.util.spec_from_file_location("ddo_blocks._native", path, loader=loader))
loader.exec_module(N)
buf = ctypes.create_string_buffer(1 << 16)
scope = {"N": N, "addr": ctypes.addressof(buf), "data_file": data_file, "st_file": st_file}
for name, code in json.loads(sys.stdin.read()):
    try:
        exec(code, dict(scope))
        out = {"name": name, "raised": None}
    except BaseException as e:
        out = {"name": name, "raised": type(e).__name__, "message": str(e)}
    print(json.dumps(out), flush=True)
"""

RING = "t = N.Transport('cpu', 0, 2, 0, (2, 8192, 1, False), stage_host=False); f = t.open_file(data_file)"
ABORT_PRONE = {
    "simulate_slots": ("N.simulate([1, 2], [.1, .1], [False, False], 2**63, 1e9)",
                       "ConfigError", r"slots = 9223372036854775808: a simulation takes 1 to 1024 slots"),
    "simulate_passes": ("N.simulate([1], [.1], [False], 2, 1e9, 2**62)",
                        "ConfigError", r"passes = 4611686018427387904: a simulation takes 1 to 1000 passes"),
    "transport_slots": ("N.Transport('cpu', 0, 2**40)",
                        "ConfigError", r"a transport has 1 to 1024 slots, got 1099511627776"),
    "transport_buffers": ("N.Transport('cpu', 0, 2, 0, (2**40, 4096, 1, False))",
                          "ConfigError", r"a staging ring has 1 to 1024 buffers, got 1099511627776"),
    "transport_buffer_bytes": ("N.Transport('cpu', 0, 2, 0, (4, 2**62, 1, False))",
                               "ConfigError", r"4 buffers of 4611686018427387904 bytes.*must fit in memory"),
    "transport_threads": ("N.Transport('cpu', 0, 2, 0, (2, 4096, 2**40, False))",
                          "ConfigError", r"at most 1024 threads, got 1099511627776"),
    "plan_min_slots": ("N.plan([100] * 3, base_bytes=0, budget_bytes=250, link_bytes_per_s=1e9, "
                       "compute_bytes_per_s=1e9, min_slots=2**40, max_slots=2**40)",
                       "ConfigError", r"min_slots = 1099511627776 is more than the 1024 slots"),
    "ram_cache_slots": ("N.plan_ram_cache([1], unit_compute_s=[0.0], resident=[False], slots=2**40, "
                        "ram_budget_bytes=0, link_bytes_per_s=1e9, disk_bytes_per_s=1e9)",
                        "ConfigError", r"slots = 1099511627776 is more than the 1024 slots"),
    "disk_probe_threads": ("N.measure_disk_read(data_file, 4096, 2**40)",
                           "ConfigError", r"at most 1024 reader threads, got 1099511627776"),
    "read_file_huge": ("N.read_file_into(data_file, [(0, 2**62, addr)])",
                       "CheckpointError", r"data\.bin: bytes 0\.\.4611686018427387904 are asked for but the file is "
                                          r"4096 bytes"),
    "read_file_null": ("N.read_file_into(data_file, [(0, 16, 0)])",
                       "ConfigError", r"reading .*data\.bin: 16 bytes at address 0 \(a null pointer\)"),
    "copy_null": ("N.copy_host_many([(addr, addr + 64, 8), (0, addr, 8)])",
                  "ConfigError", r"copy destination: 8 bytes at address 0 \(a null pointer\)"),
    "copy_wraps": ("N.copy_host_many([(addr, 2**64 - 4, 8)])",
                   "ConfigError", r"copy source: 8 bytes at address 0xfffffffffffffffc run past the end"),
    "fetch_null": ("N.Transport('cpu', 0, 2).fetch(0, 0, addr, 8)",
                   "ConfigError", r"fetch destination: 8 bytes at address 0"),
    "fetch_file_null": (RING + "; t.fetch_file(0, 0, t.add_file_unit([(f, 0, 100, 0)]))",
                        "ConfigError", r"file fetch destination: 100 bytes at address 0"),
    "file_unit_wraps": (RING + "; t.add_file_unit([(f, 0, 100, 2**64 - 10)])",
                        "ConfigError", r"a piece of 100 bytes going to byte 18446744073709551606 of the slot ends past"),
    "read_into_null": ("N.SafetensorsIndex(st_file).read_into('a', 0)",
                       "ConfigError", r"12 bytes at address 0 \(a null pointer\)"),
}


@pytest.fixture(scope="module")
def child_results(tmp_path_factory):
    d = tmp_path_factory.mktemp("ffi")
    data_file = d / "data.bin"
    data_file.write_bytes(bytes(range(256)) * 16)
    st_file = d / "m.safetensors"
    save_file({"a": torch.zeros(3)}, str(st_file))
    cases = json.dumps([(name, code) for name, (code, _, _) in ABORT_PRONE.items()])
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD, _native.__file__, str(data_file), str(st_file)],
                              input=cases, capture_output=True, text=True, timeout=60)
        out, rc, err = proc.stdout, proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as exc:
        out, rc, err = exc.stdout or "", "timeout (a call never returned)", ""
        out = out.decode() if isinstance(out, bytes) else out
    results = {r["name"]: r for r in map(json.loads, out.splitlines())}
    return results, f"the child process ended ({rc}) at or before this call: {err[-2000:]}"


@pytest.mark.parametrize("name", sorted(ABORT_PRONE))
def test_abort_prone_call_raises_a_clear_error(child_results, name):
    results, died = child_results
    assert name in results, died
    _, cls, message = ABORT_PRONE[name]
    got = results[name]
    assert got["raised"] == cls, got
    assert re.search(message, got["message"]), got



@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: _native.simulate([1, 2], [0.1, 0.1], [False, False], 2, float("nan")),
         r"link_bytes_per_s must be a finite positive number of bytes per second, got NaN"),
        (lambda: _native.simulate([1, 2], [0.1, 0.1], [False, False], 2, 1e9, 3, [True, True], -5.0),
         r"disk_bytes_per_s must be a finite positive number .*got -5"),
        (lambda: _native.simulate([1, 2], [0.1, float("inf")], [False, False], 2, 1e9),
         r"unit_compute_s\[1\] = inf is not a finite non-negative number of seconds"),
        (lambda: _native.simulate([1, 2], [0.1, -1.0], [False, False], 2, 1e9),
         r"unit_compute_s\[1\] = -1 is not a finite non-negative"),
        (lambda: _native.simulate([1, 2], [0.1], [False, False], 2, 1e9),
         r"unit_compute_s has 1 entries but unit_bytes has 2: give one per unit"),
        (lambda: _native.simulate([1, 2], [0.1, 0.1], [False], 2, 1e9),
         r"resident has 1 entries but unit_bytes has 2"),
        (lambda: _native.simulate([1, 2], [0.1, 0.1], [False, False], 0, 1e9),
         r"slots = 0: a simulation takes 1 to 1024 slots"),
        (lambda: _native.minimum_budget([100, 100], 10, 0),
         r"min_slots = 0: a plan streams through 1 to 1024 slots \(normally 2\)"),
        (lambda: _native.layout_unit([2**64 - 1, 5]),
         r"tensor 1 of 5 bytes does not fit in a unit that already holds 18446744073709551615 bytes"),
        (lambda: _native.layout_unit([2**64 - 3]),
         r"rounded up to 256-byte alignment, exceeds 2\^64 bytes"),
    ],
)
def test_meaningless_numbers_are_config_errors(call, message):
    with pytest.raises(ddo_blocks.ConfigError, match=message):
        call()


def test_valid_calls_still_work():
    assert _native.simulate([1, 2], [0.1, 0.1], [False, False], 2, 1e9).step_s > 0
    assert _native.minimum_budget([100, 100], 10, 1).bytes == 110
    assert _native.layout_slabs([2**64 - 256, 256], 2**64 - 1).slabs == [2**64 - 256, 256]
    t = _native.Transport("cpu", 0, 1024, 0, (1024, 1, 4, False))
    t.close()
    _native.copy_host_many([(1, 1, 0)])  # zero bytes: nothing to check, nothing copied

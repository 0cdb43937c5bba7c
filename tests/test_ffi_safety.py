"""The extension's boundary: its exceptions are ordinary, picklable ``ddo_blocks`` classes, and no
caller input (sizes, counts, NaN or negative floats) panics or aborts inside Rust: every bad value
is a ``DdoError`` subclass naming what was asked, what was found and what would work."""

from __future__ import annotations

import pickle
import traceback

import pytest

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

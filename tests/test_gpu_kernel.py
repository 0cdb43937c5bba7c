"""A kernel compiled at run time (NVRTC) and launched through ``_native`` on torch's current stream.
The GPU test is marked ``gpu`` (skipped without CUDA, and skipped with NVRTC's reason where NVRTC is
missing); the not-available path runs everywhere else."""

from __future__ import annotations

import pytest
import torch

import ddo_blocks
from ddo_blocks import _native

ADD_ONE = r"""
extern "C" __global__ void add_one(unsigned char* x, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1;
}
"""


def test_without_a_driver_or_nvrtc_a_kernel_is_a_clear_not_available_error():
    if _native.cuda_unavailable_reason() is None and _native.nvrtc_unavailable_reason() is None:
        pytest.skip("CUDA and NVRTC are both here: tests/test_gpu_kernel.py::test_add_one_* run instead")
    with pytest.raises(ddo_blocks.CudaNotAvailableError, match="not available"):
        _native.CudaKernel(ADD_ONE, "add_one", 0)
    if _native.nvrtc_unavailable_reason() is not None:
        assert "NVRTC" in _native.nvrtc_unavailable_reason()
        with pytest.raises(ddo_blocks.CudaNotAvailableError, match="NVRTC"):
            _native.nvrtc_version()


@pytest.fixture(scope="module")
def add_one():
    reason = _native.nvrtc_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    return _native.CudaKernel(ADD_ONE, "add_one", torch.cuda.current_device())


@pytest.mark.gpu
def test_add_one_on_torchs_current_stream(add_one):
    n = (1 << 20) + 3
    x = torch.arange(n, device="cuda").remainder(254).to(torch.uint8)  # 0..253: no wrap at +2
    want = x.cpu().to(torch.int64) + 2
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        stream = torch.cuda.current_stream().cuda_stream
        assert stream == side.cuda_stream
        grid, block = ((n + 255) // 256, 1, 1), (256, 1, 1)
        add_one.launch(grid, block, [("ptr", x.data_ptr()), ("u64", n)], stream)
        add_one.launch(grid, block, [("ptr", x.data_ptr()), ("u64", n)], stream)
        total = x.to(torch.int64).sum()  # queued after both kernels on the same stream
    side.synchronize()
    assert torch.equal(x.cpu().to(torch.int64), want)
    assert total.item() == int(want.sum())
    assert add_one.name == "add_one" and add_one.device == torch.cuda.current_device()


@pytest.mark.gpu
def test_kernel_errors_say_what_was_wrong(add_one):
    stream = torch.cuda.current_stream().cuda_stream
    with pytest.raises(ddo_blocks.ConfigError, match="kinds are"):
        add_one.launch((1, 1, 1), (1, 1, 1), [("pointer", 0)], stream)
    with pytest.raises(ddo_blocks.ConfigError, match="at least 1"):
        add_one.launch((0, 1, 1), (1, 1, 1), [], stream)
    with pytest.raises(ddo_blocks.ConfigError, match='extern "C"'):
        _native.CudaKernel(ADD_ONE, "missing", torch.cuda.current_device())
    with pytest.raises(ddo_blocks.CudaError, match="nope"):
        _native.CudaKernel('extern "C" __global__ void f() { nope; }', "f", torch.cuda.current_device())
    assert _native.take_deferred_error() is None

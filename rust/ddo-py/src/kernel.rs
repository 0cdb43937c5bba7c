//! Kernels compiled at run time with NVRTC and launched on a stream Python owns.

use ddo_cuda::kernel::{Arg, Kernel, LaunchConfig, Module};
use ddo_cuda::Stream;
use pyo3::prelude::*;

use crate::errors::{cuda_err, ConfigError};

/// Why kernels cannot be compiled in this process (no NVRTC), or None when they can.
#[pyfunction]
fn nvrtc_unavailable_reason() -> Option<String> {
    ddo_cuda::kernel::nvrtc_unavailable_reason()
}

/// NVRTC's version `(major, minor)`; `CudaNotAvailableError` without NVRTC.
#[pyfunction]
fn nvrtc_version() -> PyResult<(i32, i32)> {
    ddo_cuda::kernel::nvrtc_version().map_err(cuda_err)
}

/// Argument kinds `launch` takes, each `(kind, value)`.
const KINDS: &str = "\"ptr\", \"u64\", \"i64\", \"u32\", \"i32\", \"f32\", \"f64\"";

fn arg(i: usize, kind: &str, value: &Bound<'_, PyAny>) -> PyResult<Arg> {
    let bad = |e: PyErr| {
        ConfigError::new_err(format!(
            "kernel argument {i} ({kind:?}, {value}): {e}; pass an int for integer kinds and a \
             float for f32/f64"
        ))
    };
    Ok(match kind {
        "ptr" => Arg::Ptr(value.extract().map_err(bad)?),
        "u64" => Arg::U64(value.extract().map_err(bad)?),
        "i64" => Arg::I64(value.extract().map_err(bad)?),
        "u32" => Arg::U32(value.extract().map_err(bad)?),
        "i32" => Arg::I32(value.extract().map_err(bad)?),
        "f32" => Arg::F32(value.extract::<f64>().map_err(bad)? as f32),
        "f64" => Arg::F64(value.extract().map_err(bad)?),
        other => {
            return Err(ConfigError::new_err(format!(
                "kernel argument {i} has kind {other:?}; the kinds are {KINDS}"
            )))
        }
    })
}

/// A kernel compiled from CUDA C source at run time and loaded on device `device`.
#[pyclass(module = "ddo_blocks._native", frozen)]
struct CudaKernel {
    inner: Kernel,
}

#[pymethods]
impl CudaKernel {
    /// Compiles `source` (NVRTC, for the device's compute capability, plus `options`), loads it in
    /// the device's primary context and finds kernel `name` (declare it `extern "C" __global__`).
    #[new]
    #[pyo3(signature = (source, name, device=0, options=Vec::new()))]
    fn new(
        py: Python<'_>,
        source: String,
        name: String,
        device: usize,
        options: Vec<String>,
    ) -> PyResult<Self> {
        let inner = py
            .detach(|| Module::compile(device, &source, &options)?.kernel(&name))
            .map_err(cuda_err)?;
        Ok(Self { inner })
    }

    #[getter]
    fn name(&self) -> &str {
        self.inner.name()
    }

    #[getter]
    fn device(&self) -> usize {
        self.inner.module().ordinal()
    }

    /// Queues the kernel on `stream` (a `cuda_stream` handle) with `args`, `[(kind, value)]`;
    /// returns without waiting.
    #[pyo3(signature = (grid, block, args, stream, shared_mem_bytes=0))]
    fn launch(
        &self,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: Vec<(String, Bound<'_, PyAny>)>,
        stream: u64,
        shared_mem_bytes: u32,
    ) -> PyResult<()> {
        let args = args
            .iter()
            .enumerate()
            .map(|(i, (kind, value))| arg(i, kind, value))
            .collect::<PyResult<Vec<_>>>()?;
        let config = LaunchConfig {
            grid,
            block,
            shared_mem_bytes,
        };
        // SAFETY: the contract is the caller's, stated in _native.pyi: `stream` is
        // `torch.cuda.Stream.cuda_stream` of a live stream on the kernel's device, every "ptr" is
        // the data pointer of a CUDA tensor on that device holding what the kernel touches, kept
        // alive until the stream has run the kernel, and the arguments match the kernel's
        // parameters. The only caller is tests/test_gpu_kernel.py.
        unsafe {
            self.inner
                .launch(config, Stream::from_raw(stream), &args)
                .map_err(cuda_err)
        }
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(nvrtc_unavailable_reason, m)?)?;
    m.add_function(wrap_pyfunction!(nvrtc_version, m)?)?;
    m.add_class::<CudaKernel>()?;
    Ok(())
}

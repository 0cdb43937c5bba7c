//! The safetensors index.

use std::collections::{BTreeMap, HashMap};

use pyo3::prelude::*;

use crate::errors::{core_err, cuda_err, CheckpointError, ConfigError};

/// A validated safetensors file: its header, and the file kept open (not mapped) for reads.
#[pyclass(module = "ddo_blocks._native", frozen)]
struct SafetensorsIndex {
    inner: ddo_core::SafetensorsIndex,
}

#[pymethods]
impl SafetensorsIndex {
    /// Opens and validates `path`; a truncated or corrupt file raises `CheckpointError`.
    #[new]
    fn new(py: Python<'_>, path: std::path::PathBuf) -> PyResult<Self> {
        let inner = py
            .detach(|| ddo_core::SafetensorsIndex::open(&path))
            .map_err(core_err)?;
        Ok(Self { inner })
    }

    /// `[(name, dtype, shape, offset, nbytes)]` sorted by offset.
    fn tensors(&self) -> Vec<(String, String, Vec<usize>, u64, u64)> {
        self.inner
            .tensors()
            .iter()
            .map(|t| {
                (
                    t.name.clone(),
                    t.dtype.clone(),
                    t.shape.clone(),
                    t.offset,
                    t.nbytes,
                )
            })
            .collect()
    }

    fn metadata(&self) -> Option<HashMap<String, String>> {
        self.inner.metadata().cloned()
    }

    #[getter]
    fn path(&self) -> std::path::PathBuf {
        self.inner.path().to_path_buf()
    }

    #[getter]
    fn file_len(&self) -> u64 {
        self.inner.file_len()
    }

    /// Raises `CheckpointError` if the file was replaced or truncated since it was opened.
    fn check_unchanged(&self) -> PyResult<()> {
        self.inner.check_unchanged().map_err(core_err)
    }

    /// Reads tensor `name`'s bytes from the validated file into host address `dst` (which must
    /// hold them) with positional reads, GIL released. Returns the byte count.
    fn read_into(&self, py: Python<'_>, name: &str, dst: usize) -> PyResult<u64> {
        let path = self.inner.path().display();
        let t = self
            .inner
            .get(name)
            .ok_or_else(|| CheckpointError::new_err(format!("tensor {name:?} is not in {path}")))?;
        let (offset, nbytes) = (t.offset, t.nbytes);
        let n = usize::try_from(nbytes).map_err(|_| {
            ConfigError::new_err(format!(
                "tensor {name:?} of {path} is {nbytes} bytes, more than this machine can address"
            ))
        })?;
        let inner = &self.inner;
        // SAFETY: the Python caller passes the data pointer of a contiguous CPU tensor of at
        // least the tensor's `nbytes` (documented in _native.pyi), held during the call.
        py.detach(|| unsafe {
            ddo_cuda::read_fd_into(inner.file(), inner.path(), &[(offset, n, dst)])
        })
        .map_err(|e| match e {
            ddo_cuda::CudaError::Read(m) => {
                CheckpointError::new_err(format!("tensor {name:?}: {m}"))
            }
            other => cuda_err(other),
        })?;
        Ok(nbytes)
    }
}

/// Reads `(file_offset, nbytes, dst_address)` ranges of `path` into host memory in parallel, with
/// positional reads (no memory map), GIL released. A range past the end of the file raises
/// `CheckpointError`; a null or wrapping destination `ConfigError` (before anything is read).
#[pyfunction]
fn read_file_into(
    py: Python<'_>,
    path: std::path::PathBuf,
    jobs: Vec<(u64, usize, usize)>,
) -> PyResult<()> {
    // SAFETY: the callers (ddo_blocks/loading.py) pass data pointers of CPU tensors (or of
    // disjoint ranges of one slab) sized for the bytes read, held during the call.
    py.detach(|| unsafe { ddo_cuda::read_file_into(&path, &jobs) })
        .map_err(|e| match e {
            ddo_cuda::CudaError::Read(m) => CheckpointError::new_err(m),
            other => cuda_err(other),
        })
}

/// Measures the disk's read bandwidth on `path`: reads up to `max_bytes` from its start with the
/// NVMe route's reader (`threads` readers, O_DIRECT where the filesystem allows it), GIL released.
/// Returns `(bytes_per_s, bytes_read, direct)`.
#[pyfunction]
#[pyo3(signature = (path, max_bytes=64 << 20, threads=8))]
fn measure_disk_read(
    py: Python<'_>,
    path: std::path::PathBuf,
    max_bytes: u64,
    threads: usize,
) -> PyResult<(f64, u64, bool)> {
    let p = py
        .detach(|| ddo_cuda::measure_read_bandwidth(&path, max_bytes, threads))
        .map_err(cuda_err)?;
    Ok((p.bytes_per_s, p.bytes, p.direct))
}

/// Reads a `*.safetensors.index.json`: `{tensor name: shard file name}`.
#[pyfunction]
fn read_shard_index(
    py: Python<'_>,
    path: std::path::PathBuf,
) -> PyResult<BTreeMap<String, String>> {
    py.detach(|| ddo_core::read_shard_index(&path))
        .map_err(core_err)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<SafetensorsIndex>()?;
    m.add_function(wrap_pyfunction!(read_shard_index, m)?)?;
    m.add_function(wrap_pyfunction!(read_file_into, m)?)?;
    m.add_function(wrap_pyfunction!(measure_disk_read, m)?)?;
    Ok(())
}

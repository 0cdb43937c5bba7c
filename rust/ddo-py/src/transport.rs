//! Page-locking, host copies and the slot transport.

use ddo_cuda::{Stream, Target};
use pyo3::prelude::*;

use crate::errors::{cuda_err, ConfigError};

/// The message of an error that could not be raised where it happened (unregistering host memory,
/// restoring a context, freeing a transport that was not closed), or None; taking it clears it.
/// Otherwise the next call that binds a CUDA context raises it.
#[pyfunction]
fn take_deferred_error() -> Option<String> {
    ddo_cuda::take_deferred_error().map(|e| e.to_string())
}

/// Why CUDA cannot be used in this process, or None when it can.
#[pyfunction]
fn cuda_unavailable_reason() -> Option<String> {
    ddo_cuda::unavailable_reason()
}

/// Number of CUDA devices the driver sees.
#[pyfunction]
fn cuda_device_count() -> PyResult<usize> {
    ddo_cuda::device_count().map_err(cuda_err)
}

/// The driver's CUDA version, e.g. 12080.
#[pyfunction]
fn cuda_driver_version() -> PyResult<i32> {
    ddo_cuda::driver_version().map_err(cuda_err)
}

/// Many host copies `(dst, src, nbytes)` in parallel, with the GIL released. A null, wrapping or
/// overlapping range raises `ConfigError` before any copy runs.
#[pyfunction]
fn copy_host_many(py: Python<'_>, jobs: Vec<(usize, usize, usize)>) -> PyResult<()> {
    // SAFETY: the Python callers (streaming/upload.py, streaming/slabs.py) pass data pointers and
    // byte sizes of CPU tensors they hold during the call: parameters as sources, fresh staging
    // buffers or slabs as destinations, each destination range used by one job only.
    py.detach(|| unsafe { ddo_cuda::copy_host_many(&jobs) })
        .map_err(cuda_err)
}

/// A page-locked range of host memory owned by a Python object (a tensor), which this object keeps
/// alive until the range is unregistered.
#[pyclass(module = "ddo_blocks._native")]
struct HostRegistration {
    inner: Option<ddo_cuda::HostRegistration>,
    owner: Option<Py<PyAny>>,
    nbytes: usize,
}

#[pymethods]
impl HostRegistration {
    #[new]
    fn new(
        py: Python<'_>,
        owner: Py<PyAny>,
        ptr: usize,
        nbytes: usize,
        device: usize,
    ) -> PyResult<Self> {
        let inner = py
            .detach(|| {
                // SAFETY: `ptr` and `nbytes` describe the CPU storage of `owner` (a tensor the
                // caller allocated for this), and this object keeps `owner` alive until the range
                // is unregistered (`close` drops the registration before the owner).
                unsafe {
                    ddo_cuda::HostRegistration::register(
                        device,
                        ptr,
                        nbytes,
                        ddo_cuda::ErrorSlot::process(),
                    )
                }
            })
            .map_err(cuda_err)?;
        Ok(Self {
            inner: Some(inner),
            owner: Some(owner),
            nbytes,
        })
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.nbytes
    }

    #[getter]
    fn registered(&self) -> bool {
        self.inner.is_some()
    }

    /// Unregisters the range (idempotent) and drops the reference to the owner. A failure to
    /// unregister cannot be raised here: it is kept for `take_deferred_error()` and raised by the
    /// next call that binds a CUDA context.
    fn close(&mut self, py: Python<'_>) {
        let inner = self.inner.take();
        py.detach(move || drop(inner));
        self.owner = None;
    }
}

/// The slots of one offloaded component and the ordered copies that fill them.
#[pyclass(module = "ddo_blocks._native")]
struct Transport {
    inner: Option<ddo_cuda::Transport>,
}

impl Transport {
    fn get(&mut self) -> PyResult<&mut ddo_cuda::Transport> {
        self.inner
            .as_mut()
            .ok_or_else(|| ConfigError::new_err("the transport was closed"))
    }
}

#[pymethods]
impl Transport {
    /// `device` is "cpu" or "cuda"; `staging` is `(buffers, buffer_bytes, threads, pinned)` or None.
    /// `stage_host=False`: host sources are page-locked and go straight to the slot (in order with
    /// file sources) instead of through the ring.
    #[new]
    /// `piece_bytes`: bytes per parallel piece of a staging buffer's fill (0: an even share per
    /// copy thread).
    #[pyo3(signature = (device, ordinal, slots, copy_stream=0, staging=None, stage_host=true, piece_bytes=0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        device: &str,
        ordinal: usize,
        slots: usize,
        copy_stream: u64,
        staging: Option<(usize, usize, usize, bool)>,
        stage_host: bool,
        piece_bytes: usize,
    ) -> PyResult<Self> {
        let target = match device {
            "cpu" => Target::Cpu,
            "cuda" => Target::Cuda {
                ordinal,
                // SAFETY: the engine passes `torch.cuda.Stream.cuda_stream` of a stream it
                // created on this device and keeps until the transport is closed.
                copy_stream: unsafe { Stream::from_raw(copy_stream) },
            },
            other => {
                return Err(ConfigError::new_err(format!(
                    "unknown transport device {other:?}; use \"cpu\" or \"cuda\""
                )))
            }
        };
        let staging = staging.map(
            |(buffers, buffer_bytes, threads, pinned)| ddo_cuda::Staging {
                buffers,
                buffer_bytes,
                threads,
                pinned,
                stage_host,
                piece_bytes,
            },
        );
        let inner = py
            .detach(|| ddo_cuda::Transport::new(target, slots, staging))
            .map_err(cuda_err)?;
        Ok(Self { inner: Some(inner) })
    }

    fn fetch(
        &mut self,
        py: Python<'_>,
        slot: usize,
        dst: usize,
        src: usize,
        nbytes: usize,
    ) -> PyResult<()> {
        let t = self.get()?;
        // SAFETY: the Python engine passes the data pointers of a slot tensor (on the transport's
        // device) and of a host slab tensor of at least `nbytes` each, disjoint, and keeps both
        // tensors alive and untouched until it has acquired the slot and drained or closed the
        // transport (streaming/engine.py); null and wrapping ranges are refused inside.
        py.detach(|| unsafe { t.fetch(slot, dst, src, nbytes) })
            .map_err(cuda_err)
    }

    /// Opens a weight file for `add_file_unit`; returns its index.
    #[pyo3(signature = (path, allow_direct=true))]
    fn open_file(
        &mut self,
        py: Python<'_>,
        path: std::path::PathBuf,
        allow_direct: bool,
    ) -> PyResult<usize> {
        let t = self.get()?;
        py.detach(|| t.open_file(&path, allow_direct))
            .map_err(cuda_err)
    }

    /// Whether reads of file `index` bypass the page cache (O_DIRECT).
    fn file_is_direct(&mut self, index: usize) -> PyResult<Option<bool>> {
        Ok(self.get()?.file_is_direct(index))
    }

    /// Registers a unit read from files: `[(file, file_offset, nbytes, slot_offset)]`, one per
    /// tensor; adjacent ranges are coalesced into aligned reads. Returns the unit's index.
    #[pyo3(signature = (pieces, max_gap=0))]
    fn add_file_unit(
        &mut self,
        pieces: Vec<(usize, u64, u64, u64)>,
        max_gap: u64,
    ) -> PyResult<usize> {
        let pieces: Vec<ddo_core::ReadPiece> = pieces
            .into_iter()
            .map(|(file, offset, len, dst)| ddo_core::ReadPiece {
                file,
                offset,
                len,
                dst,
            })
            .collect();
        self.get()?
            .add_file_unit(&pieces, max_gap)
            .map_err(cuda_err)
    }

    /// Starts filling `slot` at `dst` with file unit `unit` (read by the staging thread).
    fn fetch_file(&mut self, py: Python<'_>, slot: usize, dst: usize, unit: usize) -> PyResult<()> {
        let t = self.get()?;
        // SAFETY: as for `fetch`: `dst` is a slot tensor's data pointer, sized for the largest
        // unit (so for this unit's span), kept alive until the transport is drained or closed.
        py.detach(|| unsafe { t.fetch_file(slot, dst, unit) })
            .map_err(cuda_err)
    }

    /// Registers the layout of a coded unit read from a file; returns its index for
    /// `fetch_file_coded`.
    fn add_staged_unit(&mut self, unit: &crate::codec::CodedUnit) -> PyResult<usize> {
        self.get()?
            .add_staged_unit(unit.inner.clone())
            .map_err(cuda_err)
    }

    /// Starts filling `slot` at `dst` with staged coded unit `coded`, read by file unit
    /// `file_unit` into `staged` and decoded from there on the copy stream.
    fn fetch_file_coded(
        &mut self,
        py: Python<'_>,
        slot: usize,
        dst: usize,
        file_unit: usize,
        coded: usize,
        staged: usize,
    ) -> PyResult<()> {
        let t = self.get()?;
        // SAFETY: `dst` is a slot tensor's data pointer sized for the largest unit; `staged` the
        // data pointer of the staging tensor streaming/stores.py allocated for the largest coded
        // unit on the transport's device and uses for nothing else; both kept alive until the
        // transport is drained or closed.
        py.detach(|| unsafe { t.fetch_file_coded(slot, dst, file_unit, coded, staged) })
            .map_err(cuda_err)
    }

    /// Starts filling `slot` at `dst` with staged coded unit `coded` from host memory at `host`
    /// (copied into `staged`, then decoded from there on the copy stream).
    fn fetch_host_coded(
        &mut self,
        py: Python<'_>,
        slot: usize,
        dst: usize,
        coded: usize,
        host: usize,
        staged: usize,
    ) -> PyResult<()> {
        let t = self.get()?;
        // SAFETY: as `fetch_file_coded`; `host` is the data pointer of the page-locked buffer
        // streaming/stores.py filled with the unit's bytes and keeps, unmodified, until the
        // transport is drained or closed.
        py.detach(|| unsafe { t.fetch_host_coded(slot, dst, coded, host, staged) })
            .map_err(cuda_err)
    }

    /// Gives the transport its decode ring for coded units: `landing` device addresses of
    /// `landing_bytes` each, decodes queued on `decode_stream` (a `cuda_stream` handle).
    fn set_decoder(
        &mut self,
        decode_stream: u64,
        landing: Vec<usize>,
        landing_bytes: usize,
    ) -> PyResult<()> {
        let t = self.get()?;
        // SAFETY: streaming/coded.py passes the data pointers of one CUDA tensor it allocated for
        // the landing buffers (256-byte aligned, `landing_bytes` apart) and the handle of a
        // `torch.cuda.Stream` it created on the transport's device, both kept until the
        // transport is closed.
        unsafe { t.set_decoder(Stream::from_raw(decode_stream), landing, landing_bytes) }
            .map_err(cuda_err)
    }

    /// Registers a unit held in coded form at host address `host`; returns its index.
    fn add_coded_unit(&mut self, unit: &crate::codec::CodedUnit, host: usize) -> PyResult<usize> {
        self.get()?
            .add_coded_unit(unit.inner.clone(), host)
            .map_err(cuda_err)
    }

    /// Bytes one fetch of coded unit `unit` sends over the link (its batches of chunks included).
    fn coded_link_bytes(&mut self, unit: usize) -> PyResult<usize> {
        self.get()?.coded_link_bytes(unit).map_err(cuda_err)
    }

    /// Starts filling `slot` at `dst` with coded unit `unit` (copies, then decode).
    fn fetch_coded(
        &mut self,
        py: Python<'_>,
        slot: usize,
        dst: usize,
        unit: usize,
    ) -> PyResult<()> {
        let t = self.get()?;
        // SAFETY: as for `fetch`: `dst` is a slot tensor's data pointer sized for the largest
        // unit, and the unit's host buffer (a slab of streaming/coded.py) is kept alive and
        // unmodified until the transport is drained or closed.
        py.detach(|| unsafe { t.fetch_coded(slot, dst, unit) })
            .map_err(cuda_err)
    }

    /// `(file_fetches, disk_bytes)` so far.
    fn disk_stats(&mut self) -> PyResult<(u64, u64)> {
        let s = self.get()?.stats();
        Ok((s.file_fetches, s.disk_bytes))
    }

    fn acquire(&mut self, py: Python<'_>, slot: usize, compute_stream: u64) -> PyResult<()> {
        let t = self.get()?;
        // SAFETY: the engine passes `torch.cuda.current_stream().cuda_stream` (or 0 on the CPU
        // target, where streams are not used): a live stream of the transport's device.
        let compute = unsafe { Stream::from_raw(compute_stream) };
        py.detach(|| t.acquire(slot, compute)).map_err(cuda_err)
    }

    fn release(&mut self, slot: usize, compute_stream: u64) -> PyResult<()> {
        // SAFETY: as for `acquire`.
        let compute = unsafe { Stream::from_raw(compute_stream) };
        self.get()?.release(slot, compute).map_err(cuda_err)
    }

    /// Marks every slot consumed and arrived by the work queued so far on `stream` (a
    /// `cuda_stream` handle): after a CUDA graph replayed fetches and consumers.
    fn fence_slots(&mut self, stream: u64) -> PyResult<()> {
        // SAFETY: as for `acquire`: the engine passes the handle of the live stream it launched
        // the graph on, of the transport's device.
        let stream = unsafe { Stream::from_raw(stream) };
        self.get()?.fence_slots(stream).map_err(cuda_err)
    }

    fn drain(&mut self, py: Python<'_>) -> PyResult<()> {
        let t = self.get()?;
        py.detach(|| t.drain()).map_err(cuda_err)
    }

    /// `{"fetches", "bytes", "host_wait_s"}` so far.
    fn stats(&mut self) -> PyResult<(u64, u64, f64)> {
        let s = self.get()?.stats();
        Ok((s.fetches, s.bytes, s.host_wait_ns as f64 * 1e-9))
    }

    /// Drains outstanding copies and frees events and the staging ring (idempotent). Raises the
    /// drain's error, or one that freeing them met (a `CudaError` saying it was deferred).
    fn close(&mut self, py: Python<'_>) -> PyResult<()> {
        if let Some(t) = self.inner.take() {
            py.detach(move || t.close()).map_err(cuda_err)?;
        }
        Ok(())
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cuda_unavailable_reason, m)?)?;
    m.add_function(wrap_pyfunction!(take_deferred_error, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_device_count, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_driver_version, m)?)?;
    m.add_function(wrap_pyfunction!(copy_host_many, m)?)?;
    m.add_class::<HostRegistration>()?;
    m.add_class::<Transport>()?;
    Ok(())
}

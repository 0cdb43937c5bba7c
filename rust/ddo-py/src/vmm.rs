//! The VMM arena of one device: reserved address ranges, capped physical chunks mapped into them.

use pyo3::prelude::*;

use crate::errors::{cuda_err, ConfigError};

/// Reserved device address ranges and a capped pool of physical chunks (`ddo_cuda::VmmArena`).
/// The Python arena (`streaming/arena.py`) decides what is mapped and fences every unmap with the
/// owner's last use event.
#[pyclass(module = "ddo_blocks._native")]
struct VmmArena {
    inner: Option<ddo_cuda::VmmArena>,
}

impl VmmArena {
    fn get(&mut self) -> PyResult<&mut ddo_cuda::VmmArena> {
        self.inner
            .as_mut()
            .ok_or_else(|| ConfigError::new_err("the VMM arena was closed"))
    }
}

#[pymethods]
impl VmmArena {
    #[new]
    fn new(py: Python<'_>, ordinal: usize, chunk_bytes: usize, max_bytes: usize) -> PyResult<Self> {
        let inner = py
            .detach(|| ddo_cuda::VmmArena::new(ordinal, chunk_bytes, max_bytes))
            .map_err(cuda_err)?;
        Ok(Self { inner: Some(inner) })
    }

    #[getter]
    fn chunk_bytes(&mut self) -> PyResult<usize> {
        Ok(self.get()?.chunk_bytes())
    }

    /// `(chunk_bytes, created, mapped, max_chunks, creations, maps)`.
    fn stats(&mut self) -> PyResult<(usize, usize, usize, usize, usize, usize)> {
        let s = self.get()?.stats();
        Ok((
            s.chunk_bytes,
            s.created,
            s.mapped,
            s.max_chunks,
            s.creations,
            s.maps,
        ))
    }

    fn set_max_bytes(&mut self, py: Python<'_>, max_bytes: usize) -> PyResult<()> {
        let arena = self.get()?;
        py.detach(|| arena.set_max_bytes(max_bytes))
            .map_err(cuda_err)
    }

    /// Reserves whole chunks covering `nbytes`; returns the range's base address.
    fn reserve(&mut self, py: Python<'_>, nbytes: usize) -> PyResult<u64> {
        let arena = self.get()?;
        py.detach(|| arena.reserve(nbytes)).map_err(cuda_err)
    }

    /// Whether each chunk of the range is mapped.
    fn mapped(&mut self, base: u64) -> PyResult<Vec<bool>> {
        self.get()?.mapped(base).map_err(cuda_err)
    }

    /// Maps chunks `first..first+count` of the range (those not mapped); returns how many it mapped.
    fn map(&mut self, py: Python<'_>, base: u64, first: usize, count: usize) -> PyResult<usize> {
        let arena = self.get()?;
        py.detach(|| arena.map(base, first, count))
            .map_err(cuda_err)
    }

    /// Unmaps chunks `first..first+count` of the range (those mapped) into the free list.
    fn unmap(&mut self, py: Python<'_>, base: u64, first: usize, count: usize) -> PyResult<usize> {
        let arena = self.get()?;
        // SAFETY: the Python arena unmaps a component's chunks only after that component's last
        // use event completed and before any of its tensors over them is used again (it rebinds its
        // parameters to host copies first, `arena.py::Member.evict`).
        py.detach(|| unsafe { arena.unmap(base, first, count) })
            .map_err(cuda_err)
    }

    /// Releases free chunks to the driver until at most `keep` are free.
    fn trim(&mut self, py: Python<'_>, keep: usize) -> PyResult<()> {
        let arena = self.get()?;
        py.detach(|| arena.trim(keep)).map_err(cuda_err)
    }

    /// Unmaps a whole range and gives its addresses back.
    fn free_range(&mut self, py: Python<'_>, base: u64) -> PyResult<()> {
        let arena = self.get()?;
        // SAFETY: the Python arena frees a range when its member detaches, after synchronising the
        // streams that used it; no tensor over it is used again.
        py.detach(|| unsafe { arena.free_range(base) })
            .map_err(cuda_err)
    }

    /// Releases everything (idempotent); the owner synchronised first.
    fn close(&mut self, py: Python<'_>) {
        let inner = self.inner.take();
        py.detach(move || drop(inner));
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<VmmArena>()
}

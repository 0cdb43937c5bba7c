//! A graph PyTorch captured, instantiated again for device launch (`ddo_cuda::GraphExec`): the
//! replay of `ddo_blocks.streaming.graph.TorchGraphs` where the driver allows it.

use std::collections::BTreeMap;

use ddo_cuda::{GraphExec, Stream};
use pyo3::prelude::*;

use crate::errors::cuda_err;

/// The device-launch executable of a `torch.cuda.CUDAGraph(keep_graph=True)`'s graph.
#[pyclass(module = "ddo_blocks._native", frozen)]
struct DeviceGraph {
    inner: GraphExec,
}

#[pymethods]
impl DeviceGraph {
    /// Instantiates `raw_graph` (`CUDAGraph.raw_cuda_graph()`) of device `device` for device
    /// launch and uploads it on `stream` (a `cuda_stream` handle). `CudaError` with the driver's
    /// reason where device launch does not allow the graph.
    #[new]
    fn new(py: Python<'_>, raw_graph: u64, device: usize, stream: u64) -> PyResult<Self> {
        // SAFETY: the caller (TorchGraphs) passes the graph of a live CUDAGraph it keeps, of that
        // device, not changed while this runs, and the handle of a live stream of the device.
        let inner = py
            .detach(|| unsafe {
                GraphExec::instantiate(raw_graph, device, Stream::from_raw(stream))
            })
            .map_err(cuda_err)?;
        Ok(Self { inner })
    }

    /// Launches the graph on `stream` (a `cuda_stream` handle of the graph's device).
    fn launch(&self, stream: u64) -> PyResult<()> {
        // SAFETY: TorchGraphs launches on the device's current stream, as PyTorch's replay does,
        // and keeps the CUDAGraph (its memory pool, the tensors it reads and writes) alive while
        // this executable is.
        unsafe { self.inner.launch(Stream::from_raw(stream)) }.map_err(cuda_err)
    }
}

/// `{kind: count}` of the nodes of `raw_graph` (`CUDAGraph.raw_cuda_graph()`) of device `device`,
/// host-to-device copies apart from other copies, and `"edges"`: what a launch from the host pays
/// for. `CudaError` where the driver cannot list the graph.
#[pyfunction]
fn graph_census(raw_graph: u64, device: usize) -> PyResult<BTreeMap<&'static str, usize>> {
    // SAFETY: the caller passes the graph of a live CUDAGraph it keeps (keep_graph=True), of that
    // device, not changed while this runs.
    let census = unsafe { ddo_cuda::graph_census(raw_graph, device) }.map_err(cuda_err)?;
    let mut out: BTreeMap<&'static str, usize> = census.kinds.into_iter().collect();
    out.insert("edges", census.edges);
    Ok(out)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<DeviceGraph>()?;
    m.add_function(wrap_pyfunction!(graph_census, m)?)
}

//! A captured CUDA graph instantiated for device launch, launched from the host.
//!
//! PyTorch instantiates a captured graph for launch from the host. On the H200 (driver 580) such a
//! launch costs the host about 1.7 us per host-to-device copy node and 1.3 us per memset node: a
//! streamed step's 60 copies cost 0.1 ms, and the graph of a Flux-sized step 0.12-0.46 ms a launch.
//! The same graph instantiated with `CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH` launched from the
//! host in 3.7-5.2 us whatever its nodes, and did the same work (measured on empty kernels and
//! 64-byte copies). [`GraphExec`] is that second executable of the graph PyTorch keeps
//! (`torch.cuda.CUDAGraph(keep_graph=True)`, `raw_cuda_graph()`): the same nodes, so the same
//! kernels on the same addresses. Instantiation fails with the driver's error for a graph that
//! device launch does not allow (other node types than kernels, copies and memsets, memory of
//! several devices); the caller then keeps PyTorch's launch.

use cudarc::driver::sys;

use crate::deferred::ErrorSlot;
use crate::driver::{bind_context, bind_primary, check, Stream};

// `bind_primary`, not `bind_context`, for the graph: an error deferred from elsewhere belongs to
// the next transport call, not to a replay (a launch is torch's replay's business).
use crate::error::Result;

/// An executable graph for device launch, owned; destroyed on drop (the driver frees it once a
/// launch still in flight completed).
#[derive(Debug)]
pub struct GraphExec {
    exec: usize,
    ordinal: usize,
}

impl GraphExec {
    /// Instantiates `graph` for device launch (node priorities kept, as PyTorch does) and uploads
    /// it on `stream`.
    ///
    /// # Safety
    /// `graph` is a live `CUgraph` of device `ordinal`'s primary context, neither changed nor
    /// destroyed during the call (the executable does not refer to it afterwards), and `stream` a
    /// live stream of that device.
    pub unsafe fn instantiate(graph: u64, ordinal: usize, stream: Stream) -> Result<Self> {
        let _ctx = bind_primary(ordinal)?;
        let flags = sys::CUgraphInstantiate_flags_enum::CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH.0
            | sys::CUgraphInstantiate_flags_enum::CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY.0;
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: `exec` is a valid out-pointer; the caller guarantees `graph` is live.
        check(
            unsafe {
                sys::cuGraphInstantiateWithFlags(
                    &mut exec,
                    graph as usize as sys::CUgraph,
                    flags as u64,
                )
            },
            "cuGraphInstantiateWithFlags",
            "instantiating a captured graph for device launch",
        )?;
        let me = Self {
            exec: exec as usize,
            ordinal,
        };
        // SAFETY: `exec` was just instantiated in this context; the caller guarantees the stream.
        check(
            unsafe { sys::cuGraphUpload(exec, stream.raw()) },
            "cuGraphUpload",
            "uploading a graph for device launch",
        )?;
        Ok(me)
    }

    /// Launches the graph on `stream`.
    ///
    /// # Safety
    /// `stream` is a live stream of the graph's device, and everything the graph's nodes read and
    /// write is allocated and, as far as the work queued before on `stream` does not order it,
    /// used by nothing else until the launch completed: the contract of a graph replay.
    pub unsafe fn launch(&self, stream: Stream) -> Result<()> {
        let _ctx = bind_primary(self.ordinal)?;
        // SAFETY: `exec` is live until drop; the caller guarantees the stream and the memory.
        check(
            unsafe { sys::cuGraphLaunch(self.exec as sys::CUgraphExec, stream.raw()) },
            "cuGraphLaunch",
            "launching a captured graph",
        )
    }
}

impl Drop for GraphExec {
    fn drop(&mut self) {
        let destroyed = bind_primary(self.ordinal).and_then(|_ctx| {
            // SAFETY: `exec` was instantiated by `instantiate` and is destroyed once, here.
            check(
                unsafe { sys::cuGraphExecDestroy(self.exec as sys::CUgraphExec) },
                "cuGraphExecDestroy",
                "destroying a graph for device launch",
            )
        });
        if let Err(e) = destroyed {
            ErrorSlot::process().record("destroying a graph for device launch", e);
        }
    }
}

/// Queues device-to-device copies `(dst, src, bytes)` on `stream`, in order: a replay's inputs
/// into the tensors its graph reads and its outputs out of the graph's own, one driver call each
/// (2-3 us) where a tensor copy through PyTorch's dispatcher cost 10-15 us on the H200's host.
///
/// # Safety
/// Each `src` and `dst` is `bytes` of device memory of device `ordinal`, allocated until the copy
/// completed, the ranges of one copy not overlapping; `stream` is a live stream of that device,
/// and the work queued on it orders every other use of those bytes.
pub unsafe fn copy_device_many(
    ordinal: usize,
    copies: &[(usize, usize, usize)],
    stream: Stream,
) -> Result<()> {
    if copies.iter().any(|&(d, s, n)| {
        n > 0 && (d == 0 || s == 0 || d.checked_add(n).is_none() || s.checked_add(n).is_none())
    }) {
        return Err(crate::error::CudaError::InvalidArgument(
            "a device copy with a null or wrapping range".into(),
        ));
    }
    let _ctx = bind_context(ordinal)?;
    for &(dst, src, n) in copies {
        if n == 0 {
            continue;
        }
        // SAFETY: the caller upholds the contract above.
        check(
            unsafe {
                sys::cuMemcpyDtoDAsync_v2(
                    dst as sys::CUdeviceptr,
                    src as sys::CUdeviceptr,
                    n,
                    stream.raw(),
                )
            },
            "cuMemcpyDtoDAsync",
            "copying a graph's inputs or outputs on the GPU",
        )?;
    }
    Ok(())
}

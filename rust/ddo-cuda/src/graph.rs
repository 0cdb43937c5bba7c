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
//! several devices); the caller then keeps PyTorch's launch. A streamed Flux step (host-to-device
//! copies on a second stream) ran 1.38-1.5x slower launched this way at 512x512 on the H200 (its
//! copies no longer overlapped the compute), so the Python side uses it only for graphs without
//! copies.

use cudarc::driver::sys;

use crate::deferred::ErrorSlot;
// `bind_primary`, not `bind_context`, for the graph: an error deferred from elsewhere belongs to
// the next transport call, not to a replay (a launch is torch's replay's business).
use crate::driver::{bind_primary, check, Stream};
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

/// What a captured graph holds, by node kind (host-to-device copies apart from other copies), and
/// its edges: what a launch from the host pays for (PyTorch's launch costs per copy and memset node).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct GraphCensus {
    /// `(kind, count)`, sorted by kind.
    pub kinds: Vec<(&'static str, usize)>,
    /// Dependencies between nodes.
    pub edges: usize,
}

fn node_kind(raw: u32) -> &'static str {
    match raw {
        0 => "kernel",
        1 => "memcpy",
        2 => "memset",
        3 => "host",
        4 => "child_graph",
        5 => "empty",
        6 => "event_wait",
        7 => "event_record",
        8 | 9 => "semaphore",
        10 => "mem_alloc",
        11 => "mem_free",
        12 => "batch_mem_op",
        13 => "conditional",
        _ => "other",
    }
}

fn copy_kind(src: u32, dst: u32) -> &'static str {
    // CU_MEMORYTYPE_HOST = 1, _DEVICE = 2, _ARRAY = 3, _UNIFIED = 4 (a pointer the driver resolves:
    // the runtime's cudaMemcpyAsync may capture either side so)
    match (src, dst) {
        (1, 2) => "memcpy_htod",
        (2, 2) => "memcpy_dtod",
        (4, _) | (_, 4) => "memcpy_unified",
        _ => "memcpy_other",
    }
}

/// Counts the nodes of `graph` by kind and its edges.
///
/// # Safety
/// `graph` is a live `CUgraph` of device `ordinal`'s primary context, neither changed nor
/// destroyed during the call.
pub unsafe fn census(graph: u64, ordinal: usize) -> Result<GraphCensus> {
    let _ctx = bind_primary(ordinal)?;
    let g = graph as usize as sys::CUgraph;
    let mut n = 0usize;
    // SAFETY: a null node array asks for the count only; the caller guarantees `graph`.
    check(
        unsafe { sys::cuGraphGetNodes(g, std::ptr::null_mut(), &mut n) },
        "cuGraphGetNodes",
        "counting a graph's nodes",
    )?;
    let mut nodes: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); n];
    // SAFETY: `nodes` holds `n` entries, the count the driver gave for this unchanged graph.
    check(
        unsafe { sys::cuGraphGetNodes(g, nodes.as_mut_ptr(), &mut n) },
        "cuGraphGetNodes",
        "listing a graph's nodes",
    )?;
    nodes.truncate(n);
    let mut counts = std::collections::BTreeMap::<&'static str, usize>::new();
    for &node in &nodes {
        let mut raw = 0u32;
        // SAFETY: `node` belongs to the live graph; the kind is written as the enum's 32-bit value
        // and read as a plain integer, so a kind newer than these bindings is no invalid enum.
        check(
            unsafe { sys::cuGraphNodeGetType(node, (&mut raw as *mut u32).cast()) },
            "cuGraphNodeGetType",
            "reading a graph node's kind",
        )?;
        let mut kind = node_kind(raw);
        if raw == 1 {
            let mut params = std::mem::MaybeUninit::<sys::CUDA_MEMCPY3D>::zeroed();
            // SAFETY: a memcpy node of the live graph; the driver fills the whole struct, whose memory
            // types are read as plain integers (never as the enum).
            check(
                unsafe { sys::cuGraphMemcpyNodeGetParams(node, params.as_mut_ptr()) },
                "cuGraphMemcpyNodeGetParams",
                "reading a graph copy's parameters",
            )?;
            let p = params.as_ptr();
            // SAFETY: `p` points to the initialised struct above; the fields are 32-bit enums.
            let (src, dst) = unsafe {
                (
                    std::ptr::addr_of!((*p).srcMemoryType).cast::<u32>().read(),
                    std::ptr::addr_of!((*p).dstMemoryType).cast::<u32>().read(),
                )
            };
            kind = copy_kind(src, dst);
        }
        *counts.entry(kind).or_default() += 1;
    }
    let mut edges = 0usize;
    // SAFETY: null arrays ask for the count only.
    check(
        unsafe { sys::cuGraphGetEdges(g, std::ptr::null_mut(), std::ptr::null_mut(), &mut edges) },
        "cuGraphGetEdges",
        "counting a graph's edges",
    )?;
    Ok(GraphCensus {
        kinds: counts.into_iter().collect(),
        edges,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_and_copy_kinds_are_named() {
        assert_eq!(node_kind(0), "kernel");
        assert_eq!(node_kind(7), "event_record");
        assert_eq!(node_kind(99), "other");
        assert_eq!(copy_kind(1, 2), "memcpy_htod");
        assert_eq!(copy_kind(2, 2), "memcpy_dtod");
        assert_eq!(copy_kind(4, 2), "memcpy_unified");
        assert_eq!(copy_kind(2, 1), "memcpy_other");
    }
}

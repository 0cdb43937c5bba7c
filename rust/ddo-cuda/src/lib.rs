//! Every CUDA driver call and every `unsafe` block of ddo-blocks.
//!
//! The driver (`libcuda`) is loaded at run time through cudarc's dynamic loading, so this crate
//! builds and its CPU paths run on machines without CUDA; GPU functions then return
//! [`CudaError::NotAvailable`]. Contexts are never created here: the device's *primary* context is
//! retained, which is the one PyTorch's runtime uses, so streams and pointers from PyTorch are valid.
//!
//! Memory contract: every public function that takes addresses (`usize`) or stream handles is an
//! `unsafe fn` whose `# Safety` section says what the caller guarantees: the memory is owned by the
//! caller (tensors the Python engine keeps alive for as long as a copy may be in flight, see
//! [`Transport::drain`]) and a [`Stream`] holds a live handle ([`Stream::from_raw`]). Null and
//! wrapping ranges are refused with an error rather than trusted. This crate never frees memory it
//! did not allocate.

pub mod codec;
mod deferred;
mod driver;
mod error;
mod event;
mod graph;
mod host;
pub mod huffman;
mod job;
pub mod kernel;
mod reader;
mod readpool;
mod stager;
pub mod tiered;
mod transport;
mod vmm;

pub use deferred::{take_deferred_error, ErrorSlot};
pub use driver::{
    bind_context, compute_capability, device_count, driver_version, init, make_current,
    unavailable_reason, ContextGuard, Stream,
};
pub use error::{CudaError, Result};
pub use event::Event;
pub use graph::{census as graph_census, GraphCensus, GraphExec};
pub use host::{
    copy_host, copy_host_many, read_fd_into, read_file_into, HostBuffer, HostRegistration,
};
pub use job::{Staging, Target, MAX_STAGING_BUFFERS, MAX_THREADS};
pub use reader::{measure_read_bandwidth, DiskProbe};
pub use transport::{Transport, TransportStats};
pub use vmm::{VmmArena, VmmStats};

//! One copy job and the one sequence every job follows, whatever its source and its sink:
//!
//! ```text
//! wait consumed -> [pre-copy stage] -> copy(s) -> [post-copy stage] -> record arrived
//! ```
//!
//! A post-copy stage whose copies land in buffers of its own (a decode stage's landing ring) may
//! queue them before the wait for the slot ([`Stage::early`]) and order its own slot writes after
//! the slot's release on its stream: the link then runs ahead of the slot's last consumer.
//!
//! The transport's direct path and the staging ring both queue their copies through [`enqueue`].
//! A job whose bytes come in pieces (a unit read from files chunk by chunk, a pageable source
//! moved through the ring buffer by buffer) is enqueued as several [`Part`]s: the first waits for
//! the slot and runs the pre-copy stage, the last runs the post-copy stage and records arrival.
//!
//! The device-side steps (events, the copy stream) belong to a [`Lane`]: [`CudaLane`] on a GPU,
//! [`CpuLane`] for host slots (copies are `memcpy`, ordering is program order). Stages are hooks
//! for the routes to come: a VMM sink maps its pages before the copies (pre-copy), a compressed
//! source decodes after them (post-copy: the codec's `DecodeStage`).
//!
//! This module imports neither the transport nor the stager: both import it.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use cudarc::driver::sys;
use ddo_core::ReadChunk;

use crate::deferred::ErrorSlot;
use crate::driver::{check, Stream};
use crate::error::{CudaError, Result};
use crate::event::Event;
use crate::reader::ReadFile;

/// Where the slots live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Slots in ordinary host memory; copies are memcpy and complete before `fetch` returns.
    Cpu,
    /// Slots on CUDA device `ordinal`; copies are queued on `copy_stream` (a stream PyTorch owns).
    Cuda { ordinal: usize, copy_stream: Stream },
}

/// A bounded ring of staging buffers for sources that are not page-locked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Staging {
    pub buffers: usize,
    pub buffer_bytes: usize,
    /// Threads filling one buffer (pageable-to-pinned copies need several to reach the link).
    pub threads: usize,
    /// Page-lock the ring's buffers (always on the CUDA target unless a preset forbids it).
    pub pinned: bool,
    /// Pass host-address sources through the ring (they are pageable). When false they are
    /// page-locked and copied straight into the slot, in order with the file jobs (NVMe route).
    pub stage_host: bool,
    /// Bytes per parallel piece of a buffer's host copy (0: an even share per thread); see
    /// [`crate::host::copy_host_pieces`].
    pub piece_bytes: usize,
}

/// Most staging buffers and most threads per ring (presets use a few of each).
pub const MAX_STAGING_BUFFERS: usize = 1024;
pub const MAX_THREADS: usize = 1024;

/// Checks the slot count and the staging ring's shape before anything is allocated: a count or a
/// size from a caller must not reach an allocation that aborts the process.
pub(crate) fn check_config(slots: usize, staging: Option<&Staging>) -> Result<()> {
    let bad = |msg: String| Err(CudaError::InvalidArgument(msg));
    let max_slots = ddo_core::MAX_SLOTS;
    if !(1..=max_slots).contains(&slots) {
        return bad(format!(
            "a transport has 1 to {max_slots} slots, got {slots} (the planner's plan says how many)"
        ));
    }
    let Some(st) = staging else {
        return Ok(());
    };
    if !(1..=MAX_STAGING_BUFFERS).contains(&st.buffers) {
        return bad(format!(
            "a staging ring has 1 to {MAX_STAGING_BUFFERS} buffers, got {}",
            st.buffers
        ));
    }
    if st.threads > MAX_THREADS {
        return bad(format!(
            "a staging ring uses at most {MAX_THREADS} threads, got {}",
            st.threads
        ));
    }
    let total = st.buffers.checked_mul(st.buffer_bytes);
    if st.buffer_bytes == 0 || total.is_none_or(|t| t > isize::MAX as usize) {
        return bad(format!(
            "a staging ring of {} buffers of {} bytes: each buffer needs at least one byte and \
             the ring must fit in memory (a few buffers of 64 MiB are usual)",
            st.buffers, st.buffer_bytes
        ));
    }
    Ok(())
}

/// A unit streamed from files: its read plan, each chunk with the file it reads.
#[derive(Debug)]
pub(crate) struct FileUnit {
    pub chunks: Vec<(Arc<ReadFile>, ReadChunk)>,
    /// Bytes copied into the slot per fetch.
    pub copy_bytes: u64,
    /// Bytes read from disk per fetch (with alignment padding).
    pub read_bytes: u64,
    /// Bytes of the slot the unit writes: the end of its farthest piece.
    pub span: usize,
}

/// Where a job's bytes come from.
#[derive(Debug, Clone)]
pub(crate) enum Source {
    /// `n` bytes at host address `src`.
    Host { src: usize, n: usize },
    /// A unit read from its files.
    File(Arc<FileUnit>),
    // Compressed { .. }: compressed bytes in host memory, decoded by a post-copy stage.
}

/// Where a job's bytes land.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sink {
    /// Slot `slot` of the transport, at address `dst` (device memory on the CUDA target).
    Slot { slot: usize, dst: usize },
    // Vmm { .. }: pages of an arena, mapped by a pre-copy stage.
}

impl Sink {
    /// The slot whose events order the job.
    pub fn slot(&self) -> usize {
        match *self {
            Sink::Slot { slot, .. } => slot,
        }
    }

    /// The address the job's copies are relative to.
    pub fn addr(&self) -> usize {
        match *self {
            Sink::Slot { dst, .. } => dst,
        }
    }
}

/// Work a job queues before its copies (after the slot was consumed) or after them (before
/// arrival is recorded): a VMM page map, a decode kernel; a post-copy stage may also queue work
/// before the slot's wait ([`Stage::early`]). It runs on the thread that enqueues the
/// job and queues its device work on `copy_stream` (`None` on the CPU target: work is done now).
pub(crate) trait Stage: Send + Sync + std::fmt::Debug {
    fn run(&self, copy_stream: Option<Stream>, sink: &Sink) -> Result<()>;
    /// The stream whose work so far makes the slot ready, when it is not the copy stream (a
    /// decode stage that ordered the copies before its last decode): arrival is recorded there.
    fn arrival_stream(&self) -> Option<Stream> {
        None
    }
    /// For a post-copy stage whose copies land in buffers of its own (a decode stage's landing
    /// buffers): queues that work before the copy stream waits for the slot, so that the link
    /// moves it while the slot's last consumer still runs, and returns whether it did (the stage
    /// itself remembers it: its `run` then queues only what is left). The stage writes no byte of the slot before the work it makes
    /// `wait_slot(stream)` order after the slot's release. [`enqueue`] calls it only for a job
    /// queued whole with no pre-copy stage.
    fn early(
        &self,
        copy_stream: Option<Stream>,
        sink: &Sink,
        wait_slot: &dyn Fn(Stream) -> Result<()>,
    ) -> Result<bool> {
        let _ = (copy_stream, sink, wait_slot);
        Ok(false)
    }
}

/// One fetch: a source, a sink and the optional stages around the copies.
#[derive(Debug, Clone)]
pub(crate) struct Job {
    pub source: Source,
    pub sink: Sink,
    pub pre_copy: Option<Arc<dyn Stage>>,
    pub post_copy: Option<Arc<dyn Stage>>,
}

impl Job {
    /// A job with no stages (every route today).
    pub fn new(source: Source, sink: Sink) -> Self {
        Self {
            source,
            sink,
            pre_copy: None,
            post_copy: None,
        }
    }
}

/// `len` bytes from host address `src` to `offset` bytes into the job's sink.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    pub offset: usize,
    pub src: usize,
    pub len: usize,
}

/// The piece of a job that [`enqueue`] queues now.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Part<'a> {
    pub job: &'a Job,
    /// The job's first part: wait for the slot, then run the pre-copy stage.
    pub first: bool,
    /// The job's last part: run the post-copy stage, then record arrival.
    pub last: bool,
    /// The staging buffer the part's copies read: its upload is recorded after them.
    pub buffer: Option<usize>,
}

impl<'a> Part<'a> {
    /// A job queued in one go.
    pub fn whole(job: &'a Job) -> Self {
        Self {
            job,
            first: true,
            last: true,
            buffer: None,
        }
    }
}

/// The device side of one transport: how a copy is queued and how slots and staging buffers are
/// ordered against it (copy side) and against compute (compute side).
pub(crate) trait Lane: Send + Sync {
    /// The stream copies are queued on (`None` on the CPU target: copies are done in place).
    fn stream(&self) -> Option<Stream>;
    /// Orders the copies queued next after the slot's last release (GPU side).
    fn wait_consumed(&self, slot: usize) -> Result<()>;
    /// Orders the work queued next on `stream` (a stage's) after the slot's last release.
    fn wait_consumed_on(&self, slot: usize, stream: Stream) -> Result<()> {
        let _ = stream;
        self.wait_consumed(slot)
    }
    /// Orders the copies queued next after the slot's previous arrival, when that was recorded on
    /// another stream than the copies' (a decode stream's: see [`enqueue`]).
    fn wait_prior_arrival(&self, slot: usize) -> Result<()> {
        let _ = slot;
        Ok(())
    }
    /// Queues (CUDA) or runs (CPU) a copy of `n` bytes from host address `src` to `dst`.
    ///
    /// # Safety
    /// `src` is `n` readable host bytes and `dst` is `n` writable bytes of the target's memory (a
    /// device address on the CUDA target), disjoint, both allocated until the copy completed (the
    /// job's arrival, [`Lane::synchronize`]) and not written by anyone else meanwhile.
    unsafe fn copy(&self, dst: usize, src: usize, n: usize) -> Result<()>;
    /// Marks the copies queued so far as the last ones reading staging buffer `buffer`.
    fn record_uploaded(&self, buffer: usize) -> Result<()>;
    /// Blocks the host until the uploads out of staging buffer `buffer` have completed.
    fn wait_uploaded(&self, buffer: usize) -> Result<()>;
    /// Marks the copies queued so far as the slot's contents.
    fn record_arrived(&self, slot: usize) -> Result<()>;
    /// Marks the work queued so far on `stream` (a post-copy stage's) as the slot's contents.
    fn record_arrived_on(&self, slot: usize, stream: Stream) -> Result<()> {
        let _ = stream;
        self.record_arrived(slot)
    }
    /// Marks the slot consumed and arrived by the work queued so far on `stream` (after a CUDA
    /// graph: its copies and its use of the slot are that work). The release recorded at the same
    /// point orders later copies, so this arrival is not "on another stream" for
    /// [`Lane::wait_prior_arrival`].
    fn fence(&self, slot: usize, stream: Stream) -> Result<()> {
        self.release(slot, stream)?;
        self.record_arrived_on(slot, stream)
    }
    /// Makes `compute` wait until the slot's contents have arrived (GPU side).
    fn acquire(&self, slot: usize, compute: Stream) -> Result<()>;
    /// Marks the slot as consumed by the work queued so far on `compute`.
    fn release(&self, slot: usize, compute: Stream) -> Result<()>;
    /// Blocks the host until every copy queued so far has completed.
    fn synchronize(&self) -> Result<()>;
}

/// Queues one part of a job: wait consumed -> [pre-copy stage] -> `copies` -> [post-copy stage]
/// -> record arrived, the first two steps only in the job's first part, the last two only in its
/// last. The first part also orders the copy stream after the slot's previous arrival when that
/// was recorded on another stream (a decode): a fetch dropped before it was consumed (a miss, a
/// new order) has no release, and its decodes must not overlap the next job's raw copies. The
/// staging buffer's upload is recorded after the copies even when one failed: the copies queued
/// before it still read the buffer, and shutdown waits on that record before the ring is unmapped.
/// Nothing after a failed step is queued; a job whose early stage ran and a later step failed
/// still records the stage's arrival (its decodes' end), so the slot's next job waits for them.
/// A job whose early stage carries all of it (no `copies` of its own) queues neither slot wait on
/// the copy stream: the stage's stream waited for the slot itself, and its writes follow the slot's
/// earlier ones in that stream's order or behind the copy stream's events it waits on.
///
/// # Safety
/// Each copy reads `len` bytes at host address `src` and writes `len` bytes at
/// `part.job.sink.addr() + offset`; both ranges must satisfy [`Lane::copy`]'s contract.
pub(crate) unsafe fn enqueue(
    lane: &dyn Lane,
    part: Part<'_>,
    copies: impl IntoIterator<Item = Span>,
) -> Result<()> {
    let job = part.job;
    let slot = job.sink.slot();
    let mut early = None;
    if part.first {
        if let (true, None, Some(stage)) = (part.last, &job.pre_copy, &job.post_copy) {
            match stage.early(lane.stream(), &job.sink, &|s| {
                lane.wait_consumed_on(slot, s)
            }) {
                Ok(true) => early = Some(stage),
                Ok(false) => {}
                Err(e) => {
                    // some of its decodes may be queued: the slot's next job waits for them
                    if let Some(stream) = stage.arrival_stream() {
                        let _ = lane.record_arrived_on(slot, stream);
                    }
                    return Err(e);
                }
            }
        }
    }
    let mut copies = copies.into_iter().peekable();
    // An early stage that carries every byte of the job (a coded unit whose pieces all travel in
    // the landing ring) orders its own slot writes after the slot's release: the copy stream then
    // waits for no slot, and the link moves the next jobs while this slot is still in use.
    let slot_waits = early.is_none() || copies.peek().is_some();
    // SAFETY: the caller's contract, passed on.
    let rest = unsafe { enqueue_rest(lane, part, copies, slot_waits) };
    if let (Err(_), Some(stage)) = (&rest, early) {
        if let Some(stream) = stage.arrival_stream() {
            let _ = lane.record_arrived_on(slot, stream); // the first error is the one to report
        }
    }
    rest
}

/// [`enqueue`] after an early stage: the slot's waits, the pre-copy stage, the copies, the
/// post-copy stage and arrival.
///
/// # Safety
/// As [`enqueue`].
unsafe fn enqueue_rest(
    lane: &dyn Lane,
    part: Part<'_>,
    copies: impl IntoIterator<Item = Span>,
    slot_waits: bool,
) -> Result<()> {
    let job = part.job;
    let slot = job.sink.slot();
    if part.first {
        if slot_waits {
            lane.wait_consumed(slot)?;
            lane.wait_prior_arrival(slot)?;
        }
        if let Some(stage) = &job.pre_copy {
            stage.run(lane.stream(), &job.sink)?;
        }
    }
    let base = job.sink.addr();
    let copied = copies.into_iter().try_for_each(|c| {
        // SAFETY: the caller upholds `Lane::copy`'s contract for every copy of the part.
        unsafe { lane.copy(base + c.offset, c.src, c.len) }
    });
    let recorded = part.buffer.map_or(Ok(()), |b| lane.record_uploaded(b));
    copied?;
    recorded?;
    if part.last {
        let mut arrival = None;
        if let Some(stage) = &job.post_copy {
            stage.run(lane.stream(), &job.sink)?;
            arrival = stage.arrival_stream();
        }
        match arrival {
            Some(stream) => lane.record_arrived_on(slot, stream)?,
            None => lane.record_arrived(slot)?,
        }
    }
    Ok(())
}

/// Host slots: copies are `memcpy` (in parallel on the calling thread's rayon pool when large) and
/// complete before they return, so there is nothing to order.
#[derive(Debug, Default)]
pub(crate) struct CpuLane;

impl Lane for CpuLane {
    fn stream(&self) -> Option<Stream> {
        None
    }
    fn wait_consumed(&self, _slot: usize) -> Result<()> {
        Ok(())
    }
    unsafe fn copy(&self, dst: usize, src: usize, n: usize) -> Result<()> {
        // SAFETY: the caller guarantees both ranges are live, `n` bytes long and disjoint.
        unsafe { crate::host::copy_host(dst, src, n) };
        Ok(())
    }
    fn record_uploaded(&self, _buffer: usize) -> Result<()> {
        Ok(())
    }
    fn wait_uploaded(&self, _buffer: usize) -> Result<()> {
        Ok(())
    }
    fn record_arrived(&self, _slot: usize) -> Result<()> {
        Ok(())
    }
    fn acquire(&self, _slot: usize, _compute: Stream) -> Result<()> {
        Ok(())
    }
    fn release(&self, _slot: usize, _compute: Stream) -> Result<()> {
        Ok(())
    }
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
}

/// The two events of each slot. `arrived[s]` is recorded after a unit's bytes were queued into
/// slot `s` (on the copy stream, or on a post-copy stage's stream: a decode); compute waits on it.
/// `consumed[s]` is recorded on the compute stream after the unit ran; the next copies into the
/// slot (and an early stage's decodes) wait on it. The host never waits for either.
/// `arrived_elsewhere[s]`: the last arrival was recorded on another stream than the copy stream.
pub(crate) struct SlotEvents {
    pub arrived: Vec<Event>,
    pub consumed: Vec<Event>,
    pub arrived_elsewhere: Vec<std::sync::atomic::AtomicBool>,
}

/// GPU slots: copies queued on `copy_stream`, ordered by the slots' events and by one event per
/// staging buffer (its last upload). Every call needs the target's context current; dropping
/// binds it (as cudarc does before destroying an event).
pub(crate) struct CudaLane {
    ordinal: usize,
    copy_stream: Stream,
    slots: SlotEvents,
    uploaded: Vec<Event>,
    errors: ErrorSlot,
}

impl CudaLane {
    /// Creates the events of `slots` slots and `buffers` staging buffers in the current context,
    /// the primary context of device `ordinal` (failures to destroy them go to `errors`).
    pub fn new(
        ordinal: usize,
        copy_stream: Stream,
        slots: usize,
        buffers: usize,
        errors: &ErrorSlot,
    ) -> Result<Self> {
        let mk = |n: usize| Event::many(n, errors);
        Ok(Self {
            ordinal,
            copy_stream,
            slots: SlotEvents {
                arrived: mk(slots)?,
                consumed: mk(slots)?,
                arrived_elsewhere: (0..slots)
                    .map(|_| std::sync::atomic::AtomicBool::new(false))
                    .collect(),
            },
            uploaded: mk(buffers)?,
            errors: errors.clone(),
        })
    }

    fn buffer(&self, buffer: usize) -> Result<&Event> {
        self.uploaded.get(buffer).ok_or_else(|| {
            CudaError::InvalidArgument(format!(
                "staging buffer {buffer} out of range ({} buffers)",
                self.uploaded.len()
            ))
        })
    }
}

impl Drop for CudaLane {
    fn drop(&mut self) {
        crate::event::destroy_bound(
            self.ordinal,
            &self.errors,
            &mut [
                &mut self.slots.arrived,
                &mut self.slots.consumed,
                &mut self.uploaded,
            ],
        );
    }
}

impl Lane for CudaLane {
    fn stream(&self) -> Option<Stream> {
        Some(self.copy_stream)
    }
    fn wait_consumed(&self, slot: usize) -> Result<()> {
        self.slots.consumed[slot].wait_on(self.copy_stream)
    }
    fn wait_consumed_on(&self, slot: usize, stream: Stream) -> Result<()> {
        self.slots.consumed[slot].wait_on(stream)
    }
    unsafe fn copy(&self, dst: usize, src: usize, n: usize) -> Result<()> {
        // SAFETY: the caller upholds the contract of `Lane::copy`, which is `h2d_async`'s.
        unsafe { h2d_async(dst, src, n, self.copy_stream) }
    }
    fn record_uploaded(&self, buffer: usize) -> Result<()> {
        self.buffer(buffer)?.record(self.copy_stream)
    }
    fn wait_uploaded(&self, buffer: usize) -> Result<()> {
        self.buffer(buffer)?.synchronize()
    }
    fn wait_prior_arrival(&self, slot: usize) -> Result<()> {
        if self.slots.arrived_elsewhere[slot].load(Ordering::Relaxed) {
            self.slots.arrived[slot].wait_on(self.copy_stream)?;
        }
        Ok(())
    }
    fn record_arrived(&self, slot: usize) -> Result<()> {
        self.slots.arrived[slot].record(self.copy_stream)?;
        self.slots.arrived_elsewhere[slot].store(false, Ordering::Relaxed);
        Ok(())
    }
    fn record_arrived_on(&self, slot: usize, stream: Stream) -> Result<()> {
        self.slots.arrived[slot].record(stream)?;
        let other = stream.handle() != self.copy_stream.handle();
        self.slots.arrived_elsewhere[slot].store(other, Ordering::Relaxed);
        Ok(())
    }
    fn fence(&self, slot: usize, stream: Stream) -> Result<()> {
        self.slots.consumed[slot].record(stream)?;
        self.slots.arrived[slot].record(stream)?;
        self.slots.arrived_elsewhere[slot].store(false, Ordering::Relaxed);
        Ok(())
    }
    fn acquire(&self, slot: usize, compute: Stream) -> Result<()> {
        self.slots.arrived[slot].wait_on(compute)
    }
    fn release(&self, slot: usize, compute: Stream) -> Result<()> {
        self.slots.consumed[slot].record(compute)
    }
    fn synchronize(&self) -> Result<()> {
        crate::driver::synchronize_stream(self.copy_stream, "draining copies")
    }
}

/// Queues an asynchronous host-to-device copy of `n` bytes on `stream`.
///
/// # Safety
/// `src` is `n` live host bytes (page-locked for the copy to be truly asynchronous: a pageable
/// source is copied by the driver before this returns) that stay allocated and unmodified until
/// the copy completes; `dst` is `n` bytes of device memory of the current context that stay
/// allocated until then; `stream` is a live stream of the current context (or 0).
pub(crate) unsafe fn h2d_async(dst: usize, src: usize, n: usize, stream: Stream) -> Result<()> {
    // SAFETY: the caller upholds the contract above.
    let code = unsafe {
        sys::cuMemcpyHtoDAsync_v2(
            dst as sys::CUdeviceptr,
            src as *const std::ffi::c_void,
            n,
            stream.raw(),
        )
    };
    check(
        code,
        "cuMemcpyHtoDAsync",
        &format!("copying {n} bytes to the GPU"),
    )
}

/// Queues a copy of `n` bytes from device address `src` to device address `dst` on `stream`.
///
/// # Safety
/// `src` and `dst` are `n` bytes of device memory of the current context, disjoint, allocated until
/// the copy completes; nothing else writes `src` or touches `dst` meanwhile; `stream` is a live
/// stream of the current context (or 0).
pub(crate) unsafe fn d2d_async(dst: usize, src: usize, n: usize, stream: Stream) -> Result<()> {
    // SAFETY: the caller upholds the contract above.
    let code = unsafe {
        sys::cuMemcpyDtoDAsync_v2(
            dst as sys::CUdeviceptr,
            src as sys::CUdeviceptr,
            n,
            stream.raw(),
        )
    };
    check(
        code,
        "cuMemcpyDtoDAsync",
        &format!("copying {n} bytes on the GPU"),
    )
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::sync::Mutex;

    /// One step a lane or a stage was asked for.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(crate) enum Op {
        Wait(usize),
        Pre(usize),
        Copy {
            dst: usize,
            src: usize,
            n: usize,
        },
        Post(usize),
        Uploaded(usize),
        WaitUploaded(usize),
        Arrived(usize),
        ArrivedOn(usize, u64),
        /// An early stage's work (its landing copies).
        Early(usize),
        /// A stage's stream ordered after the slot's release.
        WaitOn(usize, u64),
        /// The copies ordered after the slot's previous arrival on another stream.
        WaitPriorArrival(usize),
    }

    /// A CPU lane that really copies and logs every step; copies fail on request.
    #[derive(Default)]
    pub(crate) struct Recorder {
        pub log: Arc<Mutex<Vec<Op>>>,
        pub fail_copies: std::sync::atomic::AtomicBool,
        /// Slots whose last arrival was recorded on a stage's stream.
        elsewhere: Mutex<std::collections::HashSet<usize>>,
    }

    impl Recorder {
        pub fn ops(&self) -> Vec<Op> {
            self.log.lock().unwrap().clone()
        }
        fn push(&self, op: Op) {
            self.log.lock().unwrap().push(op);
        }
    }

    impl Lane for Recorder {
        fn stream(&self) -> Option<Stream> {
            None
        }
        fn wait_consumed(&self, slot: usize) -> Result<()> {
            self.push(Op::Wait(slot));
            Ok(())
        }
        fn wait_consumed_on(&self, slot: usize, stream: Stream) -> Result<()> {
            self.push(Op::WaitOn(slot, stream.handle()));
            Ok(())
        }
        unsafe fn copy(&self, dst: usize, src: usize, n: usize) -> Result<()> {
            self.push(Op::Copy { dst, src, n });
            if self.fail_copies.load(std::sync::atomic::Ordering::Relaxed) {
                return Err(CudaError::Staging("copy refused by the test".into()));
            }
            // SAFETY: the caller upholds `Lane::copy`'s contract.
            unsafe { CpuLane.copy(dst, src, n) }
        }
        fn record_uploaded(&self, buffer: usize) -> Result<()> {
            self.push(Op::Uploaded(buffer));
            Ok(())
        }
        fn wait_uploaded(&self, buffer: usize) -> Result<()> {
            self.push(Op::WaitUploaded(buffer));
            Ok(())
        }
        fn wait_prior_arrival(&self, slot: usize) -> Result<()> {
            if self.elsewhere.lock().unwrap().contains(&slot) {
                self.push(Op::WaitPriorArrival(slot));
            }
            Ok(())
        }
        fn record_arrived(&self, slot: usize) -> Result<()> {
            self.push(Op::Arrived(slot));
            self.elsewhere.lock().unwrap().remove(&slot);
            Ok(())
        }
        fn record_arrived_on(&self, slot: usize, stream: Stream) -> Result<()> {
            self.push(Op::ArrivedOn(slot, stream.handle()));
            self.elsewhere.lock().unwrap().insert(slot);
            Ok(())
        }
        fn acquire(&self, _slot: usize, _compute: Stream) -> Result<()> {
            Ok(())
        }
        fn release(&self, _slot: usize, _compute: Stream) -> Result<()> {
            Ok(())
        }
        fn synchronize(&self) -> Result<()> {
            Ok(())
        }
    }

    /// A stage that logs itself (`Pre`/`Post` with the sink's slot), or fails.
    #[derive(Debug)]
    struct Logged {
        log: Arc<Mutex<Vec<Op>>>,
        pre: bool,
        fail: bool,
    }

    impl Stage for Logged {
        fn run(&self, _copy_stream: Option<Stream>, sink: &Sink) -> Result<()> {
            let op = if self.pre { Op::Pre } else { Op::Post };
            self.log.lock().unwrap().push(op(sink.slot()));
            if self.fail {
                return Err(CudaError::Staging("stage refused by the test".into()));
            }
            Ok(())
        }
    }

    fn staged_job(rec: &Recorder, dst: usize, fail_pre: bool) -> Job {
        let stage = |pre, fail| {
            Some(Arc::new(Logged {
                log: Arc::clone(&rec.log),
                pre,
                fail,
            }) as Arc<dyn Stage>)
        };
        Job {
            source: Source::Host { src: 0, n: 0 },
            sink: Sink::Slot { slot: 1, dst },
            pre_copy: stage(true, fail_pre),
            post_copy: stage(false, false),
        }
    }

    #[test]
    fn a_whole_job_waits_maps_copies_decodes_and_arrives_in_that_order() {
        let rec = Recorder::default();
        let src = [7u8; 64];
        let mut dst = [0u8; 80];
        let job = staged_job(&rec, dst.as_mut_ptr() as usize, false);
        let c = |offset, len| Span {
            offset,
            src: src.as_ptr() as usize,
            len,
        };
        // SAFETY: both copies read `src` and write inside `dst`, disjoint, live for the call.
        unsafe { enqueue(&rec, Part::whole(&job), [c(0, 16), c(40, 40)]) }.unwrap();
        let d = dst.as_ptr() as usize;
        let s = src.as_ptr() as usize;
        assert_eq!(
            rec.ops(),
            [
                Op::Wait(1),
                Op::Pre(1),
                Op::Copy {
                    dst: d,
                    src: s,
                    n: 16
                },
                Op::Copy {
                    dst: d + 40,
                    src: s,
                    n: 40
                },
                Op::Post(1),
                Op::Arrived(1)
            ]
        );
        assert!(dst[..16].iter().all(|&b| b == 7) && dst[16..40].iter().all(|&b| b == 0));
        assert!(dst[40..].iter().all(|&b| b == 7));
    }

    #[test]
    fn parts_wait_once_record_each_buffer_and_arrive_once() {
        let rec = Recorder::default();
        let src = [3u8; 30];
        let mut dst = [0u8; 30];
        let job = staged_job(&rec, dst.as_mut_ptr() as usize, false);
        for (k, b) in [(0usize, 2usize), (1, 0), (2, 1)] {
            let part = Part {
                job: &job,
                first: k == 0,
                last: k == 2,
                buffer: Some(b),
            };
            let copy = Span {
                offset: 10 * k,
                src: src.as_ptr() as usize + 10 * k,
                len: 10,
            };
            // SAFETY: each part copies a disjoint tenth of `src` into the same tenth of `dst`.
            unsafe { enqueue(&rec, part, [copy]) }.unwrap();
        }
        let kinds: Vec<String> = rec
            .ops()
            .iter()
            .map(|op| match op {
                Op::Copy { .. } => "copy".to_string(),
                other => format!("{other:?}"),
            })
            .collect();
        assert_eq!(
            kinds,
            [
                "Wait(1)",
                "Pre(1)",
                "copy",
                "Uploaded(2)",
                "copy",
                "Uploaded(0)",
                "copy",
                "Uploaded(1)",
                "Post(1)",
                "Arrived(1)"
            ]
        );
        assert_eq!(dst, src);
    }

    #[test]
    fn a_failed_copy_still_records_its_buffer_and_never_arrives() {
        let rec = Recorder::default();
        rec.fail_copies
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let src = [1u8; 8];
        let mut dst = [0u8; 8];
        let job = staged_job(&rec, dst.as_mut_ptr() as usize, false);
        let part = Part {
            buffer: Some(0),
            ..Part::whole(&job)
        };
        let copy = Span {
            offset: 0,
            src: src.as_ptr() as usize,
            len: 8,
        };
        // SAFETY: `src` and `dst` are 8 live, disjoint bytes.
        let err = unsafe { enqueue(&rec, part, [copy, copy]) }.unwrap_err();
        assert!(err.to_string().contains("refused by the test"), "{err}");
        let ops = rec.ops();
        assert_eq!(ops.len(), 4, "{ops:?}"); // wait, pre, the first copy, the buffer's record
        assert_eq!(ops[3], Op::Uploaded(0));
        assert!(!ops.contains(&Op::Arrived(1)) && !ops.contains(&Op::Post(1)));
    }

    #[test]
    fn a_failed_pre_copy_stage_queues_no_copy() {
        let rec = Recorder::default();
        let src = [1u8; 8];
        let mut dst = [0u8; 8];
        let job = staged_job(&rec, dst.as_mut_ptr() as usize, true);
        let copy = Span {
            offset: 0,
            src: src.as_ptr() as usize,
            len: 8,
        };
        // SAFETY: `src` and `dst` are 8 live, disjoint bytes.
        assert!(unsafe { enqueue(&rec, Part::whole(&job), [copy]) }.is_err());
        assert_eq!(rec.ops(), [Op::Wait(1), Op::Pre(1)]);
        assert_eq!(dst, [0; 8]);
    }

    /// A post-copy stage whose own stream makes the slot ready (a decode).
    #[derive(Debug)]
    struct OnItsStream;

    impl Stage for OnItsStream {
        fn run(&self, _copy_stream: Option<Stream>, _sink: &Sink) -> Result<()> {
            Ok(())
        }
        fn arrival_stream(&self) -> Option<Stream> {
            // SAFETY: the handle only reaches the recording lane, never the driver.
            Some(unsafe { Stream::from_raw(42) })
        }
    }

    #[test]
    fn a_stage_with_its_own_stream_records_arrival_there() {
        let rec = Recorder::default();
        let mut job = Job::new(
            Source::Host { src: 0, n: 0 },
            Sink::Slot { slot: 3, dst: 0 },
        );
        job.post_copy = Some(Arc::new(OnItsStream));
        // SAFETY: no copy.
        unsafe { enqueue(&rec, Part::whole(&job), []) }.unwrap();
        assert_eq!(rec.ops(), [Op::Wait(3), Op::ArrivedOn(3, 42)]);
    }

    /// A post-copy stage that queues its own copies early and orders its stream after the slot.
    #[derive(Debug)]
    struct Early {
        log: Arc<Mutex<Vec<Op>>>,
    }

    impl Stage for Early {
        fn run(&self, _copy_stream: Option<Stream>, sink: &Sink) -> Result<()> {
            self.log.lock().unwrap().push(Op::Post(sink.slot()));
            Ok(())
        }
        fn early(
            &self,
            _copy_stream: Option<Stream>,
            sink: &Sink,
            wait_slot: &dyn Fn(Stream) -> Result<()>,
        ) -> Result<bool> {
            // SAFETY: the handle only reaches the recording lane, never the driver.
            wait_slot(unsafe { Stream::from_raw(7) })?;
            self.log.lock().unwrap().push(Op::Early(sink.slot()));
            Ok(true)
        }
        fn arrival_stream(&self) -> Option<Stream> {
            // SAFETY: the handle only reaches the recording lane, never the driver.
            Some(unsafe { Stream::from_raw(7) })
        }
    }

    /// A job into `slot` at `dst` with no stage.
    fn plain_job(slot: usize, dst: usize) -> Job {
        Job::new(Source::Host { src: 0, n: 0 }, Sink::Slot { slot, dst })
    }

    /// A job into `slot` at `dst` whose post-copy stage is [`Early`], logging to `rec`.
    fn early_job(rec: &Recorder, slot: usize, dst: usize) -> Job {
        let mut job = plain_job(slot, dst);
        job.post_copy = Some(Arc::new(Early {
            log: Arc::clone(&rec.log),
        }));
        job
    }

    #[test]
    fn an_early_stage_queues_before_the_slot_wait_and_orders_its_stream_after_the_slot() {
        let rec = Recorder::default();
        let src = [5u8; 8];
        let mut dst = [0u8; 8];
        let mut job = early_job(&rec, 2, dst.as_mut_ptr() as usize);
        let copy = Span {
            offset: 0,
            src: src.as_ptr() as usize,
            len: 8,
        };
        // SAFETY: `src` and `dst` are 8 live, disjoint bytes.
        unsafe { enqueue(&rec, Part::whole(&job), [copy]) }.unwrap();
        let (d, s) = (dst.as_ptr() as usize, src.as_ptr() as usize);
        assert_eq!(
            rec.ops(),
            [
                Op::WaitOn(2, 7),
                Op::Early(2),
                Op::Wait(2),
                Op::Copy {
                    dst: d,
                    src: s,
                    n: 8
                },
                Op::Post(2),
                Op::ArrivedOn(2, 7)
            ]
        );
        // the slot's next job, a plain one, orders its copies after that arrival on the other stream
        let plain = plain_job(2, dst.as_mut_ptr() as usize);
        rec.log.lock().unwrap().clear();
        // SAFETY: as above.
        unsafe { enqueue(&rec, Part::whole(&plain), [copy]) }.unwrap();
        let copied = Op::Copy {
            dst: d,
            src: s,
            n: 8,
        };
        assert_eq!(
            rec.ops(),
            [Op::Wait(2), Op::WaitPriorArrival(2), copied, Op::Arrived(2)]
        );
        // a job whose early stage ran and whose copy failed still records the decodes' end
        rec.fail_copies
            .store(true, std::sync::atomic::Ordering::Relaxed);
        rec.log.lock().unwrap().clear();
        // SAFETY: as above.
        assert!(unsafe { enqueue(&rec, Part::whole(&job), [copy]) }.is_err());
        assert_eq!(
            rec.ops(),
            [
                Op::WaitOn(2, 7),
                Op::Early(2),
                Op::Wait(2),
                copied,
                Op::ArrivedOn(2, 7)
            ]
        );
        rec.fail_copies
            .store(false, std::sync::atomic::Ordering::Relaxed);
        // in parts (a staged job), or behind a pre-copy stage (a page map), it is not early
        let rec = Recorder::default();
        job.post_copy = Some(Arc::new(Early {
            log: Arc::clone(&rec.log),
        }));
        let part = Part {
            job: &job,
            first: true,
            last: false,
            buffer: None,
        };
        // SAFETY: as above.
        unsafe { enqueue(&rec, part, [copy]) }.unwrap();
        assert_eq!(
            rec.ops(),
            [
                Op::Wait(2),
                Op::Copy {
                    dst: d,
                    src: s,
                    n: 8
                }
            ]
        );
        let rec = Recorder::default();
        let mut staged = staged_job(&rec, d, false);
        staged.post_copy = Some(Arc::new(Early {
            log: Arc::clone(&rec.log),
        }));
        // SAFETY: no copy.
        unsafe { enqueue(&rec, Part::whole(&staged), []) }.unwrap();
        assert_eq!(
            rec.ops(),
            [Op::Wait(1), Op::Pre(1), Op::Post(1), Op::ArrivedOn(1, 7)]
        );
    }

    #[test]
    fn an_early_stage_that_carries_every_byte_leaves_the_copy_stream_free_of_slot_waits() {
        // a coded unit whose raw pieces travel in the landing ring too: the stage's stream waits
        // for the slot, the copy stream waits for nothing, so the next job's early copies are not
        // held behind this slot's consumer
        let rec = Recorder::default();
        let mut dst = [0u8; 8];
        let job = early_job(&rec, 3, dst.as_mut_ptr() as usize);
        // SAFETY: no copy.
        unsafe { enqueue(&rec, Part::whole(&job), []) }.unwrap();
        assert_eq!(
            rec.ops(),
            [
                Op::WaitOn(3, 7),
                Op::Early(3),
                Op::Post(3),
                Op::ArrivedOn(3, 7)
            ]
        );
        // twice in a row into the same slot: still no wait on the copy stream (the stage's stream
        // orders its own writes after the previous ones)
        rec.log.lock().unwrap().clear();
        // SAFETY: no copy.
        unsafe { enqueue(&rec, Part::whole(&job), []) }.unwrap();
        assert!(!rec
            .ops()
            .iter()
            .any(|op| matches!(op, Op::Wait(_) | Op::WaitPriorArrival(_))));
        // a plain job after it waits for the slot and for that arrival on the other stream
        let src = [1u8; 8];
        let plain = plain_job(3, dst.as_mut_ptr() as usize);
        rec.log.lock().unwrap().clear();
        let copy = Span {
            offset: 0,
            src: src.as_ptr() as usize,
            len: 8,
        };
        // SAFETY: `src` and `dst` are 8 live, disjoint bytes.
        unsafe { enqueue(&rec, Part::whole(&plain), [copy]) }.unwrap();
        assert_eq!(rec.ops()[..2], [Op::Wait(3), Op::WaitPriorArrival(3)]);
    }

    #[test]
    fn an_empty_job_still_waits_and_arrives() {
        let rec = Recorder::default();
        let job = Job::new(
            Source::Host { src: 0, n: 0 },
            Sink::Slot { slot: 0, dst: 0 },
        );
        // SAFETY: no copy.
        unsafe { enqueue(&rec, Part::whole(&job), []) }.unwrap();
        assert_eq!(rec.ops(), [Op::Wait(0), Op::Arrived(0)]);
    }
}

//! The staging ring: a background thread that moves pageable host bytes through a bounded ring of
//! small page-locked buffers into GPU slots (or, on the CPU target, through ordinary buffers into
//! host slots). Used by presets that do not page-lock the weights themselves.
//!
//! A job's source is either a host address or, for the NVMe route, a [`FileUnit`]: the unit's
//! coalesced, aligned read plan over its files. File chunks are read by the reader pool straight
//! into a ring buffer (`O_DIRECT` where allowed) and copied from there into the slot, so disk
//! reads, host-to-device copies and compute overlap. With `stage_host` off, host-address jobs
//! (page-locked RAM-cache slabs) are copied straight to the slot by this thread, in FIFO order
//! with the file jobs.
//!
//! Ordering: for each job the thread makes the copy stream wait for the slot's "consumed" event,
//! then for each chunk waits (host side) until the buffer's previous upload finished, fills it on a
//! dedicated rayon pool, queues the upload and records the buffer's event; at the end it records
//! the slot's "arrived" event. The compute stream never waits on the host.

use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use ddo_core::ReadChunk;

use crate::driver::make_current;
use crate::error::{CudaError, Result};
use crate::event::Event;
use crate::host::{copy_host, HostBuffer};
use crate::reader::ReadFile;
use crate::transport::{h2d_async, SlotEvents, Staging, Target};

/// A unit streamed from files: its read plan, each chunk with the file it reads.
#[derive(Debug)]
pub(crate) struct FileUnit {
    pub chunks: Vec<(Arc<ReadFile>, ReadChunk)>,
    /// Bytes copied into the slot per fetch.
    pub copy_bytes: u64,
    /// Bytes read from disk per fetch (with alignment padding).
    pub read_bytes: u64,
}

#[derive(Debug, Clone)]
pub(crate) enum Source {
    /// `n` bytes at a host address.
    Host(usize),
    /// A unit read from its files.
    File(Arc<FileUnit>),
}

#[derive(Debug, Clone)]
pub(crate) struct Job {
    pub slot: usize,
    pub dst: usize,
    pub n: usize,
    pub source: Source,
}

#[derive(Default)]
struct State {
    done: u64,
    error: Option<CudaError>,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    cv: Condvar,
}

pub(crate) struct Stager {
    tx: Option<mpsc::Sender<Job>>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    submitted: u64,
}

struct Ring {
    buffers: Vec<HostBuffer>,
    /// One event per buffer on the CUDA target: its last upload.
    uploaded: Vec<Event>,
    next: usize,
    /// Host-address jobs pass through the ring (pageable sources); else straight to the slot.
    stage_host: bool,
}

impl Ring {
    /// The next buffer, once its previous upload has finished.
    fn take(&mut self) -> Result<usize> {
        let b = self.next;
        self.next = (self.next + 1) % self.buffers.len();
        if let Some(ev) = self.uploaded.get(b) {
            ev.synchronize()?;
        }
        Ok(b)
    }
}

impl Stager {
    /// Allocates the ring on the calling thread (whose current context is the target's) and starts
    /// the worker thread.
    pub fn start(
        target: Target,
        events: Option<Arc<SlotEvents>>,
        staging: Staging,
    ) -> Result<Self> {
        if staging.buffers == 0 || staging.buffer_bytes == 0 {
            return Err(CudaError::InvalidArgument(format!(
                "a staging ring needs at least one buffer of at least one byte, got {} x {} bytes",
                staging.buffers, staging.buffer_bytes
            )));
        }
        let cuda = matches!(target, Target::Cuda { .. });
        let mut buffers = Vec::with_capacity(staging.buffers);
        let mut uploaded = Vec::new();
        for _ in 0..staging.buffers {
            buffers.push(HostBuffer::new(
                staging.buffer_bytes,
                cuda && staging.pinned,
            )?);
            if cuda {
                uploaded.push(Event::new()?);
            }
        }
        let ring = Ring {
            buffers,
            uploaded,
            next: 0,
            stage_host: staging.stage_host,
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(staging.threads.max(1))
            .thread_name(|i| format!("ddo-stage-{i}"))
            .build()
            .map_err(|e| CudaError::Staging(format!("cannot start copy threads: {e}")))?;
        let (tx, rx) = mpsc::channel::<Job>();
        let shared = Arc::new(Shared::default());
        let worker_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("ddo-stager".into())
            .spawn(move || worker(target, events, ring, pool, rx, worker_shared))
            .map_err(|e| CudaError::Staging(format!("cannot start the staging thread: {e}")))?;
        Ok(Self {
            tx: Some(tx),
            shared,
            thread: Some(thread),
            submitted: 0,
        })
    }

    /// Queues a job and returns its sequence number (1, 2, ...).
    pub fn submit(&mut self, job: Job) -> Result<u64> {
        let tx = self
            .tx
            .as_ref()
            .ok_or_else(|| CudaError::Staging("stager is shut down".into()))?;
        tx.send(job)
            .map_err(|_| CudaError::Staging("the staging thread has exited".into()))?;
        self.submitted += 1;
        Ok(self.submitted)
    }

    /// Blocks until job `seq` has been fully queued on the copy stream (CUDA) or copied (CPU).
    /// Returns the first error the worker met, if any.
    pub fn wait(&self, seq: u64) -> Result<()> {
        self.wait_until(seq, true)
    }

    /// Blocks until every submitted job is done: processed, or skipped after an error (so that no
    /// upload is still queued from this thread), then returns the first error, if any.
    pub fn wait_all(&self) -> Result<()> {
        self.wait_until(self.submitted, false)
    }

    /// Waits until `seq` jobs are done (or, with `stop_on_error`, until the worker failed), then
    /// returns the worker's first error, if any.
    fn wait_until(&self, seq: u64, stop_on_error: bool) -> Result<()> {
        let poisoned = |_| CudaError::Staging("state poisoned".into());
        let mut state = self.shared.state.lock().map_err(poisoned)?;
        while state.done < seq && !(stop_on_error && state.error.is_some()) {
            state = self.shared.cv.wait(state).map_err(poisoned)?;
        }
        match &state.error {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }
}

impl Drop for Stager {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::warn!("the staging thread panicked");
            }
        }
    }
}

fn worker(
    target: Target,
    events: Option<Arc<SlotEvents>>,
    mut ring: Ring,
    pool: rayon::ThreadPool,
    rx: mpsc::Receiver<Job>,
    shared: Arc<Shared>,
) {
    let setup = match target {
        Target::Cuda { ordinal, .. } => make_current(ordinal),
        Target::Cpu => Ok(()),
    };
    let mut failed = setup.err();
    let mut done = 0u64;
    for job in rx {
        if failed.is_none() {
            // A panic must not kill the worker silently: waiters would block forever.
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                run_job(target, events.as_deref(), &mut ring, &pool, job)
            }));
            match outcome {
                Ok(Ok(())) => {}
                Ok(Err(e)) => failed = Some(e),
                Err(_) => failed = Some(CudaError::Staging("the staging thread panicked".into())),
            }
        }
        done += 1;
        let mut state = match shared.state.lock() {
            Ok(s) => s,
            Err(p) => p.into_inner(),
        };
        state.done = done;
        if state.error.is_none() {
            state.error = failed.clone();
        }
        shared.cv.notify_all();
    }
    // Uploads from the ring may still be in flight: finish them before the buffers are unmapped.
    for ev in &ring.uploaded {
        if let Err(e) = ev.synchronize() {
            tracing::warn!("waiting for staging uploads at shutdown: {e}");
        }
    }
}

fn run_job(
    target: Target,
    events: Option<&SlotEvents>,
    ring: &mut Ring,
    pool: &rayon::ThreadPool,
    job: Job,
) -> Result<()> {
    let stream = match target {
        Target::Cuda { copy_stream, .. } => Some(copy_stream),
        Target::Cpu => None,
    };
    if let (Some(s), Some(ev)) = (stream, events) {
        ev.consumed[job.slot].wait_on(s)?;
    }
    // Copies `len` bytes from host address `src` into the slot at `dst`: queued on the copy stream
    // (CUDA) or done now (CPU).
    let put = |dst: usize, src: usize, len: usize| -> Result<()> {
        match stream {
            Some(s) => h2d_async(dst, src, len, s),
            None => {
                copy_host(dst, src, len);
                Ok(())
            }
        }
    };
    match &job.source {
        Source::Host(src) if !ring.stage_host => put(job.dst, *src, job.n)?,
        Source::Host(src) => {
            let mut off = 0usize;
            while off < job.n {
                let b = ring.take()?;
                let buf = &ring.buffers[b];
                let len = buf.len().min(job.n - off);
                pool.install(|| copy_host(buf.ptr(), src + off, len));
                put(job.dst + off, buf.ptr(), len)?;
                if let (Some(s), Some(ev)) = (stream, ring.uploaded.get(b)) {
                    ev.record(s)?;
                }
                off += len;
            }
        }
        Source::File(unit) => {
            for (file, chunk) in &unit.chunks {
                let b = ring.take()?;
                let buf = &ring.buffers[b];
                if chunk.len as usize > buf.len() {
                    return Err(CudaError::InvalidArgument(format!(
                        "a read chunk of {} bytes does not fit a {}-byte staging buffer",
                        chunk.len,
                        buf.len()
                    )));
                }
                pool.install(|| {
                    file.read_chunk(
                        chunk.offset,
                        chunk.len as usize,
                        chunk.needed as usize,
                        buf.ptr(),
                    )
                })?;
                for c in &chunk.copies {
                    put(
                        job.dst + c.dst as usize,
                        buf.ptr() + c.buf_off as usize,
                        c.len as usize,
                    )?;
                }
                if let (Some(s), Some(ev)) = (stream, ring.uploaded.get(b)) {
                    ev.record(s)?;
                }
            }
        }
    }
    if let (Some(s), Some(ev)) = (stream, events) {
        ev.arrived[job.slot].record(s)?;
    }
    Ok(())
}

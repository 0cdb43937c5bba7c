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
//! Read-ahead: file chunks are read into every free ring buffer as soon as their jobs are queued,
//! across chunk and job boundaries, by the reader pool ([`crate::readpool`]: 4 MiB positional
//! pieces from one FIFO queue), so the disk never waits for an upload or for the next job. The
//! thread sleeps until a read ends *or* a job arrives, and queues the chunks' uploads strictly in
//! job order as their reads finish.
//!
//! Ordering: every job is queued through [`crate::job::enqueue`], one part per ring buffer it
//! passes through: the first part makes the copy stream wait for the slot's "consumed" event, each
//! part records its buffer's upload, the last records the slot's "arrived" event. A buffer is
//! refilled only after (host side) its previous upload finished. The compute stream never waits on
//! the host.

use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crate::deferred::ErrorSlot;
use crate::driver::make_current;
use crate::error::{CudaError, Result};
use crate::host::{copy_host_pieces, HostBuffer};
use crate::job::{enqueue, FileUnit, Job, Lane, Part, Source, Span, Staging, Target};
use crate::readpool::{ChunkRead, ReadPool, Wake};

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
    /// The transport's slot: a worker that panicked, uploads that could not be waited for.
    errors: ErrorSlot,
    tx: Option<mpsc::Sender<Job>>,
    shared: Arc<Shared>,
    wake: Arc<Wake>,
    thread: Option<JoinHandle<()>>,
    submitted: u64,
}

struct Ring {
    buffers: Vec<HostBuffer>,
    next: usize,
    /// Host-address jobs pass through the ring (pageable sources); else straight to the slot.
    stage_host: bool,
    /// Bytes per parallel piece of a buffer's fill (0: an even share per copy thread).
    piece_bytes: usize,
}

impl Ring {
    /// The next buffer, once its previous upload (ordered by `lane`) has finished.
    fn take(&mut self, lane: &dyn Lane) -> Result<usize> {
        let b = self.next;
        self.next = (self.next + 1) % self.buffers.len();
        lane.wait_uploaded(b)?;
        Ok(b)
    }
}

impl Stager {
    /// Allocates the ring on the calling thread (whose current context is the target's) and starts
    /// the worker thread, which queues every job on `lane` (whose events include one per buffer).
    pub fn start(
        target: Target,
        lane: Arc<dyn Lane>,
        staging: Staging,
        errors: &ErrorSlot,
    ) -> Result<Self> {
        if staging.buffers == 0 || staging.buffer_bytes == 0 {
            return Err(CudaError::InvalidArgument(format!(
                "a staging ring needs at least one buffer of at least one byte, got {} x {} bytes",
                staging.buffers, staging.buffer_bytes
            )));
        }
        let pin_for = match target {
            Target::Cuda { ordinal, .. } if staging.pinned => Some(ordinal),
            _ => None,
        };
        let mut buffers = Vec::with_capacity(staging.buffers);
        for _ in 0..staging.buffers {
            buffers.push(HostBuffer::new(staging.buffer_bytes, pin_for, errors)?);
        }
        let ring = Ring {
            buffers,
            next: 0,
            stage_host: staging.stage_host,
            piece_bytes: staging.piece_bytes,
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(staging.threads.max(1))
            .thread_name(|i| format!("ddo-stage-{i}"))
            .build()
            .map_err(|e| CudaError::Staging(format!("cannot start copy threads: {e}")))?;
        let (tx, rx) = mpsc::channel::<Job>();
        let shared = Arc::new(Shared::default());
        let worker_shared = Arc::clone(&shared);
        let wake = Arc::new(Wake::default());
        let worker_wake = Arc::clone(&wake);
        let worker_errors = errors.clone();
        let thread = std::thread::Builder::new()
            .name("ddo-stager".into())
            .spawn(move || {
                let p = Pipeline {
                    lane,
                    errors: worker_errors,
                    reads: None,
                    wake: Arc::clone(&worker_wake),
                    free: (0..ring.buffers.len()).collect(),
                    ring,
                    pool,
                    steps: Default::default(),
                    cursor: None,
                };
                worker(target, p, rx, worker_shared, worker_wake)
            })
            .map_err(|e| CudaError::Staging(format!("cannot start the staging thread: {e}")))?;
        Ok(Self {
            errors: errors.clone(),
            tx: Some(tx),
            shared,
            wake,
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
        self.wake.bump(); // the worker may be waiting for a read while it could start this job's
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
        self.wake.bump();
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                self.errors
                    .record("joining the staging thread", "the staging thread panicked");
            }
        }
    }
}

/// One queued step of the worker. Steps finish (their uploads are queued) in submission order.
enum Step {
    /// Chunk `index` of a file job, being read into ring buffer `buffer`.
    Chunk {
        job: Job,
        unit: Arc<FileUnit>,
        index: usize,
        buffer: usize,
        read: Arc<ChunkRead>,
    },
    /// A job without reads (a host address, or a file unit without bytes), run when it is oldest.
    Whole(Job),
}

/// The worker's state: file chunks are read ahead into every free ring buffer, across chunk and
/// job boundaries, so the disk always has the reader pool's worth of reads queued; their uploads
/// are queued in order as the reads finish.
struct Pipeline {
    lane: Arc<dyn Lane>,
    /// The transport's slot, for what the pipeline cannot return (at shutdown).
    errors: ErrorSlot,
    /// File reads, started with the first file chunk; dropped (joined) before the ring.
    reads: Option<ReadPool>,
    wake: Arc<Wake>,
    ring: Ring,
    /// Host copies into the ring (staged host jobs).
    pool: rayon::ThreadPool,
    steps: std::collections::VecDeque<Step>,
    /// A file job some of whose chunks are not started yet: the job, its unit, the next chunk.
    cursor: Option<(Job, Arc<FileUnit>, usize)>,
    /// Ring buffers that no queued chunk holds.
    free: std::collections::VecDeque<usize>,
}

impl Pipeline {
    fn idle(&self) -> bool {
        self.steps.is_empty() && self.cursor.is_none()
    }

    /// A host job staged through the ring uses every buffer: no read may start until it ran.
    fn reads_blocked(&self) -> bool {
        matches!(self.steps.back(), Some(Step::Whole(j)) if self.ring.stage_host && matches!(j.source, Source::Host { .. }))
    }

    /// Takes new jobs and starts chunk reads while a ring buffer is free. Blocks for a job only
    /// when nothing is queued. Counts the jobs taken in `received`.
    fn start_reads(
        &mut self,
        rx: &mpsc::Receiver<Job>,
        open: &mut bool,
        received: &mut u64,
    ) -> Result<()> {
        loop {
            if self.reads_blocked() {
                return Ok(());
            }
            let Some((job, unit, index)) = self.cursor.take() else {
                if !*open {
                    return Ok(());
                }
                let next = if self.steps.is_empty() {
                    rx.recv().ok()
                } else {
                    match rx.try_recv() {
                        Ok(j) => Some(j),
                        Err(mpsc::TryRecvError::Empty) => return Ok(()),
                        Err(mpsc::TryRecvError::Disconnected) => None,
                    }
                };
                let Some(job) = next else {
                    *open = false;
                    return Ok(());
                };
                *received += 1;
                match &job.source {
                    Source::File(unit) if !unit.chunks.is_empty() => {
                        let unit = Arc::clone(unit);
                        self.cursor = Some((job, unit, 0));
                    }
                    _ => self.steps.push_back(Step::Whole(job)),
                }
                continue;
            };
            let Some(&buffer) = self.free.front() else {
                self.cursor = Some((job, unit, index));
                return Ok(());
            };
            let buf = &self.ring.buffers[buffer];
            let (_, chunk) = &unit.chunks[index];
            if chunk.len as usize > buf.len() {
                return Err(CudaError::InvalidArgument(format!(
                    "a read chunk of {} bytes does not fit a {}-byte staging buffer",
                    chunk.len,
                    buf.len()
                )));
            }
            // The buffer's previous upload must have left it before the reads overwrite it.
            self.lane.wait_uploaded(buffer)?;
            self.free.pop_front();
            if self.reads.is_none() {
                // as many readers as the ring's copy threads (the preset's staging threads)
                self.reads = Some(ReadPool::new(
                    self.pool.current_num_threads(),
                    &self.errors,
                )?);
            }
            let (file, chunk) = &unit.chunks[index];
            let read = self.reads.as_ref().map(|r| {
                // SAFETY: the buffer holds the chunk (checked above), no upload reads it any more
                // (waited for above), and it is neither refilled nor unmapped until this read is
                // done: it leaves `free` until its step finishes or is abandoned, both of which
                // wait for the read first.
                unsafe {
                    r.read_chunk(
                        file,
                        chunk.offset,
                        chunk.len as usize,
                        chunk.needed as usize,
                        self.ring.buffers[buffer].ptr(),
                        &self.wake,
                    )
                }
            });
            let read = read.expect("the reader pool was just started");
            self.steps.push_back(Step::Chunk {
                job: job.clone(),
                unit: Arc::clone(&unit),
                index,
                buffer,
                read,
            });
            if index + 1 < unit.chunks.len() {
                self.cursor = Some((job, unit, index + 1));
            }
        }
    }

    /// Whether the oldest step can finish without waiting for reads.
    fn oldest_ready(&self) -> bool {
        match self.steps.front() {
            Some(Step::Chunk { read, .. }) => read.is_done(),
            _ => true,
        }
    }

    /// Finishes the oldest step (its reads are done: [`oldest_ready`](Self::oldest_ready)) and
    /// queues its uploads. Returns whether a job is now complete (its last upload and its
    /// "arrived" event are queued).
    fn finish_oldest(&mut self) -> Result<bool> {
        let Some(step) = self.steps.pop_front() else {
            return Ok(false);
        };
        match step {
            Step::Whole(job) => {
                self.run_whole(&job)?;
                Ok(true)
            }
            Step::Chunk {
                job,
                unit,
                index,
                buffer,
                read,
            } => {
                read.wait();
                self.free.push_back(buffer);
                read.result()?;
                let last = index + 1 == unit.chunks.len();
                let part = Part {
                    job: &job,
                    first: index == 0,
                    last,
                    buffer: Some(buffer),
                };
                let src = self.ring.buffers[buffer].ptr();
                let copies = unit.chunks[index].1.copies.iter().map(|c| Span {
                    offset: c.dst as usize,
                    src: src + c.buf_off as usize,
                    len: c.len as usize,
                });
                // SAFETY: the chunk's reads into the buffer are done and the buffer stays mapped
                // until its upload is waited for (`take`, `start_reads`, shutdown); the copies were
                // planned inside the chunk and inside the unit's span, which `fetch_file`'s caller
                // guarantees `dst` holds until the copies completed.
                unsafe { enqueue(&*self.lane, part, copies) }?;
                Ok(last)
            }
        }
    }

    fn run_whole(&mut self, job: &Job) -> Result<()> {
        let lane = &*self.lane;
        match job.source {
            Source::Host { src, n } if self.ring.stage_host => {
                if n == 0 {
                    // SAFETY: no copy.
                    return unsafe { enqueue(lane, Part::whole(job), []) };
                }
                // No chunk is queued (reads_blocked), so every buffer is free for this job.
                let mut off = 0usize;
                while off < n {
                    let b = self.ring.take(lane)?;
                    let buf = &self.ring.buffers[b];
                    let len = buf.len().min(n - off);
                    // SAFETY: `fetch`'s caller guarantees `src` holds `n` live bytes; the buffer's
                    // previous upload has finished (`take`) and it holds at least `len` bytes.
                    let piece = self.ring.piece_bytes;
                    self.pool
                        .install(|| unsafe { copy_host_pieces(buf.ptr(), src + off, len, piece) });
                    let part = Part {
                        job,
                        first: off == 0,
                        last: off + len == n,
                        buffer: Some(b),
                    };
                    let copy = Span {
                        offset: off,
                        src: buf.ptr(),
                        len,
                    };
                    // SAFETY: the buffer stays mapped until its upload is waited for; `dst` holds
                    // `n` bytes until the copies completed (`fetch`'s contract).
                    unsafe { enqueue(lane, part, [copy]) }?;
                    off += len;
                }
                Ok(())
            }
            Source::Host { src, n } => {
                let copy = Span {
                    offset: 0,
                    src,
                    len: n,
                };
                // SAFETY: `fetch`'s caller guarantees both ranges until the copy completed.
                unsafe { enqueue(lane, Part::whole(job), [copy]) }
            }
            // SAFETY: no copy (a unit without bytes).
            Source::File(_) => unsafe { enqueue(lane, Part::whole(job), []) },
        }
    }

    /// After an error: waits for every read in flight (they write into the ring) and drops the
    /// queued steps.
    fn abandon(&mut self) {
        for step in self.steps.drain(..) {
            if let Step::Chunk { read, .. } = step {
                read.wait();
            }
        }
        self.cursor = None;
        self.free = (0..self.ring.buffers.len()).collect();
    }
}

fn publish(shared: &Shared, done: u64, failed: &Option<CudaError>) {
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

fn worker(
    target: Target,
    mut p: Pipeline,
    rx: mpsc::Receiver<Job>,
    shared: Arc<Shared>,
    wake: Arc<Wake>,
) {
    let setup = match target {
        Target::Cuda { ordinal, .. } => make_current(ordinal),
        Target::Cpu => Ok(()),
    };
    let mut failed = setup.err();
    let (mut received, mut done, mut open) = (0u64, 0u64, true);
    // An error met while starting a later job's reads belongs to that job: the older steps
    // already queued finish first, so their waiters do not see it.
    let mut deferred: Option<CudaError> = None;
    while failed.is_none() && (open || !p.idle()) {
        let seen = wake.seq();
        // A panic must not kill the worker silently: waiters would block forever.
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> Result<bool> {
            if deferred.is_none() {
                if let Err(e) = p.start_reads(&rx, &mut open, &mut received) {
                    deferred = Some(e);
                }
            }
            if p.steps.is_empty() {
                if let Some(e) = deferred.take() {
                    return Err(e);
                }
            }
            if p.oldest_ready() {
                p.finish_oldest()
            } else {
                // The oldest chunk is still being read: sleep until a read ends or a job comes
                // (whose reads may start now), not just until this read ends.
                wake.wait_past(seen);
                Ok(false)
            }
        }));
        match outcome {
            Ok(Ok(true)) => {
                done += 1;
                publish(&shared, done, &None);
            }
            Ok(Ok(false)) => {}
            Ok(Err(e)) => failed = Some(e),
            Err(_) => failed = Some(CudaError::Staging("the staging thread panicked".into())),
        }
    }
    if failed.is_some() {
        // Jobs taken, in flight or still to come count as done (skipped) so that waiters return.
        p.abandon();
        publish(&shared, received, &failed);
        for _ in rx.iter() {
            received += 1;
            publish(&shared, received, &failed);
        }
    }
    // Every queued read has ended (abandon waited): join the readers.
    drop(p.reads.take());
    // Uploads from the ring may still be in flight: finish them before the buffers are unmapped.
    for b in 0..p.ring.buffers.len() {
        if let Err(e) = p.lane.wait_uploaded(b) {
            p.errors
                .record("waiting for the staging ring's uploads at shutdown", e);
        }
    }
}

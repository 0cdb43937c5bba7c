//! The NVMe route's reader pool: a fixed set of threads taking positional reads of [`PIECE`]
//! bytes from one FIFO queue.
//!
//! The staging thread queues the pieces of every chunk it starts (several chunks of several jobs
//! ahead); the readers take them oldest first, so the disk sees a constant queue depth of one read
//! per thread across chunk and job boundaries, and the oldest chunk, whose upload is due first,
//! finishes first. A chunk's completion wakes the staging thread through the shared [`Wake`].

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use crate::deferred::ErrorSlot;
use crate::error::{CudaError, Result};
use crate::reader::{chunk_is_aligned, ReadFile, PIECE};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// A counter the staging thread sleeps on: bumped when a job is submitted or a chunk's reads end.
#[derive(Default)]
pub(crate) struct Wake {
    seq: Mutex<u64>,
    cv: Condvar,
}

impl Wake {
    pub fn bump(&self) {
        *lock(&self.seq) += 1;
        self.cv.notify_all();
    }

    pub fn seq(&self) -> u64 {
        *lock(&self.seq)
    }

    /// Sleeps until something happened since `seen` was read.
    pub fn wait_past(&self, seen: u64) {
        let mut g = lock(&self.seq);
        while *g == seen {
            g = match self.cv.wait(g) {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
        }
    }
}

/// The reads of one chunk: done when every piece finished; the first error wins.
pub(crate) struct ChunkRead {
    remaining: AtomicUsize,
    error: Mutex<Option<CudaError>>,
    wake: Arc<Wake>,
}

impl ChunkRead {
    pub fn is_done(&self) -> bool {
        self.remaining.load(Ordering::Acquire) == 0
    }

    /// The outcome, once [`is_done`](Self::is_done).
    pub fn result(&self) -> Result<()> {
        match lock(&self.error).as_ref() {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Blocks until every piece finished (used when abandoning the queue after an error).
    pub fn wait(&self) {
        while !self.is_done() {
            let seen = self.wake.seq();
            if self.is_done() {
                break;
            }
            self.wake.wait_past(seen);
        }
    }

    fn piece_done(&self, r: Result<()>) {
        if let Err(e) = r {
            lock(&self.error).get_or_insert(e);
        }
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.wake.bump();
        }
    }
}

struct Piece {
    file: Arc<ReadFile>,
    aligned: bool,
    offset: u64,
    n: usize,
    want: usize,
    dst: usize,
    chunk: Arc<ChunkRead>,
}

#[derive(Default)]
struct Queue {
    pieces: VecDeque<Piece>,
    closed: bool,
}

#[derive(Default)]
struct Shared {
    queue: Mutex<Queue>,
    cv: Condvar,
}

pub(crate) struct ReadPool {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    /// Where a reader that panicked is recorded when the pool is dropped.
    errors: ErrorSlot,
}

impl ReadPool {
    pub fn new(threads: usize, errors: &ErrorSlot) -> Result<Self> {
        let shared = Arc::new(Shared::default());
        let mut pool = Self {
            shared,
            threads: Vec::new(),
            errors: errors.clone(),
        };
        for i in 0..threads.max(1) {
            let shared = Arc::clone(&pool.shared);
            let t = std::thread::Builder::new()
                .name(format!("ddo-read-{i}"))
                .spawn(move || reader(&shared))
                .map_err(|e| CudaError::Staging(format!("cannot start reader threads: {e}")))?;
            pool.threads.push(t);
        }
        Ok(pool)
    }

    /// Queues the reads of `len` bytes of `file` at `offset` into host address `dst` (of which the
    /// first `needed` bytes must exist in the file; see [`ReadFile::read_chunk`]).
    ///
    /// # Safety
    /// `dst` is `len` writable bytes of host memory that stay allocated, and that nobody else reads
    /// or writes, until the returned read [`is_done`](ChunkRead::is_done) (or the pool is dropped,
    /// which finishes every queued read).
    pub unsafe fn read_chunk(
        &self,
        file: &Arc<ReadFile>,
        offset: u64,
        len: usize,
        needed: usize,
        dst: usize,
        wake: &Arc<Wake>,
    ) -> Arc<ChunkRead> {
        let pieces = len.div_ceil(PIECE);
        let chunk = Arc::new(ChunkRead {
            remaining: AtomicUsize::new(pieces),
            error: Mutex::new(None),
            wake: Arc::clone(wake),
        });
        if pieces == 0 {
            wake.bump();
            return chunk;
        }
        let aligned = chunk_is_aligned(offset, len, dst);
        let mut q = lock(&self.shared.queue);
        for i in 0..pieces {
            let o = i * PIECE;
            let n = PIECE.min(len - o);
            q.pieces.push_back(Piece {
                file: Arc::clone(file),
                aligned,
                offset: offset + o as u64,
                n,
                want: needed.saturating_sub(o).min(n),
                dst: dst + o,
                chunk: Arc::clone(&chunk),
            });
        }
        drop(q);
        self.shared.cv.notify_all();
        chunk
    }
}

impl Drop for ReadPool {
    fn drop(&mut self) {
        lock(&self.shared.queue).closed = true;
        self.shared.cv.notify_all();
        for t in self.threads.drain(..) {
            if t.join().is_err() {
                self.errors
                    .record("joining the reader threads", "a reader thread panicked");
            }
        }
    }
}

fn reader(shared: &Shared) {
    loop {
        let piece = {
            let mut q = lock(&shared.queue);
            loop {
                if let Some(p) = q.pieces.pop_front() {
                    break p;
                }
                if q.closed {
                    return;
                }
                q = match shared.cv.wait(q) {
                    Ok(g) => g,
                    Err(p) => p.into_inner(),
                };
            }
        };
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: `read_chunk`'s caller keeps the chunk's destination, of which this piece
            // is a disjoint sub-range, to this read until the chunk is done.
            unsafe {
                piece
                    .file
                    .read_span(piece.aligned, piece.offset, piece.n, piece.want, piece.dst)
            }
        }))
        .unwrap_or_else(|_| Err(CudaError::Staging("a reader thread panicked".into())));
        piece.chunk.piece_done(r);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::HostBuffer;
    use crate::reader::tests::temp_file;
    use crate::reader::ALIGN;

    #[test]
    fn many_chunks_in_flight_read_exactly() {
        let len = 5 * PIECE + 12_345;
        let (path, data) = temp_file("pool-exact", len);
        let file = Arc::new(ReadFile::open(&path, true).unwrap());
        let wake = Arc::new(Wake::default());
        let pool = ReadPool::new(3, &ErrorSlot::default()).unwrap();
        // three chunks queued at once: aligned (direct where allowed) and unaligned (buffered)
        let spans = [
            (0u64, 2 * PIECE),
            (2 * PIECE as u64, 3 * PIECE + 12_288),
            (17u64, 1000),
        ];
        let bufs: Vec<HostBuffer> = spans
            .iter()
            .map(|&(_, n)| {
                HostBuffer::new(n.div_ceil(ALIGN) * ALIGN, None, &ErrorSlot::default()).unwrap()
            })
            .collect();
        let reads: Vec<_> = spans
            .iter()
            .zip(&bufs)
            .map(|(&(off, n), b)| {
                let needed = n.min(len - off as usize);
                // SAFETY: each buffer holds its chunk and is read only after its read is done.
                unsafe { pool.read_chunk(&file, off, n, needed, b.ptr(), &wake) }
            })
            .collect();
        for ((r, &(off, n)), b) in reads.iter().zip(&spans).zip(&bufs) {
            r.wait();
            r.result().unwrap();
            let needed = n.min(len - off as usize);
            // SAFETY: the buffer holds at least `needed` bytes (an anonymous mapping, initialised)
            // and its read is done: no reader writes it any more.
            let got = unsafe { std::slice::from_raw_parts(b.ptr() as *const u8, needed) };
            assert_eq!(got, &data[off as usize..off as usize + needed]);
        }
        drop(pool);
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    #[test]
    fn a_read_past_the_end_is_an_error_naming_the_file_and_wakes_the_waiter() {
        let (path, _) = temp_file("pool-short", PIECE + 100);
        let file = Arc::new(ReadFile::open(&path, true).unwrap());
        let wake = Arc::new(Wake::default());
        let pool = ReadPool::new(2, &ErrorSlot::default()).unwrap();
        let buf = HostBuffer::new(3 * PIECE, None, &ErrorSlot::default()).unwrap();
        let seen = wake.seq();
        // SAFETY: the buffer holds the chunk and outlives the read (waited for below).
        let r = unsafe { pool.read_chunk(&file, 0, 3 * PIECE, 3 * PIECE, buf.ptr(), &wake) };
        r.wait();
        assert!(wake.seq() > seen);
        let err = r.result().unwrap_err();
        assert!(err.to_string().contains("w.bin"), "{err}");
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    #[test]
    fn dropping_the_pool_finishes_queued_reads_first() {
        let (path, _) = temp_file("pool-drop", 8 * PIECE);
        let file = Arc::new(ReadFile::open(&path, true).unwrap());
        let wake = Arc::new(Wake::default());
        let pool = ReadPool::new(1, &ErrorSlot::default()).unwrap();
        let buf = HostBuffer::new(8 * PIECE, None, &ErrorSlot::default()).unwrap();
        // SAFETY: the buffer holds the chunk and outlives the pool, whose drop finishes the read.
        let r = unsafe { pool.read_chunk(&file, 0, 8 * PIECE, 8 * PIECE, buf.ptr(), &wake) };
        drop(pool); // joins the reader after the queue is empty: the buffer is no longer written
        assert!(r.is_done());
        r.result().unwrap();
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }
}

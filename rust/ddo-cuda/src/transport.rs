//! The transport of one offloaded component: K GPU (or host) slots, the copies that fill them and
//! the events that order those copies against compute.
//!
//! Per slot `s` there are two events. `arrived[s]` is recorded on the copy stream after a unit's
//! bytes were queued into the slot; compute waits on it (GPU side). `consumed[s]` is recorded on the
//! compute stream after the unit ran; the next copy into the slot waits on it (GPU side). The host
//! never synchronises the device in the steady state.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys;

use crate::driver::{bind_context, check, ContextGuard, Stream};
use crate::error::{CudaError, Result};
use crate::event::Event;
use crate::reader::{ReadFile, ALIGN};
use crate::stager::{FileUnit, Job, Source, Stager};

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
}

/// Counters a report reads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransportStats {
    pub fetches: u64,
    pub bytes: u64,
    /// Host nanoseconds spent in `acquire` waiting for the staging thread.
    pub host_wait_ns: u64,
    /// Fetches whose source was a file, and the bytes they read from disk (alignment included).
    pub file_fetches: u64,
    pub disk_bytes: u64,
}

pub(crate) struct SlotEvents {
    pub arrived: Vec<Event>,
    pub consumed: Vec<Event>,
}

pub struct Transport {
    target: Target,
    slots: usize,
    events: Option<Arc<SlotEvents>>,
    stager: Option<Stager>,
    staging: Option<Staging>,
    /// Staging job sequence number of the last fetch into each slot.
    pending: Vec<u64>,
    stats: TransportStats,
    files: Vec<Arc<ReadFile>>,
    file_units: Vec<Arc<FileUnit>>,
}

impl Transport {
    /// Creates the transport. On the CUDA target the device's primary context is made current and
    /// the events are created; without a driver this fails with [`CudaError::NotAvailable`].
    pub fn new(target: Target, slots: usize, staging: Option<Staging>) -> Result<Self> {
        check_config(slots, staging.as_ref())?;
        let mut pending = Vec::new();
        pending
            .try_reserve_exact(slots)
            .map_err(|_| CudaError::OutOfMemory(format!("listing {slots} slots")))?;
        pending.resize(slots, 0);
        // Events and the staging ring's page-locked buffers are created in the target's context.
        let _ctx = match target {
            Target::Cuda { ordinal, .. } => Some(bind_context(ordinal)?),
            Target::Cpu => None,
        };
        let events = match target {
            Target::Cuda { .. } => {
                let mk = || (0..slots).map(|_| Event::new()).collect::<Result<Vec<_>>>();
                Some(Arc::new(SlotEvents {
                    arrived: mk()?,
                    consumed: mk()?,
                }))
            }
            Target::Cpu => None,
        };
        let stager = match staging {
            Some(cfg) => Some(Stager::start(target, events.clone(), cfg)?),
            None => None,
        };
        Ok(Self {
            target,
            slots,
            events,
            stager,
            staging,
            pending,
            stats: TransportStats::default(),
            files: Vec::new(),
            file_units: Vec::new(),
        })
    }

    pub fn slots(&self) -> usize {
        self.slots
    }

    pub fn stats(&self) -> TransportStats {
        self.stats
    }

    fn check_slot(&self, slot: usize) -> Result<()> {
        if slot >= self.slots {
            return Err(CudaError::InvalidArgument(format!(
                "slot {slot} out of range (transport has {})",
                self.slots
            )));
        }
        Ok(())
    }

    /// Binds the target's context for the duration of one call (see [`ContextGuard`]).
    fn bind(&self) -> Result<Option<ContextGuard>> {
        match self.target {
            Target::Cuda { ordinal, .. } => bind_context(ordinal).map(Some),
            Target::Cpu => Ok(None),
        }
    }

    /// Starts filling `slot` (at address `dst`) with `n` bytes from host address `src`, after the
    /// slot's previous unit was consumed. Returns without waiting for the copy.
    pub fn fetch(&mut self, slot: usize, dst: usize, src: usize, n: usize) -> Result<()> {
        self.check_slot(slot)?;
        crate::host::check_host_range("fetch destination", dst, n)?;
        crate::host::check_host_range("fetch source", src, n)?;
        self.stats.fetches += 1;
        self.stats.bytes = self.stats.bytes.saturating_add(n as u64);
        if let Some(stager) = self.stager.as_mut() {
            self.pending[slot] = stager.submit(Job {
                slot,
                dst,
                source: Source::Host { src, n },
            })?;
            return Ok(());
        }
        match (self.target, self.events.as_deref()) {
            (Target::Cuda { copy_stream, .. }, Some(ev)) => {
                let _ctx = self.bind()?;
                ev.consumed[slot].wait_on(copy_stream)?;
                h2d_async(dst, src, n, copy_stream)?;
                ev.arrived[slot].record(copy_stream)
            }
            _ => {
                crate::host::copy_host(dst, src, n);
                Ok(())
            }
        }
    }

    /// Opens a weight file for [`Transport::add_file_unit`]; returns its index. `O_DIRECT` is used
    /// where the filesystem allows it (and `allow_direct`).
    pub fn open_file(&mut self, path: &Path, allow_direct: bool) -> Result<usize> {
        self.files
            .push(Arc::new(ReadFile::open(path, allow_direct)?));
        Ok(self.files.len() - 1)
    }

    /// Whether reads of file `index` bypass the page cache.
    pub fn file_is_direct(&self, index: usize) -> Option<bool> {
        self.files.get(index).map(|f| f.is_direct())
    }

    /// Registers a unit streamed from files: `pieces` (file index, file offset, bytes, offset in
    /// the slot), one per tensor. Adjacent ranges are coalesced into aligned reads of at most one
    /// staging buffer (gaps up to `max_gap` bytes are read through). Returns the unit's index.
    /// Needs a staging ring.
    pub fn add_file_unit(&mut self, pieces: &[ddo_core::ReadPiece], max_gap: u64) -> Result<usize> {
        let staging = self.staging.ok_or_else(|| {
            CudaError::InvalidArgument("units read from files need a staging ring".into())
        })?;
        if let Some(p) = pieces.iter().find(|p| p.file >= self.files.len()) {
            return Err(CudaError::InvalidArgument(format!(
                "file index {} out of range ({} files open)",
                p.file,
                self.files.len()
            )));
        }
        let chunks =
            ddo_core::plan_reads(pieces, ALIGN as u64, staging.buffer_bytes as u64, max_gap)
                .map_err(|e| CudaError::InvalidArgument(e.to_string()))?;
        // plan_reads checked that no piece's end wraps; the sums are checked here
        let too_big = || {
            CudaError::InvalidArgument(format!(
                "a unit of {} pieces adds up to more than 2^64 bytes",
                pieces.len()
            ))
        };
        let copy_bytes = pieces
            .iter()
            .try_fold(0u64, |a, p| a.checked_add(p.len))
            .ok_or_else(too_big)?;
        let read_bytes = chunks
            .iter()
            .try_fold(0u64, |a, c| a.checked_add(c.len))
            .ok_or_else(too_big)?;
        // the slot must hold up to the end of the farthest piece
        let span = pieces
            .iter()
            .filter(|p| p.len > 0)
            .map(|p| p.dst + p.len)
            .max()
            .unwrap_or(0);
        let span = usize::try_from(span).map_err(|_| too_big())?;
        let chunks = chunks
            .into_iter()
            .map(|c| (Arc::clone(&self.files[c.file]), c))
            .collect();
        self.file_units.push(Arc::new(FileUnit {
            chunks,
            copy_bytes,
            read_bytes,
            span,
        }));
        Ok(self.file_units.len() - 1)
    }

    /// Starts filling `slot` (at address `dst`) with file unit `unit`, read from disk through the
    /// staging ring, after the slot's previous unit was consumed. Returns without waiting.
    pub fn fetch_file(&mut self, slot: usize, dst: usize, unit: usize) -> Result<()> {
        self.check_slot(slot)?;
        let fu = self.file_units.get(unit).cloned().ok_or_else(|| {
            CudaError::InvalidArgument(format!(
                "file unit {unit} out of range ({} registered)",
                self.file_units.len()
            ))
        })?;
        crate::host::check_host_range("file fetch destination", dst, fu.span)?;
        let stager = self.stager.as_mut().ok_or_else(|| {
            CudaError::InvalidArgument("units read from files need a staging ring".into())
        })?;
        self.stats.fetches += 1;
        self.stats.bytes = self.stats.bytes.saturating_add(fu.copy_bytes);
        self.stats.file_fetches += 1;
        self.stats.disk_bytes = self.stats.disk_bytes.saturating_add(fu.read_bytes);
        self.pending[slot] = stager.submit(Job {
            slot,
            dst,
            source: Source::File(fu),
        })?;
        Ok(())
    }

    /// Makes `compute_stream` wait until the last fetch into `slot` has landed.
    pub fn acquire(&mut self, slot: usize, compute_stream: Stream) -> Result<()> {
        self.check_slot(slot)?;
        if let Some(stager) = self.stager.as_ref() {
            let t0 = Instant::now();
            stager.wait(self.pending[slot])?;
            let waited = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
            self.stats.host_wait_ns = self.stats.host_wait_ns.saturating_add(waited);
        }
        if let Some(ev) = self.events.as_deref() {
            let _ctx = self.bind()?;
            ev.arrived[slot].wait_on(compute_stream)?;
        }
        Ok(())
    }

    /// Marks `slot` as consumed by the work queued so far on `compute_stream`.
    pub fn release(&mut self, slot: usize, compute_stream: Stream) -> Result<()> {
        self.check_slot(slot)?;
        if let Some(ev) = self.events.as_deref() {
            let _ctx = self.bind()?;
            ev.consumed[slot].record(compute_stream)?;
        }
        Ok(())
    }

    /// Blocks until every fetch issued so far has completed (used before slots or sources are freed).
    /// A staging error is returned only after the copy stream has drained too.
    pub fn drain(&mut self) -> Result<()> {
        let staged = match self.stager.as_ref() {
            Some(stager) => stager.wait_all(),
            None => Ok(()),
        };
        if let Target::Cuda { copy_stream, .. } = self.target {
            let _ctx = self.bind()?;
            // SAFETY: the stream handle is owned by PyTorch and alive while the transport is.
            check(
                unsafe { sys::cuStreamSynchronize(copy_stream.raw()) },
                "cuStreamSynchronize",
                "draining copies",
            )?;
        }
        staged
    }
}

/// Most staging buffers and most threads per ring (presets use a few of each).
pub const MAX_STAGING_BUFFERS: usize = 1024;
pub const MAX_THREADS: usize = 1024;

/// Checks the slot count and the staging ring's shape before anything is allocated: a count or a
/// size from a caller must not reach an allocation that aborts the process.
fn check_config(slots: usize, staging: Option<&Staging>) -> Result<()> {
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

/// Queues an asynchronous host-to-device copy on `stream`.
pub(crate) fn h2d_async(dst: usize, src: usize, n: usize, stream: Stream) -> Result<()> {
    // SAFETY: the caller guarantees `src` is `n` live host bytes (page-locked for a truly async copy)
    // and `dst` is `n` bytes of device memory that stay allocated until the copy completes.
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

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(staging: Option<Staging>) {
        let mut t = Transport::new(Target::Cpu, 2, staging).unwrap();
        let srcs: Vec<Vec<u8>> = (0..5)
            .map(|u| (0..100_003).map(|i| ((i + u * 7) % 253) as u8).collect())
            .collect();
        let mut slots = vec![vec![0u8; 100_003]; 2];
        for (u, src) in srcs.iter().enumerate() {
            let s = u % 2;
            t.fetch(
                s,
                slots[s].as_mut_ptr() as usize,
                src.as_ptr() as usize,
                src.len(),
            )
            .unwrap();
            t.acquire(s, Stream(0)).unwrap();
            assert_eq!(&slots[s], src, "unit {u}");
            t.release(s, Stream(0)).unwrap();
        }
        t.drain().unwrap();
        assert_eq!(t.stats().fetches, 5);
        assert_eq!(t.stats().bytes, 5 * 100_003);
    }

    #[test]
    fn cpu_direct_copies_land_in_slots() {
        roundtrip(None);
    }

    #[test]
    fn cpu_staged_copies_pass_through_a_small_ring() {
        roundtrip(Some(Staging {
            buffers: 3,
            buffer_bytes: 4096,
            threads: 2,
            pinned: false,
            stage_host: true,
        }));
    }

    #[test]
    fn cpu_direct_host_jobs_through_the_stager() {
        roundtrip(Some(Staging {
            buffers: 2,
            buffer_bytes: 4096,
            threads: 1,
            pinned: false,
            stage_host: false,
        }));
    }

    fn file_units(direct: bool) {
        let dir =
            std::env::temp_dir().join(format!("ddo-transport-{}-{direct}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let data: Vec<Vec<u8>> = (0..2)
            .map(|f| {
                (0..300_001)
                    .map(|i| ((i * 13 + f * 5) % 241) as u8)
                    .collect()
            })
            .collect();
        let mut t = Transport::new(
            Target::Cpu,
            2,
            Some(Staging {
                buffers: 3,
                buffer_bytes: 3 * 4096 + 1,
                threads: 2,
                pinned: false,
                stage_host: false,
            }),
        )
        .unwrap();
        for (f, d) in data.iter().enumerate() {
            let p = dir.join(format!("{f}.bin"));
            std::fs::write(&p, d).unwrap();
            assert_eq!(t.open_file(&p, direct).unwrap(), f);
        }
        let piece = |file, offset, len, dst| ddo_core::ReadPiece {
            file,
            offset,
            len,
            dst,
        };
        // unit 0: two adjacent tensors of file 0 and one of file 1; unit 1: the tail of file 1
        let u0 = t
            .add_file_unit(
                &[
                    piece(0, 7, 10_000, 0),
                    piece(0, 10_007, 50_000, 10_240),
                    piece(1, 100, 999, 60_416),
                ],
                0,
            )
            .unwrap();
        let u1 = t
            .add_file_unit(&[piece(1, 200_001, 100_000, 0)], 0)
            .unwrap();
        let host: Vec<u8> = (0..5000).map(|i| (i % 7) as u8).collect();
        let mut slots = vec![vec![0u8; 100_000]; 2];
        for round in 0..3 {
            let s = round % 2;
            let dst = slots[s].as_mut_ptr() as usize;
            t.fetch_file(s, dst, u0).unwrap();
            t.fetch_file(1 - s, slots[1 - s].as_mut_ptr() as usize, u1)
                .unwrap();
            t.acquire(s, Stream(0)).unwrap();
            t.acquire(1 - s, Stream(0)).unwrap();
            assert_eq!(&slots[s][..10_000], &data[0][7..10_007]);
            assert_eq!(&slots[s][10_240..60_240], &data[0][10_007..60_007]);
            assert_eq!(&slots[s][60_416..61_415], &data[1][100..1099]);
            assert_eq!(&slots[1 - s][..], &data[1][200_001..]);
            t.release(s, Stream(0)).unwrap();
            t.release(1 - s, Stream(0)).unwrap();
            // host (RAM-cache) sources interleave with file sources
            t.fetch(s, dst, host.as_ptr() as usize, host.len()).unwrap();
            t.acquire(s, Stream(0)).unwrap();
            assert_eq!(&slots[s][..5000], &host[..]);
            t.release(s, Stream(0)).unwrap();
        }
        t.drain().unwrap();
        assert_eq!(t.stats().file_fetches, 6);
        assert!(t.stats().disk_bytes >= 3 * (60_999 + 100_000));
        // truncating a file makes the next read of it a read error
        std::fs::write(dir.join("1.bin"), &data[1][..1000]).unwrap();
        t.fetch_file(0, slots[0].as_mut_ptr() as usize, u1).unwrap();
        let err = t.acquire(0, Stream(0)).unwrap_err();
        assert!(matches!(err, CudaError::Read(_)), "{err}");
        assert!(err.to_string().contains("1.bin"), "{err}");
        drop(t);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn cpu_file_units_buffered() {
        file_units(false);
    }

    #[test]
    fn cpu_file_units_direct_where_allowed() {
        file_units(true);
    }

    /// Every slot's job queued before any is acquired: chunks of later jobs are read ahead while
    /// earlier ones upload; host jobs (straight or staged through the ring) keep their place.
    fn read_ahead(stage_host: bool) {
        let dir =
            std::env::temp_dir().join(format!("ddo-readahead-{}-{stage_host}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let data: Vec<u8> = (0..2_000_003).map(|i| ((i * 31 + 3) % 251) as u8).collect();
        let path = dir.join("w.bin");
        std::fs::write(&path, &data).unwrap();
        let slots_n = 5;
        let mut t = Transport::new(
            Target::Cpu,
            slots_n,
            Some(Staging {
                buffers: 3,
                buffer_bytes: 4 * 4096,
                threads: 4,
                pinned: false,
                stage_host,
            }),
        )
        .unwrap();
        t.open_file(&path, true).unwrap();
        // 24 units of 3 to 70 KiB each (1 to 5 chunks), at odd offsets
        let units: Vec<(usize, u64, usize)> = (0..24u64)
            .map(|u| {
                let len = 3000 + (u as usize * 2917) % 70_000;
                let off = 1 + u * 81_111;
                let piece = ddo_core::ReadPiece {
                    file: 0,
                    offset: off,
                    len: len as u64,
                    dst: 0,
                };
                (t.add_file_unit(&[piece], 0).unwrap(), off, len)
            })
            .collect();
        let host: Vec<u8> = (0..50_000).map(|i| (i % 13) as u8).collect();
        let mut slots = vec![vec![0u8; 80_000]; slots_n];
        for round in 0..3 {
            let mut jobs = Vec::new();
            for (k, &(id, off, len)) in units.iter().enumerate() {
                let s = k % slots_n;
                if k >= slots_n {
                    // the slot's previous job must be checked and released before refilling it
                    let (ps, expect): (usize, &[u8]) = jobs[k - slots_n];
                    t.acquire(ps, Stream(0)).unwrap();
                    assert_eq!(
                        &slots[ps][..expect.len()],
                        expect,
                        "round {round} job {}",
                        k - slots_n
                    );
                    t.release(ps, Stream(0)).unwrap();
                }
                let dst = slots[s].as_mut_ptr() as usize;
                if (k + round) % 5 == 0 {
                    t.fetch(s, dst, host.as_ptr() as usize, host.len()).unwrap();
                    jobs.push((s, &host[..]));
                } else {
                    t.fetch_file(s, dst, id).unwrap();
                    jobs.push((s, &data[off as usize..off as usize + len]));
                }
            }
            for &(s, expect) in &jobs[units.len() - slots_n..] {
                t.acquire(s, Stream(0)).unwrap();
                assert_eq!(&slots[s][..expect.len()], expect, "round {round} tail");
                t.release(s, Stream(0)).unwrap();
            }
        }
        t.drain().unwrap();
        // an error in the middle of a queue of jobs fails the waits and the drain, never hangs
        std::fs::write(&path, &data[..100_000]).unwrap();
        for s in 0..slots_n {
            t.fetch_file(s, slots[s].as_mut_ptr() as usize, units[s].0)
                .unwrap();
        }
        let err = t.acquire(slots_n - 1, Stream(0)).unwrap_err();
        assert!(err.to_string().contains("w.bin"), "{err}");
        assert!(t.drain().is_err());
        drop(t);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn cpu_read_ahead_with_direct_host_jobs() {
        read_ahead(false);
    }

    #[test]
    fn cpu_read_ahead_with_staged_host_jobs() {
        read_ahead(true);
    }

    #[test]
    fn file_units_need_a_ring_and_valid_indices() {
        let mut t = Transport::new(Target::Cpu, 2, None).unwrap();
        assert!(t.add_file_unit(&[], 0).is_err());
        assert!(t.fetch_file(0, 0, 0).is_err());
    }

    #[test]
    fn bad_slot_is_an_error() {
        let mut t = Transport::new(Target::Cpu, 2, None).unwrap();
        assert!(matches!(
            t.acquire(5, Stream(0)),
            Err(CudaError::InvalidArgument(_))
        ));
    }

    #[test]
    fn sizes_from_callers_are_checked_before_allocating() {
        let ring = |buffers, buffer_bytes, threads| Staging {
            buffers,
            buffer_bytes,
            threads,
            pinned: false,
            stage_host: true,
        };
        for (slots, staging, want) in [
            (1 << 40, None, "1 to 1024 slots, got 1099511627776"),
            (0, None, "got 0"),
            (2, Some(ring(1 << 40, 1, 1)), "1 to 1024 buffers"),
            (2, Some(ring(4, usize::MAX / 2, 1)), "must fit in memory"),
            (2, Some(ring(4, 4096, 1 << 40)), "at most 1024 threads"),
        ] {
            let err = Transport::new(Target::Cpu, slots, staging).err().unwrap();
            assert!(matches!(err, CudaError::InvalidArgument(_)), "{err}");
            assert!(err.to_string().contains(want), "want {want:?} in {err}");
        }
        let mut t = Transport::new(Target::Cpu, 2, Some(ring(2, 4096, 1))).unwrap();
        let src = [1u8; 16];
        let err = t.fetch(0, 0, src.as_ptr() as usize, 16).unwrap_err();
        assert!(err.to_string().contains("null pointer"), "{err}");
        let err = t
            .fetch(0, usize::MAX - 8, src.as_ptr() as usize, 16)
            .unwrap_err();
        assert!(err.to_string().contains("past the end"), "{err}");
        assert_eq!(t.stats().fetches, 0);
    }

    #[test]
    fn empty_staging_ring_is_rejected() {
        let err = Transport::new(
            Target::Cpu,
            2,
            Some(Staging {
                buffers: 0,
                buffer_bytes: 1,
                threads: 1,
                pinned: false,
                stage_host: true,
            }),
        );
        assert!(err.is_err());
    }

    #[test]
    fn cuda_target_without_driver_is_a_clear_error() {
        if crate::init().is_ok() {
            return; // a driver is present: nothing to check here
        }
        let err = Transport::new(
            Target::Cuda {
                ordinal: 0,
                copy_stream: Stream(0),
            },
            2,
            None,
        )
        .err()
        .unwrap();
        assert!(err.to_string().contains("CUDA is not available"), "{err}");
    }
}

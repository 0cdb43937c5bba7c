//! The transport of one offloaded component: K GPU (or host) slots, the copies that fill them and
//! the events that order those copies against compute.
//!
//! Per slot `s` there are two events (see [`crate::job::SlotEvents`]): compute waits on `arrived[s]`
//! before it reads the slot, the next copy into the slot waits on `consumed[s]`. The host never
//! synchronises the device in the steady state. Without a staging ring a fetch is enqueued here, on
//! the caller's thread; with one, the ring's thread enqueues it ([`crate::stager`]); both go
//! through [`crate::job::enqueue`].

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use crate::codec::{DecodeRing, DecodeStage, HostCodedUnit, StagedDecode};
use crate::deferred::ErrorSlot;
use crate::driver::{bind_context, ContextGuard, Stream};
use crate::error::{CudaError, Result};
use crate::job::{
    check_config, enqueue, CpuLane, CudaLane, FileUnit, Job, Lane, Part, Sink, Source, Span,
    Staging, Target,
};
use crate::reader::{ReadFile, ALIGN};
use crate::stager::Stager;

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

/// Field order is drop order: the lane (whose last holder may be the staging thread) and the
/// staging ring go before the files, and all before `errors`, which receives what their teardown
/// could not return.
pub struct Transport {
    target: Target,
    slots: usize,
    lane: Arc<dyn Lane>,
    stager: Option<Stager>,
    staging: Option<Staging>,
    /// Staging job sequence number of the last fetch into each slot.
    pending: Vec<u64>,
    stats: TransportStats,
    files: Vec<Arc<ReadFile>>,
    file_units: Vec<Arc<FileUnit>>,
    coded_units: Vec<Arc<HostCodedUnit>>,
    /// Coded units read from files: their layouts ([`Transport::fetch_file_coded`]).
    staged_units: Vec<Arc<ddo_core::codec::CodedUnit>>,
    decoder: Option<Arc<DecodeRing>>,
    /// Shared with the events, the ring and its threads; checked by every call that fetches or
    /// orders, returned by [`Transport::close`], passed to the process slot when dropped.
    errors: ErrorSlot,
}

impl Transport {
    /// Creates the transport. On the CUDA target the device's primary context is made current and
    /// the events are created; without a driver this fails with [`CudaError::NotAvailable`].
    pub fn new(target: Target, slots: usize, staging: Option<Staging>) -> Result<Self> {
        check_config(slots, staging.as_ref())?;
        // Events and the staging ring's page-locked buffers are created in the target's context.
        let _ctx = match target {
            Target::Cuda { ordinal, .. } => Some(bind_context(ordinal)?),
            Target::Cpu => None,
        };
        let errors = ErrorSlot::child_of(ErrorSlot::process());
        let lane: Arc<dyn Lane> = match target {
            Target::Cuda {
                ordinal,
                copy_stream,
            } => {
                let buffers = staging.map_or(0, |s| s.buffers);
                Arc::new(CudaLane::new(
                    ordinal,
                    copy_stream,
                    slots,
                    buffers,
                    &errors,
                )?)
            }
            Target::Cpu => Arc::new(CpuLane),
        };
        Self::with_lane(target, slots, staging, lane, errors)
    }

    /// [`Transport::new`] on a given lane and error slot (tests record what the lane is asked for).
    pub(crate) fn with_lane(
        target: Target,
        slots: usize,
        staging: Option<Staging>,
        lane: Arc<dyn Lane>,
        errors: ErrorSlot,
    ) -> Result<Self> {
        check_config(slots, staging.as_ref())?;
        let mut pending = Vec::new();
        pending
            .try_reserve_exact(slots)
            .map_err(|_| CudaError::OutOfMemory(format!("listing {slots} slots")))?;
        pending.resize(slots, 0);
        let stager = match staging {
            Some(cfg) => Some(Stager::start(target, Arc::clone(&lane), cfg, &errors)?),
            None => None,
        };
        Ok(Self {
            target,
            slots,
            lane,
            stager,
            staging,
            pending,
            stats: TransportStats::default(),
            files: Vec::new(),
            file_units: Vec::new(),
            coded_units: Vec::new(),
            staged_units: Vec::new(),
            decoder: None,
            errors,
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
    ///
    /// # Safety
    /// `src` is `n` readable host bytes and `dst` is `n` writable bytes of the target's memory (a
    /// device address of the target's context on the CUDA target, host memory on the CPU target),
    /// disjoint. Both stay allocated, `src` unmodified and `dst` untouched by anyone else, until
    /// the copy completed: until [`Transport::drain`] returns (or, for `dst`, until work ordered
    /// after [`Transport::acquire`] of the slot reads it).
    pub unsafe fn fetch(&mut self, slot: usize, dst: usize, src: usize, n: usize) -> Result<()> {
        self.errors.check()?;
        self.check_slot(slot)?;
        crate::host::check_host_range("fetch destination", dst, n)?;
        crate::host::check_host_range("fetch source", src, n)?;
        self.stats.fetches += 1;
        self.stats.bytes = self.stats.bytes.saturating_add(n as u64);
        let job = Job::new(Source::Host { src, n }, Sink::Slot { slot, dst });
        if let Some(stager) = self.stager.as_mut() {
            self.pending[slot] = stager.submit(job)?;
            return Ok(());
        }
        let _ctx = self.bind()?;
        let copy = Span {
            offset: 0,
            src,
            len: n,
        };
        // SAFETY: the caller upholds this function's contract, which is the copy's.
        unsafe { enqueue(&*self.lane, Part::whole(&job), [copy]) }
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
    ///
    /// # Safety
    /// `dst` is writable memory of the target (as for [`Transport::fetch`]) holding the unit's
    /// span (the end of its farthest piece), allocated and untouched by anyone else until the
    /// copies completed ([`Transport::drain`]).
    pub unsafe fn fetch_file(&mut self, slot: usize, dst: usize, unit: usize) -> Result<()> {
        self.errors.check()?;
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
        self.pending[slot] = stager.submit(Job::new(Source::File(fu), Sink::Slot { slot, dst }))?;
        Ok(())
    }

    /// Registers the layout of a coded unit read from a file (its bytes as [`Transport::add_coded_unit`]'s
    /// host buffer holds them, at some offset of a side file): its pieces are checked, and on the
    /// GPU the kernels its chunks need are compiled now, not in the first fetch. Returns its index
    /// for [`Transport::fetch_file_coded`].
    pub fn add_staged_unit(&mut self, unit: ddo_core::codec::CodedUnit) -> Result<usize> {
        crate::codec::check_pieces(&unit)?;
        if let Target::Cuda { ordinal, .. } = self.target {
            let _ctx = self.bind()?;
            crate::codec::decode_kernel(ordinal)?;
            crate::codec::compile_kernels_of(ordinal, &unit)?;
        }
        self.staged_units.push(Arc::new(unit));
        Ok(self.staged_units.len() - 1)
    }

    /// The stage that writes staged coded unit `coded` from `staged` into the slot at `dst`, once
    /// `dst` was checked to hold the unit's output span.
    fn staged_decode(&self, coded: usize, dst: usize, staged: usize) -> Result<StagedDecode> {
        let unit = self.staged_units.get(coded).cloned().ok_or_else(|| {
            CudaError::InvalidArgument(format!(
                "staged coded unit {coded} out of range ({} registered)",
                self.staged_units.len()
            ))
        })?;
        let span = unit
            .pieces
            .iter()
            .map(|p| p.dst + p.out_bytes())
            .max()
            .unwrap_or(0);
        crate::host::check_host_range("coded fetch destination", dst, span)?;
        let ordinal = match self.target {
            Target::Cuda { ordinal, .. } => Some(ordinal),
            Target::Cpu => None,
        };
        Ok(StagedDecode {
            unit,
            staged,
            out: dst,
            ordinal,
        })
    }

    /// Starts filling `slot` (at address `dst`) with staged coded unit `coded`, whose bytes file
    /// unit `file_unit` reads (through the staging ring) into `staged`; the copy stream then
    /// writes the unit's pieces into the slot: raw pieces copied, chunks decoded
    /// ([`crate::codec::StagedDecode`]). Returns without waiting.
    ///
    /// # Safety
    /// `staged` is writable memory of the target (a device address on the GPU) holding the file
    /// unit's span, which holds the coded unit's bytes; `dst` is writable memory of the target
    /// holding the coded unit's output span. Both are allocated and used by nothing but this
    /// transport's fetches until the copies completed ([`Transport::drain`]); every fetch into
    /// `staged` is made through this transport (its copy stream orders them).
    pub unsafe fn fetch_file_coded(
        &mut self,
        slot: usize,
        dst: usize,
        file_unit: usize,
        coded: usize,
        staged: usize,
    ) -> Result<()> {
        self.errors.check()?;
        self.check_slot(slot)?;
        let fu = self.file_units.get(file_unit).cloned().ok_or_else(|| {
            CudaError::InvalidArgument(format!(
                "file unit {file_unit} out of range ({} registered)",
                self.file_units.len()
            ))
        })?;
        let stage = self.staged_decode(coded, dst, staged)?;
        if fu.span < stage.unit.nbytes {
            return Err(CudaError::InvalidArgument(format!(
                "file unit {file_unit} reads {} bytes, and staged coded unit {coded} needs {}",
                fu.span, stage.unit.nbytes
            )));
        }
        crate::host::check_host_range("coded file staging buffer", staged, fu.span)?;
        let stager = self.stager.as_mut().ok_or_else(|| {
            CudaError::InvalidArgument("units read from files need a staging ring".into())
        })?;
        self.stats.fetches += 1;
        self.stats.bytes = self.stats.bytes.saturating_add(fu.copy_bytes);
        self.stats.file_fetches += 1;
        self.stats.disk_bytes = self.stats.disk_bytes.saturating_add(fu.read_bytes);
        // the copies land at `staged` (the sink's address); the slot's events order the job
        let mut job = Job::new(Source::File(fu), Sink::Slot { slot, dst: staged });
        job.post_copy = Some(Arc::new(stage));
        self.pending[slot] = stager.submit(job)?;
        Ok(())
    }

    /// Starts filling `slot` (at address `dst`) with staged coded unit `coded` whose bytes are in
    /// host memory at `host` (the NVMe route's RAM cache of coded units): copied into `staged`,
    /// then written into the slot as [`Transport::fetch_file_coded`] does. With a staging ring the
    /// ring's thread queues it, in order with the file jobs.
    ///
    /// # Safety
    /// `host` is the coded unit's `nbytes` readable host bytes (page-locked on the GPU for an
    /// asynchronous copy), unmodified until the fetch completed; `staged` and `dst` as for
    /// [`Transport::fetch_file_coded`].
    pub unsafe fn fetch_host_coded(
        &mut self,
        slot: usize,
        dst: usize,
        coded: usize,
        host: usize,
        staged: usize,
    ) -> Result<()> {
        self.errors.check()?;
        self.check_slot(slot)?;
        let stage = self.staged_decode(coded, dst, staged)?;
        let n = stage.unit.nbytes;
        crate::host::check_host_range("coded host fetch source", host, n)?;
        crate::host::check_host_range("coded host fetch staging buffer", staged, n)?;
        self.stats.fetches += 1;
        self.stats.bytes = self.stats.bytes.saturating_add(n as u64);
        let mut job = Job::new(
            Source::Host { src: host, n },
            Sink::Slot { slot, dst: staged },
        );
        job.post_copy = Some(Arc::new(stage));
        if let Some(stager) = self.stager.as_mut() {
            self.pending[slot] = stager.submit(job)?;
            return Ok(());
        }
        let _ctx = self.bind()?;
        let copy = Span {
            offset: 0,
            src: host,
            len: n,
        };
        // SAFETY: the caller upholds this function's contract, which is the copy's.
        unsafe { enqueue(&*self.lane, Part::whole(&job), [copy]) }
    }

    /// Gives the transport its decode ring for coded units (CUDA target): `landing` device buffers
    /// of `landing_bytes` each and the stream decodes run on.
    ///
    /// # Safety
    /// As [`DecodeRing::new`]: the landing buffers are device memory of the target's device,
    /// 16-byte aligned, used by nothing else, and they and the stream stay alive until the
    /// transport is closed or dropped.
    pub unsafe fn set_decoder(
        &mut self,
        decode_stream: Stream,
        landing: Vec<usize>,
        landing_bytes: usize,
    ) -> Result<()> {
        let Target::Cuda { ordinal, .. } = self.target else {
            return Err(CudaError::InvalidArgument(
                "the CPU target decodes on the host: it has no decode ring".into(),
            ));
        };
        if self.decoder.is_some() || !self.coded_units.is_empty() {
            // the units' batches were made for the ring they were registered with
            return Err(CudaError::InvalidArgument(
                "a transport gets its decode ring once, before its coded units".into(),
            ));
        }
        let _ctx = self.bind()?;
        // SAFETY: the caller upholds `DecodeRing::new`'s contract.
        let ring = unsafe {
            DecodeRing::new(ordinal, decode_stream, landing, landing_bytes, &self.errors)?
        };
        self.decoder = Some(Arc::new(ring));
        Ok(())
    }

    /// Registers a unit held in coded form in `unit.nbytes` host bytes at `host`; returns its index.
    /// A coded chunk larger than the decode ring's landing buffers is refused.
    pub fn add_coded_unit(
        &mut self,
        unit: ddo_core::codec::CodedUnit,
        host: usize,
    ) -> Result<usize> {
        crate::host::check_host_range("coded unit", host, unit.nbytes)?;
        crate::codec::check_pieces(&unit)?;
        if let Target::Cuda { .. } = self.target {
            let need = unit.largest_coded();
            let have = self.decoder.as_ref().map_or(0, |r| r.landing_bytes());
            if need > have {
                return Err(CudaError::InvalidArgument(format!(
                    "a coded chunk of {need} bytes needs landing buffers that large, the decode ring has {have} \
                     (set_decoder first)"
                )));
            }
            if let (Some(_), Target::Cuda { ordinal, .. }) = (&self.decoder, &self.target) {
                let _ctx = self.bind()?;
                crate::codec::compile_kernels_of(*ordinal, &unit)?; // now, not in the first fetch
            }
        }
        let batches = match &self.decoder {
            Some(ring) => ring.batches(&unit)?,
            None => Vec::new(),
        };
        let link_bytes = match self.target {
            Target::Cuda { .. } => ddo_core::landing::link_bytes(&unit, &batches),
            Target::Cpu => unit.nbytes,
        };
        let direct = ddo_core::landing::direct_pieces(&unit, &batches);
        self.coded_units.push(Arc::new(HostCodedUnit {
            unit,
            host,
            batches,
            direct,
            link_bytes,
        }));
        Ok(self.coded_units.len() - 1)
    }

    /// Bytes one fetch of coded unit `unit` sends over the link: its raw pieces and, on the GPU,
    /// its batches of chunks (`ddo_core::landing::link_bytes`); on the CPU target its host buffer.
    pub fn coded_link_bytes(&self, unit: usize) -> Result<usize> {
        let cu = self.coded_units.get(unit).ok_or_else(|| {
            CudaError::InvalidArgument(format!(
                "coded unit {unit} out of range ({} registered)",
                self.coded_units.len()
            ))
        })?;
        Ok(cu.link_bytes)
    }

    /// Starts filling `slot` (at address `dst`) with coded unit `unit`: its raw pieces copied
    /// into the slot, its coded chunks through the landing buffers and decoded. Returns without
    /// waiting. Needs the direct path (no staging ring).
    ///
    /// # Safety
    /// The unit's host buffer (as registered) is readable, unmodified and allocated, and `dst` is
    /// writable memory of the target holding the unit's span, until the fetch completed
    /// ([`Transport::drain`]), as for [`Transport::fetch`].
    pub unsafe fn fetch_coded(&mut self, slot: usize, dst: usize, unit: usize) -> Result<()> {
        self.errors.check()?;
        self.check_slot(slot)?;
        if self.stager.is_some() {
            return Err(CudaError::InvalidArgument(
                "coded units are fetched on the direct path, without a staging ring".into(),
            ));
        }
        let cu = self.coded_units.get(unit).cloned().ok_or_else(|| {
            CudaError::InvalidArgument(format!(
                "coded unit {unit} out of range ({} registered)",
                self.coded_units.len()
            ))
        })?;
        let span = cu
            .unit
            .pieces
            .iter()
            .map(|p| p.dst + p.out_bytes())
            .max()
            .unwrap_or(0);
        crate::host::check_host_range("coded fetch destination", dst, span)?;
        self.stats.fetches += 1;
        self.stats.bytes = self.stats.bytes.saturating_add(cu.link_bytes as u64);
        let copies: Vec<Span> = cu
            .direct
            .iter()
            .map(|&i| &cu.unit.pieces[i])
            .filter(|p| matches!(p.kind, ddo_core::codec::PieceKind::Raw(_)))
            .map(|p| Span {
                offset: p.dst,
                src: cu.host + p.src,
                len: p.len,
            })
            .collect();
        let mut job = Job::new(
            Source::Host {
                src: cu.host,
                n: cu.unit.nbytes,
            },
            Sink::Slot { slot, dst },
        );
        job.post_copy = Some(Arc::new(DecodeStage::new(cu, self.decoder.clone())));
        let _ctx = self.bind()?;
        // SAFETY: the caller upholds this function's contract: every raw piece reads the unit's
        // host buffer and writes inside the slot's span.
        unsafe { enqueue(&*self.lane, Part::whole(&job), copies) }
    }

    /// Makes `compute_stream` wait until the last fetch into `slot` has landed.
    pub fn acquire(&mut self, slot: usize, compute_stream: Stream) -> Result<()> {
        self.errors.check()?;
        self.check_slot(slot)?;
        if let Some(stager) = self.stager.as_ref() {
            let t0 = Instant::now();
            stager.wait(self.pending[slot])?;
            let waited = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
            self.stats.host_wait_ns = self.stats.host_wait_ns.saturating_add(waited);
        }
        let _ctx = self.bind()?;
        self.lane.acquire(slot, compute_stream)
    }

    /// Marks `slot` as consumed by the work queued so far on `compute_stream`.
    pub fn release(&mut self, slot: usize, compute_stream: Stream) -> Result<()> {
        self.errors.check()?;
        self.check_slot(slot)?;
        let _ctx = self.bind()?;
        self.lane.release(slot, compute_stream)
    }

    /// Marks every slot as both consumed and arrived by the work queued so far on `stream`: after
    /// work this transport's events did not see wrote and read the slots (a CUDA graph replaying
    /// fetches and their consumers), the next fetch into a slot waits for that work, and so does
    /// a consumer on any stream. Nothing to do on the CPU target.
    pub fn fence_slots(&mut self, stream: Stream) -> Result<()> {
        self.errors.check()?;
        let _ctx = self.bind()?;
        for slot in 0..self.slots {
            self.lane.fence(slot, stream)?;
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
        let _ctx = self.bind()?;
        self.lane.synchronize()?;
        if let Some(ring) = &self.decoder {
            ring.synchronize()?;
        }
        staged?;
        self.errors.check()
    }

    /// Drains, then frees the events, the staging ring and its threads, and returns the first
    /// error of all that: the drain's, or one their teardown met (which `Drop` cannot return; see
    /// [`crate::ErrorSlot`]). Dropping a transport without `close` passes such errors to the
    /// process slot ([`crate::take_deferred_error`]).
    pub fn close(mut self) -> Result<()> {
        let drained = self.drain();
        let errors = self.errors.clone();
        drop(self); // joins the staging thread, destroys the events: failures land in `errors`
        drained?;
        errors.check()
    }
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
            let dst = slots[s].as_mut_ptr() as usize;
            // SAFETY: the slot and the source are live vectors of `src.len()` bytes, kept past
            // the drain.
            unsafe { t.fetch(s, dst, src.as_ptr() as usize, src.len()) }.unwrap();
            t.acquire(s, Stream::DEFAULT).unwrap();
            assert_eq!(&slots[s], src, "unit {u}");
            t.release(s, Stream::DEFAULT).unwrap();
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
            piece_bytes: 0,
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
            piece_bytes: 0,
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
                piece_bytes: 0,
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
            let other = slots[1 - s].as_mut_ptr() as usize;
            // SAFETY: both slots are live 100 000-byte vectors (more than either unit's span),
            // kept past the drain.
            unsafe { t.fetch_file(s, dst, u0) }.unwrap();
            // SAFETY: as above.
            unsafe { t.fetch_file(1 - s, other, u1) }.unwrap();
            t.acquire(s, Stream::DEFAULT).unwrap();
            t.acquire(1 - s, Stream::DEFAULT).unwrap();
            assert_eq!(&slots[s][..10_000], &data[0][7..10_007]);
            assert_eq!(&slots[s][10_240..60_240], &data[0][10_007..60_007]);
            assert_eq!(&slots[s][60_416..61_415], &data[1][100..1099]);
            assert_eq!(&slots[1 - s][..], &data[1][200_001..]);
            t.release(s, Stream::DEFAULT).unwrap();
            t.release(1 - s, Stream::DEFAULT).unwrap();
            // host (RAM-cache) sources interleave with file sources
            // SAFETY: the slot holds 100 000 bytes, `host` 5000; both live past the drain.
            unsafe { t.fetch(s, dst, host.as_ptr() as usize, host.len()) }.unwrap();
            t.acquire(s, Stream::DEFAULT).unwrap();
            assert_eq!(&slots[s][..5000], &host[..]);
            t.release(s, Stream::DEFAULT).unwrap();
        }
        t.drain().unwrap();
        assert_eq!(t.stats().file_fetches, 6);
        assert!(t.stats().disk_bytes >= 3 * (60_999 + 100_000));
        // truncating a file makes the next read of it a read error
        std::fs::write(dir.join("1.bin"), &data[1][..1000]).unwrap();
        // SAFETY: the slot is a live 100 000-byte vector, kept past the transport.
        unsafe { t.fetch_file(0, slots[0].as_mut_ptr() as usize, u1) }.unwrap();
        let err = t.acquire(0, Stream::DEFAULT).unwrap_err();
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
                piece_bytes: 0,
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
                    t.acquire(ps, Stream::DEFAULT).unwrap();
                    assert_eq!(
                        &slots[ps][..expect.len()],
                        expect,
                        "round {round} job {}",
                        k - slots_n
                    );
                    t.release(ps, Stream::DEFAULT).unwrap();
                }
                let dst = slots[s].as_mut_ptr() as usize;
                if (k + round) % 5 == 0 {
                    // SAFETY: the slot holds 80 000 bytes, `host` 50 000; both outlive the drain.
                    unsafe { t.fetch(s, dst, host.as_ptr() as usize, host.len()) }.unwrap();
                    jobs.push((s, &host[..]));
                } else {
                    // SAFETY: the slot holds 80 000 bytes (more than any unit's span), kept past
                    // the drain.
                    unsafe { t.fetch_file(s, dst, id) }.unwrap();
                    jobs.push((s, &data[off as usize..off as usize + len]));
                }
            }
            for &(s, expect) in &jobs[units.len() - slots_n..] {
                t.acquire(s, Stream::DEFAULT).unwrap();
                assert_eq!(&slots[s][..expect.len()], expect, "round {round} tail");
                t.release(s, Stream::DEFAULT).unwrap();
            }
        }
        t.drain().unwrap();
        // an error in the middle of a queue of jobs fails the waits and the drain, never hangs
        std::fs::write(&path, &data[..100_000]).unwrap();
        for s in 0..slots_n {
            let dst = slots[s].as_mut_ptr() as usize;
            // SAFETY: as above.
            unsafe { t.fetch_file(s, dst, units[s].0) }.unwrap();
        }
        let err = t.acquire(slots_n - 1, Stream::DEFAULT).unwrap_err();
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

    /// Every job, direct or through the ring, follows the one sequence of `job::enqueue`: the
    /// lane sees, job after job in submission order, the slot's wait, copies into that slot only
    /// (each staging buffer's upload recorded after the copies out of it), then its arrival.
    #[test]
    fn every_job_follows_the_one_sequence() {
        use crate::job::tests::{Op, Recorder};
        let dir = std::env::temp_dir().join(format!("ddo-sequence-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let data: Vec<u8> = (0..400_000).map(|i| (i * 17 % 253) as u8).collect();
        let path = dir.join("w.bin");
        std::fs::write(&path, &data).unwrap();
        let host: Vec<u8> = (0..30_000).map(|i| (i % 11) as u8).collect();
        let ring = |stage_host| Staging {
            buffers: 2,
            buffer_bytes: 4 * 4096,
            threads: 2,
            pinned: false,
            stage_host,
            piece_bytes: 0,
        };
        for staging in [None, Some(ring(false)), Some(ring(true))] {
            let rec = Arc::new(Recorder::default());
            let lane: Arc<dyn Lane> = rec.clone();
            let errors = ErrorSlot::default();
            let mut t = Transport::with_lane(Target::Cpu, 3, staging, lane, errors).unwrap();
            let file = staging.map(|_| {
                t.open_file(&path, true).unwrap();
                let piece = |offset, len, dst| ddo_core::ReadPiece {
                    file: 0,
                    offset,
                    len,
                    dst,
                };
                // 3 chunks of one buffer each, two pieces
                t.add_file_unit(&[piece(5, 20_000, 0), piece(30_000, 15_000, 20_480)], 0)
                    .unwrap()
            });
            let mut slots = vec![vec![0u8; 40_000]; 3];
            let ranges: Vec<(usize, usize)> = slots
                .iter_mut()
                .map(|v| (v.as_mut_ptr() as usize, v.len()))
                .collect();
            let mut order = Vec::new();
            // per job: whether its copies read staging buffers (file units, staged host sources)
            let mut buffered = Vec::new();
            for k in 0..9 {
                let s = k % 3;
                if k >= 3 {
                    t.acquire(s, Stream::DEFAULT).unwrap();
                    t.release(s, Stream::DEFAULT).unwrap();
                }
                match file {
                    Some(u) if k % 2 == 0 => {
                        // SAFETY: the slot holds 40 000 bytes, more than the unit's span; it
                        // outlives the drain.
                        unsafe { t.fetch_file(s, ranges[s].0, u) }.unwrap();
                    }
                    _ => {
                        // SAFETY: the slot holds 40 000 bytes, `host` 30 000; both outlive the drain.
                        unsafe { t.fetch(s, ranges[s].0, host.as_ptr() as usize, host.len()) }
                            .unwrap();
                    }
                }
                order.push(s);
                buffered
                    .push((file.is_some() && k % 2 == 0) || staging.is_some_and(|r| r.stage_host));
            }
            t.drain().unwrap();
            let mut open: Option<usize> = None;
            let mut arrived = Vec::new();
            let mut unrecorded_copies = 0;
            for op in rec.ops() {
                match (op, open) {
                    (Op::WaitUploaded(_), _) => {}
                    (Op::Wait(s), None) => open = Some(s),
                    (Op::Copy { dst, n, .. }, Some(s)) => {
                        let (base, len) = ranges[s];
                        assert!(
                            dst >= base && dst + n <= base + len,
                            "{op:?} outside slot {s}"
                        );
                        unrecorded_copies += 1;
                    }
                    (Op::Uploaded(_), Some(_)) => unrecorded_copies = 0,
                    (Op::Arrived(s), Some(o)) if s == o => {
                        // a buffer's record follows the copies out of it; a straight host job
                        // is one copy and reads no buffer
                        let want = if buffered[arrived.len()] { 0 } else { 1 };
                        assert_eq!(unrecorded_copies, want, "{staging:?}");
                        unrecorded_copies = 0;
                        arrived.push(s);
                        open = None;
                    }
                    (op, open) => panic!("{op:?} while job of slot {open:?} is open ({staging:?})"),
                }
            }
            assert_eq!(open, None);
            assert_eq!(arrived, order, "{staging:?}");
            drop(t);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// After a graph replay the fence marks every slot arrived on the stream it names (and
    /// consumed there: the recorder does not log releases).
    #[test]
    fn fence_slots_marks_every_slot_on_the_stream() {
        use crate::job::tests::{Op, Recorder};
        let rec = Arc::new(Recorder::default());
        let lane: Arc<dyn Lane> = rec.clone();
        let mut t = Transport::with_lane(Target::Cpu, 3, None, lane, ErrorSlot::default()).unwrap();
        t.fence_slots(Stream::DEFAULT).unwrap();
        let h = Stream::DEFAULT.handle();
        assert_eq!(
            rec.ops(),
            vec![
                Op::ArrivedOn(0, h),
                Op::ArrivedOn(1, h),
                Op::ArrivedOn(2, h)
            ]
        );
    }

    /// A CPU lane whose teardown fails, as destroying a CUDA event can.
    struct FailsOnDrop(ErrorSlot);

    impl Lane for FailsOnDrop {
        fn stream(&self) -> Option<Stream> {
            None
        }
        fn wait_consumed(&self, slot: usize) -> Result<()> {
            CpuLane.wait_consumed(slot)
        }
        unsafe fn copy(&self, dst: usize, src: usize, n: usize) -> Result<()> {
            // SAFETY: the caller upholds `Lane::copy`'s contract.
            unsafe { CpuLane.copy(dst, src, n) }
        }
        fn record_uploaded(&self, buffer: usize) -> Result<()> {
            CpuLane.record_uploaded(buffer)
        }
        fn wait_uploaded(&self, buffer: usize) -> Result<()> {
            CpuLane.wait_uploaded(buffer)
        }
        fn record_arrived(&self, slot: usize) -> Result<()> {
            CpuLane.record_arrived(slot)
        }
        fn acquire(&self, slot: usize, compute: Stream) -> Result<()> {
            CpuLane.acquire(slot, compute)
        }
        fn release(&self, slot: usize, compute: Stream) -> Result<()> {
            CpuLane.release(slot, compute)
        }
        fn synchronize(&self) -> Result<()> {
            CpuLane.synchronize()
        }
    }

    impl Drop for FailsOnDrop {
        fn drop(&mut self) {
            self.0
                .record("destroying an event", "CUDA_ERROR_INVALID_CONTEXT (test)");
        }
    }

    fn small_ring() -> Staging {
        Staging {
            buffers: 2,
            buffer_bytes: 4096,
            threads: 1,
            pinned: false,
            stage_host: true,
            piece_bytes: 0,
        }
    }

    #[test]
    fn an_error_recorded_where_it_could_not_be_returned_fails_the_next_call_once() {
        let parent = ErrorSlot::default();
        let mut t = Transport::with_lane(
            Target::Cpu,
            2,
            None,
            Arc::new(CpuLane),
            ErrorSlot::child_of(&parent),
        )
        .unwrap();
        let src = [5u8; 64];
        let mut slot = [0u8; 64];
        t.errors
            .record("destroying an event", "CUDA_ERROR_UNKNOWN (test)");
        let err = t.acquire(0, Stream::DEFAULT).unwrap_err();
        assert!(matches!(err, CudaError::Deferred(_)), "{err}");
        assert!(err.to_string().contains("destroying an event"), "{err}");
        // reported once: the pipeline goes on
        // SAFETY: two live, disjoint 64-byte arrays, kept past the close.
        unsafe { t.fetch(0, slot.as_mut_ptr() as usize, src.as_ptr() as usize, 64) }.unwrap();
        t.acquire(0, Stream::DEFAULT).unwrap();
        assert_eq!(slot, src);
        t.close().unwrap();
        assert!(parent.take().is_none());
    }

    #[test]
    fn close_returns_what_the_teardown_could_not() {
        for staging in [None, Some(small_ring())] {
            let parent = ErrorSlot::default();
            let errors = ErrorSlot::child_of(&parent);
            let lane = Arc::new(FailsOnDrop(errors.clone()));
            let t = Transport::with_lane(Target::Cpu, 2, staging, lane, errors).unwrap();
            // with a ring, the staging thread holds the lane last: close joins it first
            let err = t.close().unwrap_err();
            assert!(matches!(err, CudaError::Deferred(_)), "{staging:?}: {err}");
            assert!(err.to_string().contains("INVALID_CONTEXT"), "{err}");
            assert!(parent.take().is_none(), "taken by close, not passed on");
        }
    }

    #[test]
    fn a_transport_dropped_without_close_passes_its_errors_to_the_process_slot() {
        let parent = ErrorSlot::default(); // stands for the process slot
        let errors = ErrorSlot::child_of(&parent);
        let lane = Arc::new(FailsOnDrop(errors.clone()));
        let t = Transport::with_lane(Target::Cpu, 2, Some(small_ring()), lane, errors).unwrap();
        drop(t);
        let err = parent.take().unwrap();
        assert!(err.to_string().contains("destroying an event"), "{err}");
    }

    #[test]
    fn file_units_need_a_ring_and_valid_indices() {
        let mut t = Transport::new(Target::Cpu, 2, None).unwrap();
        assert!(t.add_file_unit(&[], 0).is_err());
        // SAFETY: refused before any copy (no unit, no ring).
        assert!(unsafe { t.fetch_file(0, 0, 0) }.is_err());
    }

    #[test]
    fn bad_slot_is_an_error() {
        let mut t = Transport::new(Target::Cpu, 2, None).unwrap();
        assert!(matches!(
            t.acquire(5, Stream::DEFAULT),
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
            piece_bytes: 0,
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
        // SAFETY: refused before any copy (a null destination).
        let err = unsafe { t.fetch(0, 0, src.as_ptr() as usize, 16) }.unwrap_err();
        assert!(err.to_string().contains("null pointer"), "{err}");
        // SAFETY: refused before any copy (a destination past the end of the address space).
        let err = unsafe { t.fetch(0, usize::MAX - 8, src.as_ptr() as usize, 16) }.unwrap_err();
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
                piece_bytes: 0,
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
                copy_stream: Stream::DEFAULT,
            },
            2,
            None,
        )
        .err()
        .unwrap();
        assert!(err.to_string().contains("CUDA is not available"), "{err}");
    }
}

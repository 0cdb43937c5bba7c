//! The transport of one offloaded component: K GPU (or host) slots, the copies that fill them and
//! the events that order those copies against compute.
//!
//! Per slot `s` there are two events. `arrived[s]` is recorded on the copy stream after a unit's
//! bytes were queued into the slot; compute waits on it (GPU side). `consumed[s]` is recorded on the
//! compute stream after the unit ran; the next copy into the slot waits on it (GPU side). The host
//! never synchronises the device in the steady state.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys;

use crate::driver::{check, make_current, Stream};
use crate::error::{CudaError, Result};
use crate::event::Event;
use crate::stager::{Job, Stager};

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
}

/// Counters a report reads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransportStats {
    pub fetches: u64,
    pub bytes: u64,
    /// Host nanoseconds spent in `acquire` waiting for the staging thread.
    pub host_wait_ns: u64,
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
    /// Staging job sequence number of the last fetch into each slot.
    pending: Vec<u64>,
    stats: TransportStats,
}

impl Transport {
    /// Creates the transport. On the CUDA target the device's primary context is made current and
    /// the events are created; without a driver this fails with [`CudaError::NotAvailable`].
    pub fn new(target: Target, slots: usize, staging: Option<Staging>) -> Result<Self> {
        let events = match target {
            Target::Cuda { ordinal, .. } => {
                make_current(ordinal)?;
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
            pending: vec![0; slots],
            stats: TransportStats::default(),
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

    fn bind(&self) -> Result<()> {
        match self.target {
            Target::Cuda { ordinal, .. } => make_current(ordinal),
            Target::Cpu => Ok(()),
        }
    }

    /// Starts filling `slot` (at address `dst`) with `n` bytes from host address `src`, after the
    /// slot's previous unit was consumed. Returns without waiting for the copy.
    pub fn fetch(&mut self, slot: usize, dst: usize, src: usize, n: usize) -> Result<()> {
        self.check_slot(slot)?;
        self.stats.fetches += 1;
        self.stats.bytes += n as u64;
        if let Some(stager) = self.stager.as_mut() {
            self.pending[slot] = stager.submit(Job { slot, dst, src, n })?;
            return Ok(());
        }
        match (self.target, self.events.as_deref()) {
            (Target::Cuda { copy_stream, .. }, Some(ev)) => {
                self.bind()?;
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

    /// Makes `compute_stream` wait until the last fetch into `slot` has landed.
    pub fn acquire(&mut self, slot: usize, compute_stream: Stream) -> Result<()> {
        self.check_slot(slot)?;
        if let Some(stager) = self.stager.as_ref() {
            let t0 = Instant::now();
            stager.wait(self.pending[slot])?;
            self.stats.host_wait_ns += t0.elapsed().as_nanos() as u64;
        }
        if let Some(ev) = self.events.as_deref() {
            self.bind()?;
            ev.arrived[slot].wait_on(compute_stream)?;
        }
        Ok(())
    }

    /// Marks `slot` as consumed by the work queued so far on `compute_stream`.
    pub fn release(&mut self, slot: usize, compute_stream: Stream) -> Result<()> {
        self.check_slot(slot)?;
        if let Some(ev) = self.events.as_deref() {
            self.bind()?;
            ev.consumed[slot].record(compute_stream)?;
        }
        Ok(())
    }

    /// Blocks until every fetch issued so far has completed (used before slots or sources are freed).
    pub fn drain(&mut self) -> Result<()> {
        if let Some(stager) = self.stager.as_ref() {
            stager.wait_all()?;
        }
        if let Target::Cuda { copy_stream, .. } = self.target {
            self.bind()?;
            // SAFETY: the stream handle is owned by PyTorch and alive while the transport is.
            check(
                unsafe { sys::cuStreamSynchronize(copy_stream.raw()) },
                "cuStreamSynchronize",
                "draining copies",
            )?;
        }
        Ok(())
    }
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
        }));
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
    fn empty_staging_ring_is_rejected() {
        let err = Transport::new(
            Target::Cpu,
            2,
            Some(Staging {
                buffers: 0,
                buffer_bytes: 1,
                threads: 1,
                pinned: false,
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

//! CUDA events: the only ordering primitive between the copy stream and the compute stream.

use cudarc::driver::sys;

use crate::deferred::ErrorSlot;
use crate::driver::{bind_primary, check, init, Stream};
use crate::error::Result;

/// An event created with `CU_EVENT_DISABLE_TIMING` (the cheapest kind) in the current context;
/// its owner drops it with that context current (the transport's lane binds it).
#[derive(Debug)]
pub struct Event {
    ev: sys::CUevent,
    /// Where a failure to destroy it goes.
    errors: ErrorSlot,
}

// SAFETY: a CUevent is a driver handle; the driver API is thread-safe and the handle may be used
// from any thread whose current context is the one it was created in (always the primary one here).
unsafe impl Send for Event {}
// SAFETY: see above; recording and waiting are synchronised by the driver.
unsafe impl Sync for Event {}

impl Event {
    /// Creates an event in the calling thread's current context; a failure to destroy it is
    /// recorded in `errors`.
    pub fn new(errors: &ErrorSlot) -> Result<Self> {
        init()?;
        let mut ev: sys::CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as std::ffi::c_uint;
        // SAFETY: valid out-pointer; a context is current (callers run make_current first).
        check(
            unsafe { sys::cuEventCreate(&mut ev, flags) },
            "cuEventCreate",
            "creating an event",
        )?;
        Ok(Self {
            ev,
            errors: errors.clone(),
        })
    }

    /// `n` events, as [`Event::new`].
    pub fn many(n: usize, errors: &ErrorSlot) -> Result<Vec<Self>> {
        (0..n).map(|_| Self::new(errors)).collect()
    }

    /// Records the event on `stream`: it completes when the work queued so far on it completes.
    pub fn record(&self, stream: Stream) -> Result<()> {
        // SAFETY: the event is live; `Stream` holds 0 or a live stream of this context
        // (`Stream::from_raw`'s contract).
        check(
            unsafe { sys::cuEventRecord(self.ev, stream.raw()) },
            "cuEventRecord",
            "recording an event",
        )
    }

    /// Makes `stream` wait (on the GPU, the host does not block) for the last record of this event.
    pub fn wait_on(&self, stream: Stream) -> Result<()> {
        // SAFETY: as for `record`.
        check(
            unsafe { sys::cuStreamWaitEvent(stream.raw(), self.ev, 0) },
            "cuStreamWaitEvent",
            "ordering streams",
        )
    }

    /// Whether the last record has completed (an event never recorded counts as complete).
    pub fn query(&self) -> Result<bool> {
        // SAFETY: the event is live.
        let code = unsafe { sys::cuEventQuery(self.ev) };
        if code == sys::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check(code, "cuEventQuery", "querying an event").map(|_| true)
    }

    /// Blocks the calling host thread until the last record has completed.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: the event is live.
        check(
            unsafe { sys::cuEventSynchronize(self.ev) },
            "cuEventSynchronize",
            "waiting for an event",
        )
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: the event is live and dropped once.
        let code = unsafe { sys::cuEventDestroy_v2(self.ev) };
        if let Err(e) = check(code, "cuEventDestroy", "destroying an event") {
            self.errors.record("destroying an event", e);
        }
    }
}

/// Destroys `sets` of events with the primary context of device `ordinal` bound (their owner's
/// last holder may be a thread whose current context is another one, or none); a failure to bind
/// goes to `errors`.
pub(crate) fn destroy_bound(ordinal: usize, errors: &ErrorSlot, sets: &mut [&mut Vec<Event>]) {
    let bound = bind_primary(ordinal);
    if let Err(e) = &bound {
        errors.record("binding the context to destroy events", e);
    }
    for set in sets.iter_mut() {
        set.clear();
    }
    drop(bound);
}

//! Errors that cannot be returned where they happen: in `Drop` (destroying an event, unregistering
//! host memory, restoring the previous context, joining a thread) and at a staging thread's
//! shutdown. They are recorded in an [`ErrorSlot`] and returned by the next fallible call that
//! checks it (cudarc's pattern: `CudaContext::record_err` / `check_err`), never logged to an output
//! nobody reads.
//!
//! A [`crate::Transport`] owns a slot shared with everything it creates (events, the staging ring
//! and its threads): its calls check it, and [`crate::Transport::close`] returns what its own
//! teardown recorded. Objects that no transport owns (a [`crate::HostRegistration`] made from
//! Python, a [`crate::ContextGuard`]) record into the process slot, which is checked when a context
//! is next bound ([`crate::bind_context`]) and read by [`take_deferred_error`]. A slot dropped
//! with an error nobody took passes it to its parent (the process slot), so nothing is lost.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use crate::error::{CudaError, Result};

/// Where errors that could not be returned wait for the next fallible call. Cloning shares it.
#[derive(Debug, Clone, Default)]
pub struct ErrorSlot(Arc<Inner>);

#[derive(Debug, Default)]
struct Inner {
    /// Fast path for the checks on every call: whether `recorded` holds anything.
    set: AtomicBool,
    recorded: Mutex<Recorded>,
    /// Receives what is still recorded when the last clone is dropped.
    parent: Option<ErrorSlot>,
}

#[derive(Debug, Default)]
struct Recorded {
    /// The first error, with what was being done.
    first: Option<String>,
    /// Errors recorded after the first one.
    more: usize,
}

impl ErrorSlot {
    /// A slot that passes what nobody took to `parent` when it is dropped.
    pub fn child_of(parent: &ErrorSlot) -> Self {
        Self(Arc::new(Inner {
            set: AtomicBool::new(false),
            recorded: Mutex::default(),
            parent: Some(parent.clone()),
        }))
    }

    /// The process slot: errors of objects that no transport owns, and the leftovers of every
    /// transport slot.
    pub fn process() -> &'static ErrorSlot {
        static PROCESS: OnceLock<ErrorSlot> = OnceLock::new();
        PROCESS.get_or_init(ErrorSlot::default)
    }

    fn lock(&self) -> MutexGuard<'_, Recorded> {
        // never panics: a poisoned lock only means a thread panicked while holding it
        match self.0.recorded.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Records an error met while `during` (e.g. "destroying an event"). The first one is kept
    /// with its message; later ones are counted.
    pub fn record(&self, during: &str, error: impl std::fmt::Display) {
        self.record_message(format!("{during}: {error}"), 1);
    }

    fn record_message(&self, message: String, count: usize) {
        let mut r = self.lock();
        if r.first.is_none() {
            r.first = Some(message);
            r.more += count - 1;
        } else {
            r.more += count;
        }
        self.0.set.store(true, Ordering::Release);
    }

    /// Takes what was recorded, if anything, as one [`CudaError::Deferred`]; the slot is then empty.
    pub fn take(&self) -> Option<CudaError> {
        if !self.0.set.load(Ordering::Acquire) {
            return None;
        }
        let (first, more) = self.take_raw()?;
        let others = match more {
            0 => String::new(),
            1 => " (and 1 more error)".to_string(),
            n => format!(" (and {n} more errors)"),
        };
        Some(CudaError::Deferred(format!("{first}{others}")))
    }

    fn take_raw(&self) -> Option<(String, usize)> {
        let mut r = self.lock();
        self.0.set.store(false, Ordering::Release);
        let first = r.first.take()?;
        Some((first, std::mem::take(&mut r.more)))
    }

    /// `Err` with what was recorded (then cleared), `Ok` when nothing was: the check at the start
    /// of a fallible call.
    pub fn check(&self) -> Result<()> {
        match self.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let Some(parent) = self.parent.take() else {
            return;
        };
        let recorded = match self.recorded.get_mut() {
            Ok(r) => r,
            Err(p) => p.into_inner(),
        };
        if let Some(first) = recorded.first.take() {
            parent.record_message(first, recorded.more + 1);
        }
    }
}

/// Takes the errors recorded in the process slot (see the module docs), if any.
pub fn take_deferred_error() -> Option<CudaError> {
    ErrorSlot::process().take()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_error_is_kept_the_others_counted_and_a_take_clears() {
        let slot = ErrorSlot::default();
        assert!(slot.check().is_ok());
        slot.record("destroying an event", "CUDA_ERROR_INVALID_HANDLE");
        slot.clone().record("unregistering host memory", "boom");
        slot.record("joining a thread", "it panicked");
        let err = slot.check().unwrap_err();
        assert!(matches!(err, CudaError::Deferred(_)), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains("destroying an event: CUDA_ERROR_INVALID_HANDLE")
                && msg.contains("(and 2 more errors)")
                && msg.contains("could not be reported"),
            "{msg}"
        );
        assert!(slot.check().is_ok() && slot.take().is_none());
    }

    #[test]
    fn a_slot_dropped_with_an_error_passes_it_to_its_parent() {
        let parent = ErrorSlot::default();
        let child = ErrorSlot::child_of(&parent);
        child.record("destroying an event", "first");
        child.record("destroying an event", "second");
        let held = child.clone();
        drop(child);
        assert!(parent.take().is_none(), "a clone still holds the slot");
        drop(held);
        let msg = parent.take().unwrap().to_string();
        assert!(
            msg.contains("first") && msg.contains("(and 1 more error)"),
            "{msg}"
        );
        // a slot whose errors were taken passes nothing on
        let child = ErrorSlot::child_of(&parent);
        child.record("x", "y");
        assert!(child.take().is_some());
        drop(child);
        assert!(parent.take().is_none());
    }
}

//! Lock-free transfer counters shared between the offload threads.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

/// Running totals, updated with relaxed atomics from any thread.
#[derive(Debug, Default)]
pub struct Counters {
    /// Bytes copied host-to-device.
    pub bytes_h2d: AtomicU64,
    /// Host-to-device copies issued.
    pub copies: AtomicU64,
    /// Bytes read from checkpoint files.
    pub bytes_read: AtomicU64,
    /// File reads issued.
    pub reads: AtomicU64,
    /// Nanoseconds compute waited for copies.
    pub compute_wait_ns: AtomicU64,
    /// Units needed before they were prefetched.
    pub misses: AtomicU64,
}

/// A plain copy of [`Counters`] at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct CountersSnapshot {
    /// Bytes copied host-to-device.
    pub bytes_h2d: u64,
    /// Host-to-device copies issued.
    pub copies: u64,
    /// Bytes read from checkpoint files.
    pub bytes_read: u64,
    /// File reads issued.
    pub reads: u64,
    /// Nanoseconds compute waited for copies.
    pub compute_wait_ns: u64,
    /// Units needed before they were prefetched.
    pub misses: u64,
}

impl CountersSnapshot {
    /// Per-field difference `self - earlier`, saturating at 0.
    pub fn since(&self, earlier: &CountersSnapshot) -> CountersSnapshot {
        CountersSnapshot {
            bytes_h2d: self.bytes_h2d.saturating_sub(earlier.bytes_h2d),
            copies: self.copies.saturating_sub(earlier.copies),
            bytes_read: self.bytes_read.saturating_sub(earlier.bytes_read),
            reads: self.reads.saturating_sub(earlier.reads),
            compute_wait_ns: self.compute_wait_ns.saturating_sub(earlier.compute_wait_ns),
            misses: self.misses.saturating_sub(earlier.misses),
        }
    }
}

impl Counters {
    /// All counters at zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records one host-to-device copy of `bytes` bytes.
    pub fn add_h2d(&self, bytes: u64) {
        self.bytes_h2d.fetch_add(bytes, Ordering::Relaxed);
        self.copies.fetch_add(1, Ordering::Relaxed);
    }

    /// Records one file read of `bytes` bytes.
    pub fn add_read(&self, bytes: u64) {
        self.bytes_read.fetch_add(bytes, Ordering::Relaxed);
        self.reads.fetch_add(1, Ordering::Relaxed);
    }

    /// Records `ns` nanoseconds of compute waiting on a copy.
    pub fn add_compute_wait_ns(&self, ns: u64) {
        self.compute_wait_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// Records one prefetch miss.
    pub fn add_miss(&self) {
        self.misses.fetch_add(1, Ordering::Relaxed);
    }

    /// Reads every counter (each read is atomic; the set is not a single
    /// atomic snapshot while other threads are writing).
    pub fn snapshot(&self) -> CountersSnapshot {
        CountersSnapshot {
            bytes_h2d: self.bytes_h2d.load(Ordering::Relaxed),
            copies: self.copies.load(Ordering::Relaxed),
            bytes_read: self.bytes_read.load(Ordering::Relaxed),
            reads: self.reads.load(Ordering::Relaxed),
            compute_wait_ns: self.compute_wait_ns.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
        }
    }

    /// Sets every counter to zero and returns the values they held.
    pub fn reset(&self) -> CountersSnapshot {
        CountersSnapshot {
            bytes_h2d: self.bytes_h2d.swap(0, Ordering::Relaxed),
            copies: self.copies.swap(0, Ordering::Relaxed),
            bytes_read: self.bytes_read.swap(0, Ordering::Relaxed),
            reads: self.reads.swap(0, Ordering::Relaxed),
            compute_wait_ns: self.compute_wait_ns.swap(0, Ordering::Relaxed),
            misses: self.misses.swap(0, Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn add_snapshot_reset() {
        let c = Counters::new();
        c.add_h2d(100);
        c.add_h2d(50);
        c.add_read(7);
        c.add_compute_wait_ns(1_000);
        c.add_miss();
        let s = c.snapshot();
        assert_eq!(
            s,
            CountersSnapshot {
                bytes_h2d: 150,
                copies: 2,
                bytes_read: 7,
                reads: 1,
                compute_wait_ns: 1_000,
                misses: 1
            }
        );
        assert_eq!(c.reset(), s);
        assert_eq!(c.snapshot(), CountersSnapshot::default());
    }

    #[test]
    fn since_and_serialize() {
        let c = Counters::new();
        c.add_h2d(10);
        let a = c.snapshot();
        c.add_h2d(5);
        let d = c.snapshot().since(&a);
        assert_eq!((d.bytes_h2d, d.copies), (5, 1));
        let json = serde_json::to_string(&d).unwrap();
        assert!(json.contains("\"bytes_h2d\":5"), "{json}");
    }

    #[test]
    fn concurrent_adds() {
        let c = Arc::new(Counters::new());
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let c = Arc::clone(&c);
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        c.add_h2d(2);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(c.snapshot().bytes_h2d, 8000);
        assert_eq!(c.snapshot().copies, 4000);
    }
}

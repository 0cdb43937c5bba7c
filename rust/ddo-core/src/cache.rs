//! The RAM cache of the NVMe route: which streamed units stay in host RAM.
//!
//! A unit that streams to the device comes either from host RAM (a slab) or from its file on disk,
//! re-read on every pass. The pass is cyclic, so a fixed retained set beats LRU (which would evict
//! every unit just before it is needed again). Given the streamed units, a RAM budget and the disk
//! and link bandwidths, [`plan_ram_cache`] picks that set: a few candidate sets (largest units
//! first, which keeps the most bytes off the disk, and cached units spread evenly between the disk
//! units) are scored with [`simulate_disk`]; the fastest wins, ties going to more cached bytes,
//! then to the earlier candidate. That simulation puts disk reads on the link's timeline (it does
//! not model the staging ring's read-ahead), so when the copies dominate, candidates with equal
//! cached bytes score the same and largest-first wins; the spread sets can only win where compute
//! gaps make the order of slow and fast copies matter. The roofline is
//! `max(compute, disk bytes / disk bandwidth, streamed bytes / link bandwidth)`.

use serde::{Deserialize, Serialize};

use crate::error::{CoreError, Result};
use crate::planner::SIM_PASSES;
use crate::simulate::{simulate_disk, MAX_SLOTS};

/// What the cache planner needs to know.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RamCacheRequest {
    /// Bytes of each unit, in execution order (as given to [`crate::plan`]).
    pub unit_bytes: Vec<u64>,
    /// Compute seconds per unit (same length as `unit_bytes`).
    pub unit_compute_s: Vec<f64>,
    /// The device plan: units resident on the device (never cached nor read).
    pub resident: Vec<bool>,
    /// Slots of the device plan (>= 1 when anything streams).
    pub slots: usize,
    /// Host bytes the cache may hold.
    pub ram_budget_bytes: u64,
    /// Host-to-device bandwidth, bytes per second (finite, > 0).
    pub link_bytes_per_s: f64,
    /// Disk read bandwidth, bytes per second (finite, > 0).
    pub disk_bytes_per_s: f64,
}

/// The cache planner's answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RamCachePlan {
    /// Per unit: kept in host RAM (`true`); `false` for device-resident units and disk units.
    pub cached: Vec<bool>,
    /// Per unit: read from disk on every pass.
    pub from_disk: Vec<bool>,
    /// Bytes held by the cache (at most the RAM budget).
    pub cached_bytes: u64,
    /// Bytes read from disk per pass.
    pub disk_bytes: u64,
    /// Bytes copied to the device per pass (cached and disk units).
    pub streamed_bytes: u64,
    /// Simulated steady-state seconds per pass.
    pub predicted_step_s: f64,
    /// Total compute seconds per pass.
    pub compute_s: f64,
    /// `disk_bytes / disk bandwidth`.
    pub disk_bound_s: f64,
    /// `streamed_bytes / link bandwidth`.
    pub link_bound_s: f64,
    /// Roofline: the largest of compute, disk bound and link bound.
    pub bound_s: f64,
}

/// Chooses the units kept in RAM. Errors: [`CoreError::InvalidPlanRequest`] for meaningless input.
pub fn plan_ram_cache(req: &RamCacheRequest) -> Result<RamCachePlan> {
    let n = req.unit_bytes.len();
    let bad = |msg: String| Err(CoreError::InvalidPlanRequest(msg));
    if req.unit_compute_s.len() != n || req.resident.len() != n {
        return bad(format!(
            "unit_bytes has {n} entries but unit_compute_s has {} and resident {}",
            req.unit_compute_s.len(),
            req.resident.len()
        ));
    }
    for (what, v) in [
        ("link_bytes_per_s", req.link_bytes_per_s),
        ("disk_bytes_per_s", req.disk_bytes_per_s),
    ] {
        if !(v.is_finite() && v > 0.0) {
            return bad(format!("{what} must be a finite positive number, got {v}"));
        }
    }
    if let Some((i, t)) = req
        .unit_compute_s
        .iter()
        .enumerate()
        .find(|(_, t)| !(t.is_finite() && **t >= 0.0))
    {
        return bad(format!(
            "unit_compute_s[{i}] = {t} is not a finite non-negative number of seconds"
        ));
    }
    let streamed: Vec<usize> = (0..n).filter(|&i| !req.resident[i]).collect();
    if !streamed.is_empty() && req.slots == 0 {
        return bad("units stream but the device plan has no slots".into());
    }
    if req.slots > MAX_SLOTS {
        return Err(CoreError::InvalidArgument(format!(
            "slots = {} is more than the {MAX_SLOTS} slots a transport can have",
            req.slots
        )));
    }

    let mut candidates: Vec<Vec<bool>> = Vec::new();
    let streamed_total = streamed
        .iter()
        .fold(0u64, |a, &i| a.saturating_add(req.unit_bytes[i]));
    if streamed_total <= req.ram_budget_bytes {
        candidates.push(mask(n, &streamed));
    } else {
        let mut by_size = streamed.clone();
        by_size.sort_by(|&a, &b| req.unit_bytes[b].cmp(&req.unit_bytes[a]).then(a.cmp(&b)));
        candidates.push(fill(req, vec![false; n], &by_size));
        for phase in [0.5, 0.0, 1.0] {
            candidates.push(spread(req, &streamed, &by_size, streamed_total, phase));
        }
        candidates.push(vec![false; n]);
    }

    let mut best: Option<RamCachePlan> = None;
    for cached in candidates {
        let p = score(req, cached);
        let wins = match &best {
            None => true,
            Some(b) => {
                let tol = 1e-9 * p.predicted_step_s.abs().max(b.predicted_step_s.abs());
                p.predicted_step_s < b.predicted_step_s - tol
                    || (p.predicted_step_s <= b.predicted_step_s + tol
                        && p.cached_bytes > b.cached_bytes)
            }
        };
        if wins {
            best = Some(p);
        }
    }
    best.ok_or_else(|| CoreError::InvalidPlanRequest("no cache candidate".into()))
}

fn mask(n: usize, on: &[usize]) -> Vec<bool> {
    let mut m = vec![false; n];
    for &i in on {
        m[i] = true;
    }
    m
}

/// Adds units in `order` while they fit in the budget.
fn fill(req: &RamCacheRequest, mut cached: Vec<bool>, order: &[usize]) -> Vec<bool> {
    let mut used: u64 = (0..cached.len())
        .filter(|&i| cached[i])
        .map(|i| req.unit_bytes[i])
        .sum();
    for &i in order {
        let b = req.unit_bytes[i];
        if !cached[i] && used.saturating_add(b) <= req.ram_budget_bytes {
            cached[i] = true;
            used += b;
        }
    }
    cached
}

/// Error diffusion over bytes along the execution order, then largest-first for what is left.
fn spread(
    req: &RamCacheRequest,
    streamed: &[usize],
    by_size: &[usize],
    total: u64,
    phase: f64,
) -> Vec<bool> {
    let mut cached = vec![false; req.unit_bytes.len()];
    if total == 0 {
        return cached;
    }
    let fraction = (req.ram_budget_bytes as f64 / total as f64).min(1.0);
    let mean = total as f64 / streamed.len() as f64;
    let mut acc = phase * mean * fraction;
    let mut used = 0u64;
    for &i in streamed {
        let b = req.unit_bytes[i];
        acc += fraction * b as f64;
        if acc >= b as f64 && used.saturating_add(b) <= req.ram_budget_bytes {
            cached[i] = true;
            used += b;
            acc -= b as f64;
        }
    }
    fill(req, cached, by_size)
}

fn score(req: &RamCacheRequest, cached: Vec<bool>) -> RamCachePlan {
    let n = req.unit_bytes.len();
    let from_disk: Vec<bool> = (0..n).map(|i| !req.resident[i] && !cached[i]).collect();
    let (mut cached_bytes, mut disk_bytes, mut streamed_bytes) = (0u64, 0u64, 0u64);
    for i in 0..n {
        let b = req.unit_bytes[i];
        if !req.resident[i] {
            streamed_bytes = streamed_bytes.saturating_add(b);
        }
        if cached[i] {
            cached_bytes = cached_bytes.saturating_add(b);
        }
        if from_disk[i] {
            disk_bytes = disk_bytes.saturating_add(b);
        }
    }
    let sim = simulate_disk(
        &req.unit_bytes,
        &req.unit_compute_s,
        &req.resident,
        &from_disk,
        req.slots,
        req.link_bytes_per_s,
        req.disk_bytes_per_s,
        SIM_PASSES,
    );
    let compute_s: f64 = req.unit_compute_s.iter().sum();
    let disk_bound_s = disk_bytes as f64 / req.disk_bytes_per_s;
    let link_bound_s = streamed_bytes as f64 / req.link_bytes_per_s;
    RamCachePlan {
        cached,
        from_disk,
        cached_bytes,
        disk_bytes,
        streamed_bytes,
        predicted_step_s: sim.step_s,
        compute_s,
        disk_bound_s,
        link_bound_s,
        bound_s: compute_s.max(disk_bound_s).max(link_bound_s),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn req(unit_bytes: Vec<u64>, resident: Vec<bool>, ram: u64) -> RamCacheRequest {
        let n = unit_bytes.len();
        RamCacheRequest {
            unit_bytes,
            unit_compute_s: vec![0.001; n],
            resident,
            slots: 2,
            ram_budget_bytes: ram,
            link_bytes_per_s: 50e9,
            disk_bytes_per_s: 7e9,
        }
    }

    fn check(r: &RamCacheRequest, p: &RamCachePlan) {
        for i in 0..r.unit_bytes.len() {
            assert!(!(p.cached[i] && p.from_disk[i]));
            if r.resident[i] {
                assert!(!p.cached[i] && !p.from_disk[i]);
            } else {
                assert!(p.cached[i] || p.from_disk[i]);
            }
        }
        assert!(p.cached_bytes <= r.ram_budget_bytes);
        assert_eq!(p.cached_bytes + p.disk_bytes, p.streamed_bytes);
        assert!(p.predicted_step_s >= p.bound_s * (1.0 - 1e-9), "{p:?}");
    }

    #[test]
    fn zero_budget_reads_everything_from_disk() {
        let r = req(vec![100 * MIB; 6], vec![false; 6], 0);
        let p = plan_ram_cache(&r).unwrap();
        check(&r, &p);
        assert_eq!(p.cached_bytes, 0);
        assert_eq!(p.disk_bytes, 600 * MIB);
        assert!((p.disk_bound_s - 600.0 * MIB as f64 / 7e9).abs() < 1e-12);
        assert_eq!(p.bound_s, p.disk_bound_s);
    }

    #[test]
    fn enough_budget_caches_every_streamed_unit() {
        let r = req(
            vec![100 * MIB; 6],
            vec![true, false, false, false, false, true],
            u64::MAX,
        );
        let p = plan_ram_cache(&r).unwrap();
        check(&r, &p);
        assert_eq!(p.cached, vec![false, true, true, true, true, false]);
        assert_eq!(p.disk_bytes, 0);
        assert_eq!(p.bound_s, p.link_bound_s.max(p.compute_s));
    }

    #[test]
    fn partial_budget_keeps_the_most_bytes_off_the_disk() {
        let r = req(
            vec![10 * MIB, 300 * MIB, 10 * MIB, 300 * MIB, 10 * MIB],
            vec![false; 5],
            320 * MIB,
        );
        let p = plan_ram_cache(&r).unwrap();
        check(&r, &p);
        // one 300 MiB unit and at least one small one stay in RAM
        assert!(p.cached_bytes >= 310 * MIB, "{p:?}");
        assert!(p.disk_bytes <= 330 * MIB);
        // more RAM never predicts a slower step
        let mut last = f64::INFINITY;
        for ram in [0, 100, 300, 320, 400, 630, 640] {
            let p = plan_ram_cache(&req(r.unit_bytes.clone(), vec![false; 5], ram * MIB)).unwrap();
            assert!(
                p.predicted_step_s <= last * (1.0 + 1e-9),
                "{ram} MiB: {p:?}"
            );
            last = p.predicted_step_s;
        }
    }

    #[test]
    fn bad_requests_are_errors() {
        let mut r = req(vec![1, 2], vec![false, false], 0);
        r.disk_bytes_per_s = 0.0;
        assert!(plan_ram_cache(&r).is_err());
        let mut r = req(vec![1, 2], vec![false], 0);
        assert!(plan_ram_cache(&r).is_err());
        r = req(vec![1, 2], vec![false, false], 0);
        let mut huge = r.clone();
        huge.slots = 1 << 40;
        let err = plan_ram_cache(&huge).unwrap_err();
        assert!(matches!(err, CoreError::InvalidArgument(_)), "{err}");
        assert!(err.to_string().contains("slots = 1099511627776"), "{err}");
        r.slots = 0;
        assert!(plan_ram_cache(&r).is_err());
        r = req(vec![1, 2], vec![false, false], 0);
        r.unit_compute_s[1] = f64::NAN;
        assert!(plan_ram_cache(&r).is_err());
    }
}

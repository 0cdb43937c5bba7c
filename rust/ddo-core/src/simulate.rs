//! Discrete-event model of one compute stream and one copy stream.
//!
//! Units run in execution order, pass after pass. Resident units compute
//! immediately. Streamed units are fetched by the copy stream, in cyclic
//! execution order across pass boundaries, into a ring of `K` slots: the
//! `j`-th fetch (counting streamed units over all passes) goes into slot
//! `j mod K` and may start only once the copy stream is idle and the
//! `(j-K)`-th streamed unit has finished computing. A streamed unit starts
//! computing once it has arrived and the previous unit has finished. At the
//! start of the first pass nothing is loaded, so the first `K` fetches may
//! start at `t = 0`.

use serde::Serialize;

use crate::error::{CoreError, Result};

/// Most passes [`check_sim_inputs`] accepts (the planner simulates 4).
pub const MAX_PASSES: usize = 1000;

/// Most slots anything accepts: the planner's `min_slots`, a simulation, a transport.
pub const MAX_SLOTS: usize = 1024;

/// Timings produced by [`simulate`].
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct SimResult {
    /// Duration of the last simulated pass (the steady state).
    pub step_s: f64,
    /// Duration of the first pass (cold start).
    pub first_pass_s: f64,
    /// Time compute waited for copies during the last pass.
    pub compute_wait_s: f64,
    /// Copy-stream busy time spent on the last pass's units.
    pub link_busy_s: f64,
}

/// Simulates `passes` passes and reports the last one.
///
/// Inputs are indexed by unit. Missing entries of `unit_compute_s` count as
/// 0 s and missing entries of `resident` as streamed; negative or
/// non-finite compute times count as 0 s. `slots == 0` is treated as one
/// slot and `passes == 0` as one pass. A non-positive or non-finite
/// `link_bytes_per_s` makes every non-empty copy take forever.
pub fn simulate(
    unit_bytes: &[u64],
    unit_compute_s: &[f64],
    resident: &[bool],
    slots: usize,
    link_bytes_per_s: f64,
    passes: usize,
) -> SimResult {
    let plain = (unit_bytes, unit_compute_s, resident);
    run_with(
        plain,
        slots,
        passes,
        |_, b| transfer_s(b, link_bytes_per_s),
        None,
    )
}

/// [`simulate`] with a disk behind the link (the NVMe route): the streamed units flagged in
/// `from_disk` are read from disk and uploaded in chunks through one staging thread, so their
/// copy takes `bytes / min(link, disk)`; the others come from host RAM at the link's speed.
///
/// The model is conservative: a disk read starts only when the link is idle and the unit's slot
/// is free, although the staging ring lets reads run ahead by its size.
#[allow(clippy::too_many_arguments)]
pub fn simulate_disk(
    unit_bytes: &[u64],
    unit_compute_s: &[f64],
    resident: &[bool],
    from_disk: &[bool],
    slots: usize,
    link_bytes_per_s: f64,
    disk_bytes_per_s: f64,
    passes: usize,
) -> SimResult {
    let slow = if disk_bytes_per_s.is_finite() && disk_bytes_per_s > 0.0 {
        disk_bytes_per_s.min(link_bytes_per_s)
    } else {
        0.0
    };
    run_with(
        (unit_bytes, unit_compute_s, resident),
        slots,
        passes,
        |i, bytes| {
            if from_disk.get(i).copied().unwrap_or(false) {
                transfer_s(bytes, slow)
            } else {
                transfer_s(bytes, link_bytes_per_s)
            }
        },
        None,
    )
}

/// Checks simulator inputs that come from outside (the Python binding), which [`simulate`] and
/// [`simulate_disk`] would otherwise read leniently: one entry per unit in every list, finite
/// non-negative compute times, finite positive bandwidths, 1 to [`MAX_SLOTS`] slots and 1 to
/// [`MAX_PASSES`] passes. `from_disk` and `disk_bytes_per_s` belong to [`simulate_disk`].
/// Errors: [`CoreError::InvalidArgument`] naming the value.
#[allow(clippy::too_many_arguments)]
pub fn check_sim_inputs(
    unit_bytes: &[u64],
    unit_compute_s: &[f64],
    resident: &[bool],
    from_disk: Option<&[bool]>,
    slots: usize,
    link_bytes_per_s: f64,
    disk_bytes_per_s: Option<f64>,
    passes: usize,
) -> Result<()> {
    let bad = |msg: String| Err(CoreError::InvalidArgument(msg));
    let n = unit_bytes.len();
    for (what, len) in [
        ("unit_compute_s", Some(unit_compute_s.len())),
        ("resident", Some(resident.len())),
        ("from_disk", from_disk.map(<[bool]>::len)),
    ] {
        if let Some(len) = len.filter(|&len| len != n) {
            return bad(format!(
                "{what} has {len} entries but unit_bytes has {n}: give one per unit"
            ));
        }
    }
    if let Some((i, t)) = unit_compute_s
        .iter()
        .enumerate()
        .find(|(_, t)| !(t.is_finite() && **t >= 0.0))
    {
        return bad(format!(
            "unit_compute_s[{i}] = {t} is not a finite non-negative number of seconds"
        ));
    }
    for (what, v) in [
        ("link_bytes_per_s", Some(link_bytes_per_s)),
        ("disk_bytes_per_s", disk_bytes_per_s),
    ] {
        if let Some(v) = v.filter(|v| !(v.is_finite() && *v > 0.0)) {
            return bad(format!(
                "{what} must be a finite positive number of bytes per second, got {v}"
            ));
        }
    }
    if !(1..=MAX_SLOTS).contains(&slots) {
        return bad(format!(
            "slots = {slots}: a simulation takes 1 to {MAX_SLOTS} slots"
        ));
    }
    if !(1..=MAX_PASSES).contains(&passes) {
        return bad(format!(
            "passes = {passes}: a simulation takes 1 to {MAX_PASSES} passes (the last one is the \
             steady state; 3 or 4 are enough)"
        ));
    }
    Ok(())
}

fn transfer_s(bytes: u64, rate: f64) -> f64 {
    if bytes == 0 {
        0.0
    } else if rate.is_finite() && rate > 0.0 {
        bytes as f64 / rate
    } else {
        f64::INFINITY
    }
}

/// Per unit, in the last simulated pass: how long compute waited for the unit's copy, and for a
/// streamed unit how long the link sat idle before its copy because the unit's slot was still in
/// use (where the link had time to spare). 0 for resident units. The planner's refinement reads
/// them to try first the swaps that can help.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct PassDetail {
    pub wait: Vec<f64>,
    pub link_idle: Vec<f64>,
}

/// [`simulate`], and the last pass unit by unit.
pub(crate) fn simulate_detail(
    unit_bytes: &[u64],
    unit_compute_s: &[f64],
    resident: &[bool],
    slots: usize,
    link_bytes_per_s: f64,
    passes: usize,
) -> (SimResult, PassDetail) {
    let mut detail = PassDetail {
        wait: vec![0.0; unit_bytes.len()],
        link_idle: vec![0.0; unit_bytes.len()],
    };
    let plain = (unit_bytes, unit_compute_s, resident);
    let link = |_, b| transfer_s(b, link_bytes_per_s);
    let result = run_with(plain, slots, passes, link, Some(&mut detail));
    (result, detail)
}

/// Units' bytes, compute seconds and residency, indexed alike.
type Units<'a> = (&'a [u64], &'a [f64], &'a [bool]);

fn run_with(
    (unit_bytes, unit_compute_s, resident): Units<'_>,
    slots: usize,
    passes: usize,
    copy_s: impl Fn(usize, u64) -> f64,
    mut detail: Option<&mut PassDetail>,
) -> SimResult {
    let passes = passes.max(1);
    // Slots beyond the number of fetches are never reused, so they change nothing: capping them
    // keeps the ring's allocation to the size of the input, whatever `slots` says.
    let streamed = (0..unit_bytes.len())
        .filter(|&i| !resident.get(i).copied().unwrap_or(false))
        .count();
    let slots = slots.clamp(1, streamed.saturating_mul(passes).max(1));
    let compute = |i: usize| {
        unit_compute_s
            .get(i)
            .copied()
            .filter(|c| c.is_finite() && *c >= 0.0)
            .unwrap_or(0.0)
    };

    // done[j % slots]: compute end of the j-th streamed unit (ring buffer).
    let mut done = vec![0.0f64; slots];
    let mut fetched = 0usize;
    let mut now = 0.0f64;
    let mut link_free = 0.0f64;
    let mut result = SimResult::default();

    for pass in 0..passes {
        let pass_start = now;
        let mut wait = 0.0;
        let mut busy = 0.0;
        for (i, &bytes) in unit_bytes.iter().enumerate() {
            let c = compute(i);
            if resident.get(i).copied().unwrap_or(false) {
                now += c;
                continue;
            }
            let slot = fetched % slots;
            let slot_free = if fetched >= slots { done[slot] } else { 0.0 };
            let duration = copy_s(i, bytes);
            let arrived = link_free.max(slot_free) + duration;
            let start = now.max(arrived);
            if pass + 1 == passes {
                if let Some(d) = detail.as_deref_mut() {
                    d.wait[i] = start - now;
                    d.link_idle[i] = (slot_free - link_free).max(0.0);
                }
            }
            link_free = arrived;
            busy += duration;
            wait += start - now;
            now = start + c;
            done[slot] = now;
            fetched += 1;
        }
        let elapsed = now - pass_start;
        if pass == 0 {
            result.first_pass_s = elapsed;
        }
        result.step_s = elapsed;
        result.compute_wait_s = wait;
        result.link_busy_s = busy;
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
    }

    #[test]
    fn all_resident_is_pure_compute() {
        let r = simulate(&[10, 20], &[1.0, 2.0], &[true, true], 2, 1.0, 3);
        assert!(close(r.step_s, 3.0));
        assert!(close(r.first_pass_s, 3.0));
        assert_eq!(r.compute_wait_s, 0.0);
        assert_eq!(r.link_busy_s, 0.0);
    }

    #[test]
    fn single_streamed_unit_one_slot_serializes() {
        // 1 slot: fetch (1 s) then compute (1 s), every pass.
        let r = simulate(&[100], &[1.0], &[false], 1, 100.0, 3);
        assert!(close(r.step_s, 2.0), "{r:?}");
        assert!(close(r.compute_wait_s, 1.0));
    }

    #[test]
    fn single_streamed_unit_two_slots_overlaps() {
        // 2 slots: the next pass's copy overlaps this pass's compute.
        let r = simulate(&[100], &[1.0], &[false], 2, 100.0, 4);
        assert!(close(r.first_pass_s, 2.0));
        assert!(close(r.step_s, 1.0), "{r:?}");
    }

    #[test]
    fn bandwidth_bound() {
        let bytes = vec![100; 10];
        let compute = vec![0.1; 10];
        let r = simulate(&bytes, &compute, &[false; 10], 2, 100.0, 4);
        assert!(close(r.step_s, 10.0), "{r:?}");
        assert!(close(r.link_busy_s, 10.0));
    }

    #[test]
    fn compute_bound() {
        let bytes = vec![100; 10];
        let compute = vec![5.0; 10];
        let r = simulate(&bytes, &compute, &[false; 10], 2, 100.0, 4);
        assert!(close(r.step_s, 50.0), "{r:?}");
        assert!(close(r.compute_wait_s, 0.0));
    }

    #[test]
    fn disk_units_copy_at_the_slower_rate() {
        let bytes = vec![100; 4];
        let compute = vec![0.0; 4];
        let none = [false; 4];
        let all = simulate_disk(&bytes, &compute, &none, &[true; 4], 2, 100.0, 50.0, 4);
        assert!(close(all.step_s, 8.0), "{all:?}");
        let half = simulate_disk(
            &bytes,
            &compute,
            &none,
            &[true, false, true, false],
            2,
            100.0,
            50.0,
            4,
        );
        assert!(close(half.step_s, 6.0), "{half:?}");
        let cached = simulate_disk(&bytes, &compute, &none, &none, 2, 100.0, 50.0, 4);
        assert_eq!(cached, simulate(&bytes, &compute, &none, 2, 100.0, 4));
        // a disk faster than the link changes nothing
        let fast = simulate_disk(&bytes, &compute, &none, &[true; 4], 2, 100.0, 1e9, 4);
        assert_eq!(fast, cached);
        let broken = simulate_disk(&bytes, &compute, &none, &[true; 4], 2, 100.0, f64::NAN, 2);
        assert!(!broken.step_s.is_finite());
    }

    #[test]
    fn huge_slot_counts_allocate_nothing_and_change_nothing() {
        let bytes = [100, 100, 100];
        let compute = [1.0, 1.0, 1.0];
        let streamed = [false; 3];
        let big = simulate(&bytes, &compute, &streamed, usize::MAX, 100.0, 3);
        assert_eq!(big, simulate(&bytes, &compute, &streamed, 9, 100.0, 3));
        let disk = simulate_disk(
            &bytes,
            &compute,
            &streamed,
            &[true; 3],
            1 << 62,
            1.0,
            1.0,
            2,
        );
        assert!(disk.step_s.is_finite());
    }

    #[test]
    fn inputs_from_outside_are_checked() {
        let ok = |slots, link, passes| {
            check_sim_inputs(
                &[1, 2],
                &[0.1, 0.2],
                &[false, true],
                None,
                slots,
                link,
                None,
                passes,
            )
        };
        ok(2, 1e9, 3).unwrap();
        for (args, want) in [
            ((0, 1e9, 3), "slots = 0"),
            ((1 << 40, 1e9, 3), "1 to 1024 slots"),
            (
                (2, f64::NAN, 3),
                "link_bytes_per_s must be a finite positive number",
            ),
            ((2, -1.0, 3), "got -1"),
            ((2, 1e9, 0), "passes = 0"),
            ((2, 1e9, usize::MAX), "1 to 1000 passes"),
        ] {
            let err = ok(args.0, args.1, args.2).unwrap_err();
            assert!(matches!(err, CoreError::InvalidArgument(_)), "{err}");
            assert!(err.to_string().contains(want), "want {want:?} in {err}");
        }
        let err = check_sim_inputs(&[1], &[f64::INFINITY], &[false], None, 1, 1.0, None, 1);
        assert!(err
            .unwrap_err()
            .to_string()
            .contains("unit_compute_s[0] = inf"));
        let err = check_sim_inputs(&[1], &[0.0], &[false, false], None, 1, 1.0, None, 1);
        assert!(err
            .unwrap_err()
            .to_string()
            .contains("resident has 2 entries"));
        let err = check_sim_inputs(&[1], &[0.0], &[false], Some(&[]), 1, 1.0, Some(0.0), 1);
        assert!(err
            .unwrap_err()
            .to_string()
            .contains("from_disk has 0 entries"));
        let err = check_sim_inputs(&[1], &[0.0], &[false], Some(&[true]), 1, 1.0, Some(0.0), 1);
        assert!(err.unwrap_err().to_string().contains("disk_bytes_per_s"));
    }

    #[test]
    fn bad_inputs_do_not_panic() {
        let r = simulate(&[1, 2, 3], &[], &[], 0, f64::NAN, 0);
        assert!(r.step_s.is_infinite());
        let r = simulate(&[], &[], &[], 2, 1.0, 2);
        assert_eq!(r.step_s, 0.0);
        let r = simulate(&[0, 0], &[f64::NAN, -1.0], &[false, false], 2, 0.0, 2);
        assert_eq!(r.step_s, 0.0);
    }
}

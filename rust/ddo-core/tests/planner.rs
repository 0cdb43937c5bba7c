//! Planner behaviour tests.

use ddo_core::{minimum_budget, plan, plan_counted, simulate, CoreError, Plan, PlanRequest};

/// Most candidate plans one 200-unit request may simulate: four per unit (246 when written).
const SIMULATION_LIMIT: usize = 4 * 200;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

fn req(unit_bytes: Vec<u64>, budget: Option<u64>) -> PlanRequest {
    PlanRequest {
        budget_bytes: budget,
        ..PlanRequest::new(unit_bytes, 10.0 * GIB as f64, 100.0 * GIB as f64)
    }
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * a.abs().max(b.abs())
}

/// Invariants every plan must satisfy.
fn check(r: &PlanRequest, p: &Plan) {
    let n = r.unit_bytes.len();
    assert_eq!(p.resident.len(), n);
    let resident: u64 = (0..n)
        .filter(|&i| p.resident[i])
        .map(|i| r.unit_bytes[i])
        .sum();
    let streamed: u64 = (0..n)
        .filter(|&i| !p.resident[i])
        .map(|i| r.unit_bytes[i])
        .sum();
    let largest = (0..n)
        .filter(|&i| !p.resident[i])
        .map(|i| r.unit_bytes[i])
        .max()
        .unwrap_or(0);
    assert_eq!(p.resident_bytes, r.base_bytes + resident);
    assert_eq!(p.streamed_bytes, streamed);
    assert_eq!(p.slot_bytes, largest);
    assert_eq!(p.prefetch_depth, p.slots);
    assert_eq!(
        p.gpu_bytes,
        p.resident_bytes + p.slots as u64 * p.slot_bytes
    );
    if let Some(b) = r.budget_bytes {
        assert!(p.gpu_bytes <= b, "gpu {} > budget {b}: {p:?}", p.gpu_bytes);
    }
    if p.resident.iter().all(|&x| x) {
        assert_eq!(p.slots, 0);
    } else {
        assert!(
            p.slots >= r.min_slots && p.slots <= r.max_slots.max(r.min_slots),
            "{p:?}"
        );
    }
    assert!(p.predicted_step_s.is_finite());
    assert!(p.predicted_step_s >= p.bound_s * (1.0 - 1e-9), "{p:?}");
}

#[test]
fn everything_fits_all_resident() {
    let compute = vec![0.5, 0.25, 0.25];
    for budget in [None, Some(3 * GIB + 10), Some(3 * GIB + 10 + 1)] {
        let mut r = req(vec![GIB; 3], budget);
        r.base_bytes = 10;
        r.unit_compute_s = Some(compute.clone());
        let p = plan(&r).unwrap();
        check(&r, &p);
        assert_eq!(p.resident, vec![true; 3]);
        assert_eq!((p.slots, p.slot_bytes, p.streamed_bytes), (0, 0, 0));
        assert_eq!(p.gpu_bytes, 3 * GIB + 10);
        assert!(close(p.predicted_step_s, 1.0, 1e-12));
        assert!(close(p.bound_s, 1.0, 1e-12));
    }
}

#[test]
fn one_unit() {
    let r = req(vec![GIB], None);
    let p = plan(&r).unwrap();
    assert_eq!(p.resident, vec![true]);
    // Streaming one unit through two slots costs more than keeping it.
    let r = req(vec![GIB], Some(GIB - 1));
    let err = plan(&r).unwrap_err();
    match &err {
        CoreError::BudgetTooSmall {
            minimum,
            largest_unit,
            base,
            ..
        } => {
            assert_eq!((*minimum, *largest_unit, *base), (GIB, 0, GIB));
        }
        other => panic!("{other:?}"),
    }
    assert!(err.to_string().contains("all weights resident"), "{err}");
    // With one slot allowed, streaming it is as cheap as keeping it; the
    // budget then must still hold the unit.
    let mut r = req(vec![GIB, GIB], Some(3 * GIB / 2));
    r.min_slots = 1;
    let p = plan(&r).unwrap();
    check(&r, &p);
    assert_eq!(p.slots, 1);
}

#[test]
fn budget_below_minimum_names_it() {
    let mut r = req(vec![512 * MIB; 10], Some(GIB));
    r.base_bytes = 512 * MIB;
    let err = plan(&r).unwrap_err();
    assert_eq!(
        err.to_string(),
        "VRAM budget 1.00 GiB is below the minimum 1.50 GiB (always-resident 512.00 MiB + 2 slots \
         x 512.00 MiB largest unit); pass vram_budget of at least 1.50 GiB (1610612736 bytes)"
    );
    match err {
        CoreError::BudgetTooSmall {
            budget,
            minimum,
            largest_unit,
            base,
        } => {
            assert_eq!(
                (budget, minimum, largest_unit, base),
                (GIB, 3 * GIB / 2, 512 * MIB, 512 * MIB)
            );
        }
        other => panic!("{other:?}"),
    }
    // Exactly the minimum works.
    r.budget_bytes = Some(3 * GIB / 2);
    let p = plan(&r).unwrap();
    check(&r, &p);
    assert_eq!((p.slots, p.slot_bytes), (2, 512 * MIB));
    assert!(p.resident.iter().all(|&x| !x));
}

#[test]
fn minimum_keeps_giant_unit_resident_when_cheaper() {
    let units = vec![100, 100, 1000, 100, 100];
    let m = minimum_budget(&units, 50, 2);
    // Streaming the giant needs 50 + 2*1000; keeping it needs 50 + 1000 + 2*100.
    assert_eq!(
        (m.bytes, m.largest_unit, m.resident_bytes, m.slots),
        (1250, 100, 1050, 2)
    );
    let mut r = req(units, Some(1249));
    r.base_bytes = 50;
    let err = plan(&r).unwrap_err().to_string();
    assert!(
        err.contains("always-resident 1.03 KiB + 2 slots x 100 B largest unit"),
        "{err}"
    );
}

#[test]
fn very_different_sizes() {
    let units = vec![
        100 * MIB,
        100 * MIB,
        2 * GIB,
        100 * MIB,
        100 * MIB,
        100 * MIB,
    ];
    // The giant fits resident with two small slots: it must be resident.
    let r = req(units.clone(), Some(2 * GIB + 300 * MIB));
    let p = plan(&r).unwrap();
    check(&r, &p);
    assert!(p.resident[2], "{p:?}");
    assert_eq!(p.slot_bytes, 100 * MIB);
    // Slot size follows the largest streamed unit.
    let mut units2 = units.clone();
    units2[2] = 300 * MIB;
    let r = req(units2, Some(700 * MIB));
    let p = plan(&r).unwrap();
    check(&r, &p);
    let largest_streamed = (0..6)
        .filter(|&i| !p.resident[i])
        .map(|i| r.unit_bytes[i])
        .max();
    assert_eq!(Some(p.slot_bytes), largest_streamed);
}

#[test]
fn bandwidth_bound_predicts_streamed_over_link() {
    // 20 x 1 GiB, link 1 GiB/s, compute nearly free.
    let mut r = req(vec![GIB; 20], Some(7 * GIB));
    r.link_bytes_per_s = GIB as f64;
    r.compute_bytes_per_s = 1000.0 * GIB as f64;
    let p = plan(&r).unwrap();
    check(&r, &p);
    // Fewest slots leaves the most room for resident units.
    assert_eq!(p.slots, 2);
    assert_eq!(p.resident.iter().filter(|&&x| x).count(), 5);
    let link_s = p.streamed_bytes as f64 / GIB as f64;
    assert!(close(p.bound_s, link_s, 1e-9));
    assert!(close(p.predicted_step_s, link_s, 0.02), "{p:?}");
}

#[test]
fn compute_bound_predicts_compute() {
    let mut r = req(vec![GIB; 20], Some(7 * GIB));
    r.link_bytes_per_s = 10.0 * GIB as f64;
    r.compute_bytes_per_s = GIB as f64; // 1 s per unit, copies take 0.1 s
    let p = plan(&r).unwrap();
    check(&r, &p);
    assert!(close(p.predicted_step_s, 20.0, 1e-6), "{p:?}");
    assert!(close(p.bound_s, 20.0, 1e-9));
    // Ties go to the fewest slots.
    assert_eq!(p.slots, 2);
}

#[test]
fn measured_compute_times_are_used() {
    let mut r = req(vec![GIB; 4], Some(3 * GIB));
    r.unit_compute_s = Some(vec![2.0, 2.0, 2.0, 2.0]);
    let p = plan(&r).unwrap();
    check(&r, &p);
    assert!(close(p.predicted_step_s, 8.0, 1e-6), "{p:?}");
}

#[test]
fn more_slots_never_hurt() {
    let units: Vec<u64> = (0..30).map(|i| (64 + (i * 37) % 50) * MIB).collect();
    for budget in [800 * MIB, 1200 * MIB, 2 * GIB] {
        let mut prev = f64::INFINITY;
        for max_slots in 2..=8 {
            let mut r = req(units.clone(), Some(budget));
            r.link_bytes_per_s = 2.0 * GIB as f64;
            r.compute_bytes_per_s = 3.0 * GIB as f64;
            r.max_slots = max_slots;
            let p = plan(&r).unwrap();
            check(&r, &p);
            assert!(
                p.predicted_step_s <= prev * (1.0 + 1e-9),
                "K={max_slots}: {p:?}"
            );
            prev = p.predicted_step_s;
        }
    }
}

#[test]
fn slots_help_when_copies_are_bursty() {
    // Alternating tiny and heavy compute: with 2 slots the link idles
    // behind heavy units; more slots let it run ahead.
    let units = vec![GIB; 12];
    let compute: Vec<f64> = (0..12)
        .map(|i| if i % 2 == 0 { 0.01 } else { 1.9 })
        .collect();
    let sim2 = simulate(&units, &compute, &[false; 12], 2, GIB as f64, 4);
    let sim4 = simulate(&units, &compute, &[false; 12], 4, GIB as f64, 4);
    assert!(sim4.step_s <= sim2.step_s + 1e-9, "{sim2:?} {sim4:?}");
}

#[test]
fn resident_units_are_spread() {
    // Copies take as long as compute: resident units between streamed
    // ones give the link time to catch up.
    let n = 12;
    let mut r = req(vec![GIB; n], Some(6 * GIB));
    r.link_bytes_per_s = GIB as f64;
    r.compute_bytes_per_s = GIB as f64 / 0.8;
    let p = plan(&r).unwrap();
    check(&r, &p);
    let idx: Vec<usize> = (0..n).filter(|&i| p.resident[i]).collect();
    assert_eq!(idx.len(), 4, "{p:?}");
    assert_ne!(idx, vec![0, 1, 2, 3]);
    // Cyclic gaps between resident units differ by at most one.
    let gaps: Vec<usize> = (0..idx.len())
        .map(|k| (idx[(k + 1) % idx.len()] + n - idx[k] - 1) % n)
        .collect();
    let (lo, hi) = (gaps.iter().min().unwrap(), gaps.iter().max().unwrap());
    assert!(hi - lo <= 1, "resident {idx:?} gaps {gaps:?}");
    // And the spread plan beats front-loading.
    let front: Vec<bool> = (0..n).map(|i| i < 4).collect();
    let compute = vec![0.8; n];
    let front_s = simulate(&r.unit_bytes, &compute, &front, 2, GIB as f64, 4).step_s;
    assert!(
        p.predicted_step_s <= front_s + 1e-9,
        "{} vs {front_s}",
        p.predicted_step_s
    );
}

#[test]
fn gpu_bytes_within_budget_for_many_budgets() {
    let mut x: u64 = 12345;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for case in 0..40 {
        let n = 1 + (next() % 25) as usize;
        let units: Vec<u64> = (0..n)
            .map(|_| {
                if next() % 10 == 0 {
                    0
                } else {
                    next() % (500 * MIB)
                }
            })
            .collect();
        let base = next() % (300 * MIB);
        let total: u64 = units.iter().sum::<u64>() + base;
        let mut r = req(units.clone(), None);
        r.base_bytes = base;
        r.min_slots = 2;
        r.max_slots = 2 + (case % 4);
        r.link_bytes_per_s = (1 + next() % 20) as f64 * GIB as f64;
        r.compute_bytes_per_s = (1 + next() % 200) as f64 * GIB as f64;
        if case % 3 == 0 {
            r.unit_compute_s = Some((0..n).map(|_| (next() % 1000) as f64 / 1e4).collect());
        }
        let min = minimum_budget(&units, base, r.min_slots).bytes;
        for step in 0..=30u64 {
            let budget = base + (total + 64 * MIB - base) * step / 30;
            r.budget_bytes = Some(budget);
            match plan(&r) {
                Ok(p) => {
                    assert!(budget >= min, "plan below minimum {min}: {p:?}");
                    check(&r, &p);
                }
                Err(CoreError::BudgetTooSmall {
                    minimum, budget: b, ..
                }) => {
                    assert_eq!((minimum, b), (min, budget));
                    assert!(budget < min);
                }
                Err(e) => panic!("{e}"),
            }
        }
    }
}

#[test]
fn deterministic() {
    let units: Vec<u64> = (0..120).map(|i| (50 + (i * 7919) % 97) * MIB).collect();
    let mut r = req(units, Some(3 * GIB));
    r.max_slots = 6;
    let a = plan(&r).unwrap();
    for _ in 0..3 {
        assert_eq!(plan(&r).unwrap(), a);
    }
    assert_eq!(
        serde_json::to_string(&plan(&r).unwrap()).unwrap(),
        serde_json::to_string(&a).unwrap()
    );
}

#[test]
fn few_simulations_for_200_units() {
    // Worst case: every size distinct; compute-bound, balanced and
    // bandwidth-bound regimes. The planner's cost is the number of candidate
    // plans it simulates (each one a few passes over the units): counted, not
    // timed, so a busy CI machine cannot fail it. Without the pruning by the
    // roofline bound, 200 distinct sizes x 7 slot counts x the strategies
    // would be thousands of simulations.
    let units: Vec<u64> = (0..200)
        .map(|i| 40 * MIB + i * 3 * MIB + (i * 7919) % 1000)
        .collect();
    let total: u64 = units.iter().sum();
    let mut worst = 0;
    for compute_gib_s in [0.5, 2.0, 10.0, 1000.0] {
        for budget in [total / 5, total / 3, total / 2, total - 1] {
            let mut r = req(units.clone(), Some(budget));
            r.link_bytes_per_s = 2.0 * GIB as f64;
            r.compute_bytes_per_s = compute_gib_s * GIB as f64;
            r.max_slots = 8;
            let (p, cost) = plan_counted(&r).unwrap();
            assert_eq!(p, plan(&r).unwrap());
            worst = worst.max(cost.simulations);
            check(&r, &p);
        }
    }
    eprintln!("most simulations for one 200-unit plan: {worst}");
    assert!(
        (1..=SIMULATION_LIMIT).contains(&worst),
        "{worst} simulations"
    );
}

#[test]
fn invalid_requests() {
    let base = req(vec![GIB; 3], Some(GIB));
    let cases: Vec<(PlanRequest, &str)> = vec![
        (
            PlanRequest {
                unit_bytes: vec![],
                ..base.clone()
            },
            "unit_bytes is empty",
        ),
        (
            PlanRequest {
                link_bytes_per_s: f64::NAN,
                ..base.clone()
            },
            "link_bytes_per_s must be a finite positive number, got NaN",
        ),
        (
            PlanRequest {
                link_bytes_per_s: 0.0,
                ..base.clone()
            },
            "link_bytes_per_s",
        ),
        (
            PlanRequest {
                compute_bytes_per_s: -1.0,
                ..base.clone()
            },
            "compute_bytes_per_s",
        ),
        (
            PlanRequest {
                unit_compute_s: Some(vec![1.0]),
                ..base.clone()
            },
            "unit_compute_s has 1 entries but there are 3 units",
        ),
        (
            PlanRequest {
                unit_compute_s: Some(vec![1.0, f64::INFINITY, 1.0]),
                ..base.clone()
            },
            "unit_compute_s[1] = inf",
        ),
        (
            PlanRequest {
                min_slots: 0,
                ..base.clone()
            },
            "min_slots must be at least 1",
        ),
        (
            PlanRequest {
                min_slots: 3,
                max_slots: 2,
                ..base.clone()
            },
            "max_slots (2) is below min_slots (3)",
        ),
    ];
    for (r, want) in cases {
        let err = plan(&r).unwrap_err();
        assert!(matches!(err, CoreError::InvalidPlanRequest(_)), "{err:?}");
        let msg = err.to_string();
        assert!(msg.contains(want), "want {want:?} in {msg}");
    }
    // Measured times make compute_bytes_per_s irrelevant.
    let r = PlanRequest {
        compute_bytes_per_s: f64::NAN,
        unit_compute_s: Some(vec![1.0; 3]),
        budget_bytes: Some(2 * GIB),
        ..base
    };
    check(&r, &plan(&r).unwrap());
}

#[test]
fn zero_size_units() {
    let r = req(vec![0, GIB, 0, GIB, GIB, 0], Some(2 * GIB + GIB / 2));
    let p = plan(&r).unwrap();
    check(&r, &p);
    let r = req(vec![0, 0], Some(0));
    let p = plan(&r).unwrap();
    assert_eq!(p.slots, 0);
}

#[test]
fn a_slot_count_from_outside_is_bounded() {
    let mut r = req(vec![100, 100, 100], Some(250));
    r.min_slots = 1 << 40;
    r.max_slots = 1 << 40;
    let err = plan(&r).unwrap_err();
    assert!(matches!(err, CoreError::InvalidArgument(_)), "{err}");
    assert!(
        err.to_string().contains("min_slots = 1099511627776"),
        "{err}"
    );
    // a large max_slots is fine: the search stops at the number of units
    r.min_slots = 2;
    r.max_slots = usize::MAX;
    assert_eq!(plan(&r).unwrap().slots, 2);
}

#[test]
fn link_bytes_below_the_slot_size_shorten_the_transfer_bound() {
    let units = vec![GIB; 8];
    let budget = Some(3 * GIB);
    let plain = plan(&req(units.clone(), budget)).unwrap();
    let coded = plan(&PlanRequest {
        link_bytes: Some(vec![GIB * 3 / 4; 8]),
        ..req(units.clone(), budget)
    })
    .unwrap();
    // the same slots and footprint, three quarters of the transfer time
    assert_eq!(coded.slot_bytes, plain.slot_bytes);
    assert!(coded.gpu_bytes <= 3 * GIB);
    assert!(
        close(coded.bound_s, plain.bound_s * 0.75, 1e-9),
        "{} vs {}",
        coded.bound_s,
        plain.bound_s
    );
    assert!(coded.predicted_step_s < plain.predicted_step_s);
    let wrong = PlanRequest {
        link_bytes: Some(vec![1; 3]),
        ..req(units, budget)
    };
    assert!(plan(&wrong)
        .unwrap_err()
        .to_string()
        .contains("link_bytes has 3 entries"));
}

#[test]
fn link_heavy_units_are_kept_resident_where_that_is_faster() {
    // A pass of two phases, as an image transformer's double and single blocks: the first half's
    // units copy in 1 s and compute in 0.4 s, the second half's compute in 1.6 s. Overall copies
    // and compute balance (20 s each when all stream), but by phase the link is the bottleneck in
    // the first half and compute in the second: a resident set taken from the first half hides the
    // rest of its copies behind the second half's compute, where one spread by bytes or taken by
    // size (the second half's units are a little larger) leaves the first phase link-bound.
    let n = 20;
    let sizes = (0..n)
        .map(|i| if i < n / 2 { GIB } else { GIB + 64 * MIB })
        .collect();
    let mut r = req(sizes, Some(9 * GIB));
    r.link_bytes_per_s = GIB as f64;
    r.unit_compute_s = Some((0..n).map(|i| if i < n / 2 { 0.4 } else { 1.6 }).collect());
    let p = plan(&r).unwrap();
    check(&r, &p);
    let resident: Vec<usize> = (0..n).filter(|&i| p.resident[i]).collect();
    assert!(
        resident.iter().all(|&i| i < n / 2),
        "resident {resident:?} {p:?}"
    );
    // and it predicts a faster pass than the spread plan of the same slots and resident count
    let spread: Vec<bool> = (0..n)
        .map(|i| resident.len() * i % n < resident.len())
        .collect();
    let compute = r.unit_compute_s.clone().unwrap();
    let spread_s = simulate(r.link(), &compute, &spread, p.slots, GIB as f64, 4).step_s;
    assert!(
        p.predicted_step_s < 0.99 * spread_s,
        "{} vs spread {spread_s}",
        p.predicted_step_s
    );
}

#[test]
fn refinement_takes_a_balanced_image_transformer_to_its_roofline() {
    // Units and compute as measured on a Flux-dev-sized transformer at 1024x1024 (H200, child
    // units): 19 double blocks of five units, 38 single blocks of four, a budget that streams about
    // 9 GB a step. Copies and compute nearly balance; the fills alone leave compute waiting ~4 % of
    // the step (the attention units compute 1.6-1.8 ms, the modulation units 0.1 ms, and three
    // slots let the link run only three units ahead).
    let double = [
        (108.04, 0.147),
        (108.04, 0.080),
        (144.05, 1.800),
        (144.03, 0.850),
        (144.03, 0.132),
    ];
    let single = [
        (54.02, 0.149),
        (72.02, 0.464),
        (90.01, 0.549),
        (54.02, 1.569),
    ];
    let units: Vec<(f64, f64)> = std::iter::repeat_n(double, 19)
        .flatten()
        .chain(std::iter::repeat_n(single, 38).flatten())
        .collect();
    let mut r = req(
        units
            .iter()
            .map(|&(mib, _)| (mib * MIB as f64) as u64)
            .collect(),
        Some(15_083_190_118),
    );
    r.base_bytes = 128_249_984;
    r.link_bytes_per_s = 54.8e9;
    r.unit_compute_s = Some(units.iter().map(|&(_, ms)| ms * 1e-3).collect());
    let (p, cost) = plan_counted(&r).unwrap();
    check(&r, &p);
    assert!(cost.refinements > 0, "{cost:?}");
    assert!(
        p.predicted_step_s <= 1.005 * p.bound_s,
        "predicted {} against the roofline {}",
        p.predicted_step_s,
        p.bound_s
    );
    // the prediction is the steady state: a plan can never beat the link's time for its bytes
    let compute = r.unit_compute_s.clone().unwrap();
    let sim = simulate(
        r.link(),
        &compute,
        &p.resident,
        p.slots,
        r.link_bytes_per_s,
        4,
    );
    assert!(
        p.predicted_step_s >= sim.link_busy_s * (1.0 - 1e-9),
        "{sim:?}"
    );
}

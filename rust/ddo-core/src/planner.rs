//! The offload planner: which units stay resident, how many slots stream the rest.
//!
//! Units come in execution order; one forward pass visits them in that
//! order and passes repeat (denoising steps). A plan keeps some units
//! resident on the device and streams the others through a ring of `K`
//! equally sized slots, each as large as the largest streamed unit.
//!
//! # Minimum budget
//!
//! A plan that streams the set `S` and keeps the rest resident needs
//! `base + bytes(not S) + K * max(S)` bytes. For a given largest streamed
//! size `m`, streaming *every* unit no larger than `m` costs nothing extra,
//! and every unit larger than `m` must be resident. So the cheapest plan is
//! the minimum, over the distinct unit sizes `m`, of
//! `base + bytes(units larger than m) + min_slots * m`, or keeping
//! everything resident (`base + bytes(all units)`) if that is cheaper.
//! [`minimum_budget`] computes exactly that.
//!
//! # Search
//!
//! For each slot count `K` and each feasible largest-streamed size `m`, the
//! units larger than `m` are resident and the space left,
//! `budget - base - K * m - bytes(units larger than m)`, is filled with
//! further resident units by a few strategies: spreading them evenly among
//! the streamed ones (error diffusion over bytes, so that copies hide behind
//! resident compute), largest-first (most resident bytes), link-heavy first (the
//! units whose copy most exceeds their compute, so that a phase of link-heavy
//! units does not leave the link the bottleneck while the rest of the pass
//! waits on compute; only with per-unit compute times), and none. Each
//! distinct candidate is scored with [`simulate`]; the lowest predicted step
//! time wins, ties going to fewer slots, then more resident bytes, then the
//! earlier candidate.
//!
//! # Refinement
//!
//! The fills place resident units by simple rules; where per-unit compute
//! varies (an image transformer's attention against its modulation
//! layers) and copies and compute nearly balance, the best of them can stall
//! compute for several percent of a step, because a ring of `K` slots lets
//! the link run at most `K` units ahead. With per-unit compute times (measured:
//! a re-plan after the calibration call, `vram_budget="auto"`), the winner is
//! then improved by local search: a streamed unit and a resident one that fits its slot trade
//! places when the simulated step gets shorter and the budget still holds.
//! Each round simulates the plan unit by unit and tries first the streamed
//! units just before the longest compute waits against the resident units
//! where the link sat idle waiting for a slot; the first swap that helps
//! starts the next round, until a round finds none or the search has spent
//! [`REFINE_WORK`] unit-steps on trial swaps (each round also simulates its
//! starting plan once, unit by unit, which the bound does not count). On the measured compute of a
//! Flux-sized transformer (247 units) it reaches the roofline in tens of
//! milliseconds. The search is deterministic.
//!
//! Every prediction is steady-state: the simulated last pass, and never less
//! than the link's time for the bytes streamed per pass (a few simulated
//! passes can end before a slow link's lag shows).

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use crate::error::{CoreError, Result};
use crate::simulate::{simulate, simulate_detail, MAX_SLOTS};

/// Passes simulated to score a candidate; the last one is the steady state.
pub const SIM_PASSES: usize = 4;

/// Most unit-steps of simulation (`passes x units` per trial swap) the refinement may spend on trial
/// swaps (each round's one detailed simulation of its starting plan is not counted): 16 000
/// trial plans of 250 units, 6 400 of 625 (about 0.1 s on this project's CI machine).
pub const REFINE_WORK: usize = 16_000_000;

/// What a plan cost to find.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PlanCost {
    /// Candidate plans of the search simulated (pruned by the roofline bound).
    pub simulations: usize,
    /// Trial swaps the refinement simulated (bounded by [`REFINE_WORK`]).
    pub refinements: usize,
}

/// What the planner needs to know.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanRequest {
    /// Bytes of each unit, in execution order.
    pub unit_bytes: Vec<u64>,
    /// Measured compute seconds per unit, if known (same length as `unit_bytes`).
    pub unit_compute_s: Option<Vec<f64>>,
    /// Weights that are always resident (parameters outside any unit).
    pub base_bytes: u64,
    /// Device bytes available for weights; `None` means unlimited.
    pub budget_bytes: Option<u64>,
    /// Host-to-device bandwidth, bytes per second (finite, > 0).
    pub link_bytes_per_s: f64,
    /// Compute throughput used to estimate a unit's compute time as
    /// `bytes / compute_bytes_per_s` when `unit_compute_s` is `None` (finite, > 0).
    pub compute_bytes_per_s: f64,
    /// Fewest slots a streaming plan may use; normally 2 (double buffering),
    /// 1 is accepted but serializes copies and compute.
    pub min_slots: usize,
    /// Most slots a streaming plan may use (`>= min_slots`).
    pub max_slots: usize,
    /// Bytes each unit sends over the link when streamed, if not `unit_bytes` (a codec sends
    /// fewer than the slot holds); same length as `unit_bytes`.
    #[serde(default)]
    pub link_bytes: Option<Vec<u64>>,
}

impl PlanRequest {
    /// A request with no base weights, no budget, no measured compute times
    /// and 2 to 4 slots.
    pub fn new(unit_bytes: Vec<u64>, link_bytes_per_s: f64, compute_bytes_per_s: f64) -> Self {
        Self {
            unit_bytes,
            unit_compute_s: None,
            base_bytes: 0,
            budget_bytes: None,
            link_bytes_per_s,
            compute_bytes_per_s,
            min_slots: 2,
            max_slots: 4,
            link_bytes: None,
        }
    }

    /// What each unit sends over the link when streamed.
    pub fn link(&self) -> &[u64] {
        self.link_bytes.as_deref().unwrap_or(&self.unit_bytes)
    }
}

/// The planner's answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// Per unit: kept resident (`true`) or streamed (`false`).
    pub resident: Vec<bool>,
    /// Number of slots; 0 when nothing streams.
    pub slots: usize,
    /// Bytes per slot: the largest streamed unit (0 when nothing streams).
    pub slot_bytes: u64,
    /// Units in flight ahead of compute; equal to `slots`.
    pub prefetch_depth: usize,
    /// `base_bytes` plus the resident units.
    pub resident_bytes: u64,
    /// Bytes copied per pass.
    pub streamed_bytes: u64,
    /// `resident_bytes + slots * slot_bytes`; never above the budget.
    pub gpu_bytes: u64,
    /// Simulated steady-state seconds per pass.
    pub predicted_step_s: f64,
    /// Roofline: `max(total compute, streamed_bytes / link)`.
    pub bound_s: f64,
}

impl Plan {
    /// Indices of the streamed units, in execution order.
    pub fn streamed_units(&self) -> Vec<usize> {
        (0..self.resident.len())
            .filter(|&i| !self.resident[i])
            .collect()
    }
}

/// The cheapest valid plan's footprint (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MinimumBudget {
    /// Smallest budget that admits a plan.
    pub bytes: u64,
    /// Resident bytes of that plan (base plus units kept resident).
    pub resident_bytes: u64,
    /// Slot size of that plan; 0 if it keeps everything resident.
    pub largest_unit: u64,
    /// Slots of that plan; 0 if it keeps everything resident.
    pub slots: usize,
}

/// The smallest budget that admits any plan with `min_slots` slots.
pub fn minimum_budget(unit_bytes: &[u64], base_bytes: u64, min_slots: usize) -> MinimumBudget {
    let all = base_bytes.saturating_add(sum(unit_bytes));
    let mut best = MinimumBudget {
        bytes: all,
        resident_bytes: all,
        largest_unit: 0,
        slots: 0,
    };
    for m in distinct_sizes_desc(unit_bytes) {
        if m == 0 {
            continue;
        }
        let resident = base_bytes.saturating_add(sum_larger(unit_bytes, m));
        let bytes = resident.saturating_add(m.saturating_mul(min_slots as u64));
        if bytes < best.bytes {
            best = MinimumBudget {
                bytes,
                resident_bytes: resident,
                largest_unit: m,
                slots: min_slots,
            };
        }
    }
    best
}

/// Plans which units stay resident and how many slots stream the rest.
///
/// Errors: [`CoreError::InvalidPlanRequest`] for meaningless requests and
/// [`CoreError::BudgetTooSmall`] when no plan fits the budget.
pub fn plan(req: &PlanRequest) -> Result<Plan> {
    plan_counted(req).map(|(plan, _)| plan)
}

/// [`plan`], and what it cost: the candidate plans the search simulated (a small multiple of the
/// unit count, because the roofline bound prunes candidates before simulation) and the trial
/// swaps of the refinement.
pub fn plan_counted(req: &PlanRequest) -> Result<(Plan, PlanCost)> {
    let compute = validate(req)?;
    let n = req.unit_bytes.len();
    let everything = req.base_bytes.saturating_add(sum(&req.unit_bytes));
    let budget = match req.budget_bytes {
        Some(b) if b < everything => b,
        _ => return Ok((all_resident(req, &compute), PlanCost::default())),
    };

    let min = minimum_budget(&req.unit_bytes, req.base_bytes, req.min_slots);
    if budget < min.bytes {
        return Err(CoreError::BudgetTooSmall {
            budget,
            minimum: min.bytes,
            largest_unit: min.largest_unit,
            base: min.resident_bytes,
        });
    }

    // Units by size, largest first (ties: earlier first), for the greedy fill.
    let mut by_size: Vec<usize> = (0..n).collect();
    by_size.sort_by(|&a, &b| req.unit_bytes[b].cmp(&req.unit_bytes[a]).then(a.cmp(&b)));
    // Units by how much longer their copy takes than their compute, most first (ties: earlier
    // first), for the link-heavy fill: keeping those resident leaves the link the units whose copy
    // hides behind compute, where a fill by size leaves phases of link-heavy units (a video or
    // image transformer's wide double blocks) link-bound while the rest of the pass waits on compute.
    let excess: Vec<f64> = req
        .link()
        .iter()
        .zip(&compute)
        .map(|(&l, &c)| l as f64 / req.link_bytes_per_s - c)
        .collect();
    let mut by_excess: Vec<usize> = (0..n).collect();
    by_excess.sort_by(|&a, &b| excess[b].total_cmp(&excess[a]).then(a.cmp(&b)));
    let orders = Orders {
        by_size: &by_size,
        by_excess: &by_excess,
    };

    // Smallest slot size first: those candidates keep the most bytes
    // resident and tend to win early, which lets the bound prune the rest.
    let mut sizes = distinct_sizes_desc(&req.unit_bytes);
    sizes.reverse();
    let total_compute: f64 = compute.iter().sum();
    let max_k = req.max_slots.min(n).max(req.min_slots);
    let mut seen: HashSet<(usize, Vec<bool>)> = HashSet::new();
    let mut best: Option<Plan> = None;
    let mut simulations = 0usize;

    for k in req.min_slots..=max_k {
        for &m in &sizes {
            let Some(cap) = budget
                .checked_sub(req.base_bytes)
                .and_then(|b| b.checked_sub(m.saturating_mul(k as u64)))
                .and_then(|b| b.checked_sub(sum_larger(&req.unit_bytes, m)))
            else {
                continue;
            };
            for strategy in STRATEGIES {
                // compute estimated from bytes orders units as their size does: the link-heavy
                // fill is the largest-first one again, scored by a model that cannot tell them apart
                if matches!(strategy, Strategy::LinkHeavy) && req.unit_compute_s.is_none() {
                    continue;
                }
                let resident = choose_resident(&req.unit_bytes, &orders, m, cap, strategy);
                let streamed = resident.iter().filter(|r| !**r).count();
                // More slots than streamed units only re-copies the same units.
                if streamed == 0 || (k > streamed && k > req.min_slots) {
                    continue;
                }
                let mut candidate = footprint(req, resident, k, total_compute);
                if candidate.gpu_bytes > budget {
                    continue;
                }
                // `candidate` is scored optimistically (predicted = roofline
                // bound); if even that does not win, skip the simulation.
                if best.as_ref().is_some_and(|b| !better(&candidate, b)) {
                    continue;
                }
                if !seen.insert((k, candidate.resident.clone())) {
                    continue;
                }
                simulations += 1;
                candidate.predicted_step_s = steady_step(req, &compute, &candidate.resident, k);
                if best.as_ref().is_none_or(|b| better(&candidate, b)) {
                    best = Some(candidate);
                }
            }
        }
    }
    let best = best.ok_or_else(|| {
        CoreError::InvalidPlanRequest(format!(
            "no plan fits budget {budget} bytes although the minimum is {} bytes",
            min.bytes
        ))
    })?;
    // with compute from the prior (proportional to bytes) the fills' plans are what was measured on
    // the GPU; the search would fit the prior's errors (it streams the modulation layers it thinks
    // compute-heavy)
    let (plan, refinements) = if req.unit_compute_s.is_some() {
        refine(req, &compute, best, budget, total_compute)
    } else {
        (best, 0)
    };
    Ok((
        plan,
        PlanCost {
            simulations,
            refinements,
        },
    ))
}

/// The steady-state seconds per pass of `resident` with `slots` slots: the simulated last pass, and
/// never less than the link's time for what streams (see the module docs).
fn steady_step(req: &PlanRequest, compute: &[f64], resident: &[bool], slots: usize) -> f64 {
    let sim = simulate(
        req.link(),
        compute,
        resident,
        slots,
        req.link_bytes_per_s,
        SIM_PASSES,
    );
    sim.step_s.max(sim.link_busy_s)
}

/// Local search from `start` (see the module docs): a streamed unit made resident in exchange for
/// a resident unit that fits the slots, kept when the steady step gets shorter and the budget
/// holds. Each round simulates the plan unit by unit and tries first the streamed units just
/// before the longest compute waits, each against the resident units where the link sat idle
/// (waiting for a slot); the first swap that shortens the step starts the next round. Returns the
/// plan and the trial swaps simulated.
fn refine(
    req: &PlanRequest,
    compute: &[f64],
    start: Plan,
    budget: u64,
    total_compute: f64,
) -> (Plan, usize) {
    let n = req.unit_bytes.len();
    let k = start.slots;
    let m = start.slot_bytes;
    if k == 0 || start.predicted_step_s <= start.bound_s * (1.0 + 1e-9) {
        return (start, 0); // nothing streams, or already at the roofline
    }
    let most = REFINE_WORK / SIM_PASSES.saturating_mul(n).max(1);
    // free bytes under the budget with `k` slots of `m` bytes (the slot size never grows: a unit
    // that starts streaming fits a slot)
    let mut free = budget.saturating_sub(
        start
            .resident_bytes
            .saturating_add(m.saturating_mul(k as u64)),
    );
    let mut resident = start.resident.clone();
    let mut score = start.predicted_step_s;
    let mut trials = 0usize;
    let bytes = &req.unit_bytes;
    'rounds: loop {
        let (_, detail) = simulate_detail(
            req.link(),
            compute,
            &resident,
            k,
            req.link_bytes_per_s,
            SIM_PASSES,
        );
        let (streamed_first, resident_first) = swap_orders(&resident, &detail, 2 * k, bytes, m);
        for &s in &streamed_first {
            for &r in &resident_first {
                if free.saturating_add(bytes[r]) < bytes[s] {
                    continue;
                }
                if trials >= most {
                    break 'rounds;
                }
                trials += 1;
                resident[s] = true;
                resident[r] = false;
                let t = steady_step(req, compute, &resident, k);
                if t < score * (1.0 - 1e-9) {
                    score = t;
                    free = free + bytes[r] - bytes[s];
                    continue 'rounds;
                }
                resident[s] = false;
                resident[r] = true;
            }
        }
        break;
    }
    if score >= start.predicted_step_s {
        return (start, trials);
    }
    let mut plan = footprint(req, resident, k, total_compute);
    plan.predicted_step_s = score.max(plan.bound_s);
    (plan, trials)
}

/// The refinement's trial order: streamed units by the longest compute wait among the next
/// `window` streamed units from them (cyclic; a stall comes from the copies queued before it),
/// and resident units that fit a slot of `m` bytes by the link's idle time before the next
/// streamed unit after them (where a copy more costs the least). Ties in index order.
fn swap_orders(
    resident: &[bool],
    detail: &crate::simulate::PassDetail,
    window: usize,
    bytes: &[u64],
    m: u64,
) -> (Vec<usize>, Vec<usize>) {
    let n = resident.len();
    let streamed: Vec<usize> = (0..n).filter(|&i| !resident[i]).collect();
    let ahead = window.min(streamed.len());
    let mut s_key: Vec<(f64, usize)> = streamed
        .iter()
        .enumerate()
        .map(|(j, &s)| {
            let worst = (0..ahead)
                .map(|d| detail.wait[streamed[(j + d) % streamed.len()]])
                .fold(0.0f64, f64::max);
            (worst, s)
        })
        .collect();
    s_key.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    // the link's idle time before the next streamed unit, for every unit (cyclic)
    let mut next_idle = vec![0.0f64; n];
    if let Some(&first) = streamed.first() {
        let mut idle = detail.link_idle[first];
        for i in (0..n).rev() {
            if !resident[i] {
                idle = detail.link_idle[i];
            }
            next_idle[i] = idle;
        }
    }
    let mut r_key: Vec<(f64, usize)> = (0..n)
        .filter(|&i| resident[i] && bytes[i] <= m)
        .map(|i| (next_idle[i], i))
        .collect();
    r_key.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    (
        s_key.into_iter().map(|(_, s)| s).collect(),
        r_key.into_iter().map(|(_, r)| r).collect(),
    )
}

/// Checks the request and returns per-unit compute seconds.
fn validate(req: &PlanRequest) -> Result<Vec<f64>> {
    let bad = |msg: String| Err(CoreError::InvalidPlanRequest(msg));
    let n = req.unit_bytes.len();
    if n == 0 {
        return bad("no units to plan: unit_bytes is empty".into());
    }
    if !(req.link_bytes_per_s.is_finite() && req.link_bytes_per_s > 0.0) {
        return bad(format!(
            "link_bytes_per_s must be a finite positive number, got {}",
            req.link_bytes_per_s
        ));
    }
    if req.min_slots == 0 {
        return bad("min_slots must be at least 1 (normally 2)".into());
    }
    if req.min_slots > MAX_SLOTS {
        return Err(CoreError::InvalidArgument(format!(
            "min_slots = {} is more than the {MAX_SLOTS} slots a transport can have (normally 2)",
            req.min_slots
        )));
    }
    if req.max_slots < req.min_slots {
        return bad(format!(
            "max_slots ({}) is below min_slots ({})",
            req.max_slots, req.min_slots
        ));
    }
    if let Some(link) = &req.link_bytes {
        if link.len() != n {
            return bad(format!(
                "link_bytes has {} entries but there are {n} units",
                link.len()
            ));
        }
    }
    match &req.unit_compute_s {
        Some(times) => {
            if times.len() != n {
                return bad(format!(
                    "unit_compute_s has {} entries but there are {n} units",
                    times.len()
                ));
            }
            if let Some((i, t)) = times
                .iter()
                .enumerate()
                .find(|(_, t)| !(t.is_finite() && **t >= 0.0))
            {
                return bad(format!(
                    "unit_compute_s[{i}] = {t} is not a finite non-negative number of seconds"
                ));
            }
            Ok(times.clone())
        }
        None => {
            let rate = req.compute_bytes_per_s;
            if !(rate.is_finite() && rate > 0.0) {
                return bad(format!(
                    "compute_bytes_per_s must be a finite positive number when unit_compute_s \
                     is not given, got {rate}"
                ));
            }
            Ok(req.unit_bytes.iter().map(|&b| b as f64 / rate).collect())
        }
    }
}

fn all_resident(req: &PlanRequest, compute: &[f64]) -> Plan {
    let total: f64 = compute.iter().sum();
    let bytes = req.base_bytes.saturating_add(sum(&req.unit_bytes));
    Plan {
        resident: vec![true; req.unit_bytes.len()],
        slots: 0,
        slot_bytes: 0,
        prefetch_depth: 0,
        resident_bytes: bytes,
        streamed_bytes: 0,
        gpu_bytes: bytes,
        predicted_step_s: total,
        bound_s: total,
    }
}

/// The plan for `resident` with `slots` slots, its predicted time set to the
/// roofline bound (a lower bound on the simulated time).
fn footprint(req: &PlanRequest, resident: Vec<bool>, slots: usize, total_compute: f64) -> Plan {
    let mut resident_bytes = req.base_bytes;
    let mut streamed_bytes = 0u64;
    let mut slot_bytes = 0u64;
    let mut link_bytes = 0u64;
    for ((&b, &l), &r) in req.unit_bytes.iter().zip(req.link()).zip(&resident) {
        if r {
            resident_bytes = resident_bytes.saturating_add(b);
        } else {
            streamed_bytes = streamed_bytes.saturating_add(b);
            link_bytes = link_bytes.saturating_add(l);
            slot_bytes = slot_bytes.max(b);
        }
    }
    let bound_s = total_compute.max(link_bytes as f64 / req.link_bytes_per_s);
    Plan {
        resident,
        slots,
        slot_bytes,
        prefetch_depth: slots,
        resident_bytes,
        streamed_bytes,
        gpu_bytes: resident_bytes.saturating_add(slot_bytes.saturating_mul(slots as u64)),
        predicted_step_s: bound_s,
        bound_s,
    }
}

/// Whether `a` beats `b`: faster, then fewer slots, then more resident bytes.
fn better(a: &Plan, b: &Plan) -> bool {
    let tol = 1e-9 * a.predicted_step_s.abs().max(b.predicted_step_s.abs());
    if a.predicted_step_s < b.predicted_step_s - tol {
        return true;
    }
    if a.predicted_step_s > b.predicted_step_s + tol {
        return false;
    }
    if a.slots != b.slots {
        return a.slots < b.slots;
    }
    a.resident_bytes > b.resident_bytes
}

/// How to fill the free space with optional resident units.
#[derive(Debug, Clone, Copy)]
enum Strategy {
    /// Error diffusion over bytes starting with the given fraction of a unit
    /// already accumulated, then largest-first for what is left.
    Spread(f64),
    /// Largest units first.
    Greedy,
    /// The units whose copy most exceeds their compute first.
    LinkHeavy,
    /// Only the units that must be resident.
    None,
}

const STRATEGIES: [Strategy; 6] = [
    Strategy::Spread(0.5),
    Strategy::Spread(0.0),
    Strategy::Spread(1.0),
    Strategy::Greedy,
    Strategy::LinkHeavy,
    Strategy::None,
];

/// The unit orders the fills take units in.
struct Orders<'a> {
    /// Largest first.
    by_size: &'a [usize],
    /// Copy time minus compute time, largest first.
    by_excess: &'a [usize],
}

/// Units larger than `m` are resident; units of at most `m` bytes are made
/// resident within `cap` extra bytes according to `strategy`.
fn choose_resident(
    unit_bytes: &[u64],
    orders: &Orders<'_>,
    m: u64,
    cap: u64,
    strategy: Strategy,
) -> Vec<bool> {
    let mut resident: Vec<bool> = unit_bytes.iter().map(|&b| b > m).collect();
    let mut left = cap;
    let take = |i: usize, resident: &mut Vec<bool>, left: &mut u64| {
        let b = unit_bytes[i];
        if !resident[i] && b <= *left {
            resident[i] = true;
            *left -= b;
            true
        } else {
            false
        }
    };
    match strategy {
        Strategy::None => {}
        Strategy::Greedy => {
            for &i in orders.by_size {
                take(i, &mut resident, &mut left);
            }
        }
        Strategy::LinkHeavy => {
            for &i in orders.by_excess {
                if unit_bytes[i] <= m {
                    take(i, &mut resident, &mut left);
                }
            }
        }
        Strategy::Spread(phase) => {
            let optional = || (0..unit_bytes.len()).filter(|&i| unit_bytes[i] <= m);
            let optional_bytes = optional().fold(0u64, |a, i| a.saturating_add(unit_bytes[i]));
            if optional_bytes > 0 {
                let fraction = (cap as f64 / optional_bytes as f64).min(1.0);
                let mean = optional_bytes as f64 / optional().count() as f64;
                let mut acc = phase * mean * fraction;
                for i in optional() {
                    let b = unit_bytes[i] as f64;
                    acc += fraction * b;
                    if acc >= b && take(i, &mut resident, &mut left) {
                        acc -= b;
                    }
                }
            }
            for &i in orders.by_size {
                if unit_bytes[i] <= m {
                    take(i, &mut resident, &mut left);
                }
            }
        }
    }
    resident
}

fn sum(bytes: &[u64]) -> u64 {
    bytes.iter().fold(0u64, |a, &b| a.saturating_add(b))
}

fn sum_larger(bytes: &[u64], m: u64) -> u64 {
    bytes
        .iter()
        .filter(|&&b| b > m)
        .fold(0u64, |a, &b| a.saturating_add(b))
}

fn distinct_sizes_desc(bytes: &[u64]) -> Vec<u64> {
    let mut sizes = bytes.to_vec();
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    sizes.dedup();
    sizes
}

//! The planner, the simulator and the slab layout.

use ddo_core::{PlanRequest, RamCacheRequest, SimResult};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{core_err, ConfigError};

/// Plans a component: which units stay resident, how many slots stream the rest. Returns a dict
/// with the fields of `ddo_core::Plan`.
#[pyfunction]
#[pyo3(signature = (unit_bytes, *, base_bytes, budget_bytes, link_bytes_per_s, compute_bytes_per_s, min_slots=2, max_slots=4, unit_compute_s=None))]
#[allow(clippy::too_many_arguments)]
fn plan<'py>(
    py: Python<'py>,
    unit_bytes: Vec<u64>,
    base_bytes: u64,
    budget_bytes: Option<u64>,
    link_bytes_per_s: f64,
    compute_bytes_per_s: f64,
    min_slots: usize,
    max_slots: usize,
    unit_compute_s: Option<Vec<f64>>,
) -> PyResult<Bound<'py, PyDict>> {
    let req = PlanRequest {
        unit_bytes,
        unit_compute_s,
        base_bytes,
        budget_bytes,
        link_bytes_per_s,
        compute_bytes_per_s,
        min_slots,
        max_slots,
    };
    let p = py.detach(|| ddo_core::plan(&req)).map_err(core_err)?;
    let d = PyDict::new(py);
    d.set_item("resident", p.resident)?;
    d.set_item("slots", p.slots)?;
    d.set_item("slot_bytes", p.slot_bytes)?;
    d.set_item("prefetch_depth", p.prefetch_depth)?;
    d.set_item("resident_bytes", p.resident_bytes)?;
    d.set_item("streamed_bytes", p.streamed_bytes)?;
    d.set_item("gpu_bytes", p.gpu_bytes)?;
    d.set_item("predicted_step_s", p.predicted_step_s)?;
    d.set_item("bound_s", p.bound_s)?;
    Ok(d)
}

/// Chooses the streamed units kept in host RAM (the NVMe route's cache); the rest are re-read from
/// disk every pass. Returns a dict with the fields of `ddo_core::RamCachePlan`.
#[pyfunction]
#[pyo3(signature = (unit_bytes, *, unit_compute_s, resident, slots, ram_budget_bytes, link_bytes_per_s, disk_bytes_per_s))]
#[allow(clippy::too_many_arguments)]
fn plan_ram_cache<'py>(
    py: Python<'py>,
    unit_bytes: Vec<u64>,
    unit_compute_s: Vec<f64>,
    resident: Vec<bool>,
    slots: usize,
    ram_budget_bytes: u64,
    link_bytes_per_s: f64,
    disk_bytes_per_s: f64,
) -> PyResult<Bound<'py, PyDict>> {
    let req = RamCacheRequest {
        unit_bytes,
        unit_compute_s,
        resident,
        slots,
        ram_budget_bytes,
        link_bytes_per_s,
        disk_bytes_per_s,
    };
    let p = py
        .detach(|| ddo_core::plan_ram_cache(&req))
        .map_err(core_err)?;
    let d = PyDict::new(py);
    d.set_item("cached", p.cached)?;
    d.set_item("from_disk", p.from_disk)?;
    d.set_item("cached_bytes", p.cached_bytes)?;
    d.set_item("disk_bytes", p.disk_bytes)?;
    d.set_item("streamed_bytes", p.streamed_bytes)?;
    d.set_item("predicted_step_s", p.predicted_step_s)?;
    d.set_item("compute_s", p.compute_s)?;
    d.set_item("disk_bound_s", p.disk_bound_s)?;
    d.set_item("link_bound_s", p.link_bound_s)?;
    d.set_item("bound_s", p.bound_s)?;
    Ok(d)
}

/// The smallest VRAM budget that yields a valid plan, in bytes.
#[pyfunction]
#[pyo3(signature = (unit_bytes, base_bytes, min_slots=2))]
fn minimum_budget(unit_bytes: Vec<u64>, base_bytes: u64, min_slots: usize) -> PyResult<u64> {
    let max = ddo_core::MAX_SLOTS;
    if !(1..=max).contains(&min_slots) {
        return Err(ConfigError::new_err(format!(
            "min_slots = {min_slots}: a plan streams through 1 to {max} slots (normally 2)"
        )));
    }
    Ok(ddo_core::minimum_budget(&unit_bytes, base_bytes, min_slots).bytes)
}

/// Simulates the copy and compute streams; returns `(step_s, first_pass_s, compute_wait_s, link_busy_s)`.
/// With `from_disk` and `disk_bytes_per_s` (the NVMe route, both or neither), the flagged units are
/// read from disk.
#[pyfunction]
#[pyo3(signature = (unit_bytes, unit_compute_s, resident, slots, link_bytes_per_s, passes=3, from_disk=None, disk_bytes_per_s=None))]
#[allow(clippy::too_many_arguments)]
fn simulate(
    unit_bytes: Vec<u64>,
    unit_compute_s: Vec<f64>,
    resident: Vec<bool>,
    slots: usize,
    link_bytes_per_s: f64,
    passes: usize,
    from_disk: Option<Vec<bool>>,
    disk_bytes_per_s: Option<f64>,
) -> PyResult<(f64, f64, f64, f64)> {
    ddo_core::check_sim_inputs(
        &unit_bytes,
        &unit_compute_s,
        &resident,
        from_disk.as_deref(),
        slots,
        link_bytes_per_s,
        disk_bytes_per_s,
        passes,
    )
    .map_err(core_err)?;
    let r = match (from_disk, disk_bytes_per_s) {
        (Some(disk), Some(bw)) => ddo_core::simulate_disk(
            &unit_bytes,
            &unit_compute_s,
            &resident,
            &disk,
            slots,
            link_bytes_per_s,
            bw,
            passes,
        ),
        (None, None) => ddo_core::simulate(
            &unit_bytes,
            &unit_compute_s,
            &resident,
            slots,
            link_bytes_per_s,
            passes,
        ),
        _ => {
            return Err(core_err(ddo_core::CoreError::InvalidPlanRequest(
                "simulate needs both from_disk and disk_bytes_per_s, or neither".into(),
            )))
        }
    };
    let SimResult {
        step_s,
        first_pass_s,
        compute_wait_s,
        link_busy_s,
        ..
    } = r;
    Ok((step_s, first_pass_s, compute_wait_s, link_busy_s))
}

/// Lays out one unit's tensors at 256-byte aligned offsets: `(offsets, unit_nbytes)`.
#[pyfunction]
fn layout_unit(tensor_bytes: Vec<u64>) -> PyResult<(Vec<u64>, u64)> {
    let l = ddo_core::layout_unit(&tensor_bytes).map_err(core_err)?;
    Ok((l.offsets, l.nbytes))
}

/// `(slab_sizes, [(slab, offset, nbytes)])`.
type Slabs = (Vec<u64>, Vec<(usize, u64, u64)>);

/// Packs units into slabs of at most `max_slab_bytes`: `(slab_sizes, [(slab, offset, nbytes)])`.
#[pyfunction]
fn layout_slabs(unit_bytes: Vec<u64>, max_slab_bytes: u64) -> PyResult<Slabs> {
    let l = ddo_core::layout_slabs(&unit_bytes, max_slab_bytes).map_err(core_err)?;
    let placements = l
        .placements
        .iter()
        .map(|p| (p.slab, p.offset, p.nbytes))
        .collect();
    Ok((l.slabs, placements))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(plan, m)?)?;
    m.add_function(wrap_pyfunction!(minimum_budget, m)?)?;
    m.add_function(wrap_pyfunction!(plan_ram_cache, m)?)?;
    m.add_function(wrap_pyfunction!(simulate, m)?)?;
    m.add_function(wrap_pyfunction!(layout_unit, m)?)?;
    m.add_function(wrap_pyfunction!(layout_slabs, m)?)?;
    Ok(())
}

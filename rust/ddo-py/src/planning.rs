//! The planner, the simulator and the slab layout. Each result is a frozen class with the fields of
//! its `ddo_core` struct (read-only attributes, `__repr__`, `__eq__`, `to_dict()` for reports),
//! not a dict or a positional tuple.

use ddo_core::{PlanRequest, RamCacheRequest};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{core_err, ConfigError};

/// Declares a frozen result class mirroring a `ddo_core` struct: `From` the core struct, `__repr__`
/// (`Name(field=value, ...)`) and `to_dict()`.
macro_rules! result_class {
    ($(#[$doc:meta])* $name:ident from $core:ty { $($(#[$fdoc:meta])* $field:ident: $ty:ty),+ $(,)? }) => {
        $(#[$doc])*
        #[pyclass(module = "ddo_blocks._native", frozen, get_all, eq)]
        #[derive(Debug, Clone, PartialEq)]
        pub(crate) struct $name {
            $($(#[$fdoc])* $field: $ty),+
        }

        impl From<$core> for $name {
            fn from(c: $core) -> Self {
                Self { $($field: c.$field.into()),+ }
            }
        }

        #[pymethods]
        impl $name {
            fn __repr__(slf: &Bound<'_, Self>) -> PyResult<String> {
                let this = slf.get();
                let py = slf.py();
                let fields: Vec<String> = vec![
                    $(format!(
                        "{}={}",
                        stringify!($field),
                        this.$field.clone().into_pyobject(py)?.repr()?
                    )),+
                ];
                Ok(format!("{}({})", stringify!($name), fields.join(", ")))
            }

            /// The fields as a dict (for JSON reports).
            fn to_dict<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyDict>> {
                let this = slf.get();
                let d = PyDict::new(slf.py());
                $(d.set_item(stringify!($field), this.$field.clone())?;)+
                Ok(d)
            }
        }
    };
}

result_class! {
    /// The planner's answer (`ddo_core::Plan`).
    Plan from ddo_core::Plan {
        /// Per unit: kept resident (`True`) or streamed.
        resident: Vec<bool>,
        /// Number of slots; 0 when nothing streams.
        slots: usize,
        /// Bytes per slot: the largest streamed unit.
        slot_bytes: u64,
        prefetch_depth: usize,
        /// Always-resident bytes plus the resident units.
        resident_bytes: u64,
        /// Bytes copied per pass.
        streamed_bytes: u64,
        /// `resident_bytes + slots * slot_bytes`.
        gpu_bytes: u64,
        /// Simulated steady-state seconds per pass.
        predicted_step_s: f64,
        /// Roofline: `max(total compute, streamed_bytes / link)`.
        bound_s: f64,
    }
}

result_class! {
    /// The NVMe route's RAM cache (`ddo_core::RamCachePlan`).
    RamCachePlan from ddo_core::RamCachePlan {
        /// Per unit: a streamed unit kept in host RAM.
        cached: Vec<bool>,
        /// Per unit: a streamed unit re-read from disk every pass.
        from_disk: Vec<bool>,
        cached_bytes: u64,
        disk_bytes: u64,
        streamed_bytes: u64,
        predicted_step_s: f64,
        compute_s: f64,
        disk_bound_s: f64,
        link_bound_s: f64,
        bound_s: f64,
    }
}

result_class! {
    /// The smallest budget that admits a plan (`ddo_core::MinimumBudget`).
    MinimumBudget from ddo_core::MinimumBudget {
        /// The budget, in bytes.
        bytes: u64,
        resident_bytes: u64,
        largest_unit: u64,
        slots: usize,
    }
}

result_class! {
    /// Timings of a simulation (`ddo_core::SimResult`).
    SimResult from ddo_core::SimResult {
        step_s: f64,
        first_pass_s: f64,
        compute_wait_s: f64,
        link_busy_s: f64,
    }
}

result_class! {
    /// One unit's tensors at 256-byte aligned offsets (`ddo_core::UnitLayout`).
    UnitLayout from ddo_core::UnitLayout {
        offsets: Vec<u64>,
        /// The unit's size.
        nbytes: u64,
    }
}

result_class! {
    /// Where a unit lies in the slabs (`ddo_core::UnitPlacement`).
    UnitPlacement from ddo_core::UnitPlacement {
        slab: usize,
        offset: u64,
        nbytes: u64,
    }
}

/// Units packed into slabs (`ddo_core::SlabLayout`).
#[pyclass(module = "ddo_blocks._native", frozen, get_all, eq)]
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SlabLayout {
    /// Each slab's size.
    slabs: Vec<u64>,
    /// Per unit, in order.
    placements: Vec<UnitPlacement>,
}

#[pymethods]
impl SlabLayout {
    fn __repr__(&self) -> String {
        format!(
            "SlabLayout(slabs={:?}, placements=<{} units>)",
            self.slabs,
            self.placements.len()
        )
    }
}

/// Plans a component: which units stay resident, how many slots stream the rest.
#[pyfunction]
#[pyo3(signature = (unit_bytes, *, base_bytes, budget_bytes, link_bytes_per_s, compute_bytes_per_s, min_slots=2, max_slots=4, unit_compute_s=None, link_bytes=None))]
#[allow(clippy::too_many_arguments)]
fn plan(
    py: Python<'_>,
    unit_bytes: Vec<u64>,
    base_bytes: u64,
    budget_bytes: Option<u64>,
    link_bytes_per_s: f64,
    compute_bytes_per_s: f64,
    min_slots: usize,
    max_slots: usize,
    unit_compute_s: Option<Vec<f64>>,
    link_bytes: Option<Vec<u64>>,
) -> PyResult<Plan> {
    let req = PlanRequest {
        unit_bytes,
        unit_compute_s,
        base_bytes,
        budget_bytes,
        link_bytes_per_s,
        compute_bytes_per_s,
        min_slots,
        max_slots,
        link_bytes,
    };
    let p = py.detach(|| ddo_core::plan(&req)).map_err(core_err)?;
    Ok(p.into())
}

/// Chooses the streamed units kept in host RAM (the NVMe route's cache); the rest are re-read from
/// disk every pass.
#[pyfunction]
#[pyo3(signature = (unit_bytes, *, unit_compute_s, resident, slots, ram_budget_bytes, link_bytes_per_s, disk_bytes_per_s))]
#[allow(clippy::too_many_arguments)]
fn plan_ram_cache(
    py: Python<'_>,
    unit_bytes: Vec<u64>,
    unit_compute_s: Vec<f64>,
    resident: Vec<bool>,
    slots: usize,
    ram_budget_bytes: u64,
    link_bytes_per_s: f64,
    disk_bytes_per_s: f64,
) -> PyResult<RamCachePlan> {
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
    Ok(p.into())
}

/// The smallest VRAM budget that yields a valid plan (`.bytes`) and that plan's footprint.
#[pyfunction]
#[pyo3(signature = (unit_bytes, base_bytes, min_slots=2))]
fn minimum_budget(
    unit_bytes: Vec<u64>,
    base_bytes: u64,
    min_slots: usize,
) -> PyResult<MinimumBudget> {
    let max = ddo_core::MAX_SLOTS;
    if !(1..=max).contains(&min_slots) {
        return Err(ConfigError::new_err(format!(
            "min_slots = {min_slots}: a plan streams through 1 to {max} slots (normally 2)"
        )));
    }
    Ok(ddo_core::minimum_budget(&unit_bytes, base_bytes, min_slots).into())
}

/// Simulates the copy and compute streams over `passes` passes and reports the last one.
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
) -> PyResult<SimResult> {
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
    Ok(r.into())
}

/// Lays out one unit's tensors at 256-byte aligned offsets.
#[pyfunction]
fn layout_unit(tensor_bytes: Vec<u64>) -> PyResult<UnitLayout> {
    Ok(ddo_core::layout_unit(&tensor_bytes)
        .map_err(core_err)?
        .into())
}

/// Packs units into slabs of at most `max_slab_bytes`.
#[pyfunction]
fn layout_slabs(unit_bytes: Vec<u64>, max_slab_bytes: u64) -> PyResult<SlabLayout> {
    let l = ddo_core::layout_slabs(&unit_bytes, max_slab_bytes).map_err(core_err)?;
    Ok(SlabLayout {
        slabs: l.slabs,
        placements: l.placements.into_iter().map(Into::into).collect(),
    })
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Plan>()?;
    m.add_class::<RamCachePlan>()?;
    m.add_class::<MinimumBudget>()?;
    m.add_class::<SimResult>()?;
    m.add_class::<UnitLayout>()?;
    m.add_class::<UnitPlacement>()?;
    m.add_class::<SlabLayout>()?;
    m.add_function(wrap_pyfunction!(plan, m)?)?;
    m.add_function(wrap_pyfunction!(minimum_budget, m)?)?;
    m.add_function(wrap_pyfunction!(plan_ram_cache, m)?)?;
    m.add_function(wrap_pyfunction!(simulate, m)?)?;
    m.add_function(wrap_pyfunction!(layout_unit, m)?)?;
    m.add_function(wrap_pyfunction!(layout_slabs, m)?)?;
    Ok(())
}

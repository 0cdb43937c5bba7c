//! The Python exception hierarchy, declared here and mapped once from each crate's error enum.
//!
//! The classes are created as `ddo_blocks.X` (not `_native.X`): that is the name tracebacks show and
//! the one pickle looks up, and `ddo_blocks` re-exports every class, so an error raised in a worker
//! process pickles back to the same class with its message.

use ddo_core::CoreError;
use ddo_cuda::CudaError as RawCudaError;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    ddo_blocks,
    DdoError,
    PyException,
    "Base class of every ddo_blocks error."
);
create_exception!(
    ddo_blocks,
    ConfigError,
    DdoError,
    "An unknown route, preset, option or a malformed value."
);
create_exception!(
    ddo_blocks,
    PlanError,
    DdoError,
    "The planner cannot place the component as asked."
);
create_exception!(
    ddo_blocks,
    BudgetError,
    PlanError,
    "The VRAM (or RAM) budget cannot hold what the route needs."
);
create_exception!(
    ddo_blocks,
    CudaError,
    DdoError,
    "A CUDA driver call failed."
);
create_exception!(
    ddo_blocks,
    CudaNotAvailableError,
    CudaError,
    "No usable CUDA driver or device."
);
create_exception!(
    ddo_blocks,
    OffloadMemoryError,
    CudaError,
    "Out of GPU or page-locked host memory during setup."
);
create_exception!(
    ddo_blocks,
    CheckpointError,
    DdoError,
    "A safetensors file or index is missing, truncated, corrupt or does not match the model."
);
create_exception!(ddo_blocks, OffloadStateError, DdoError, "An operation that the offload's current state does not allow (offloading twice, removing twice).");

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("DdoError", py.get_type::<DdoError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("PlanError", py.get_type::<PlanError>())?;
    m.add("BudgetError", py.get_type::<BudgetError>())?;
    m.add("CudaError", py.get_type::<CudaError>())?;
    m.add(
        "CudaNotAvailableError",
        py.get_type::<CudaNotAvailableError>(),
    )?;
    m.add("OffloadMemoryError", py.get_type::<OffloadMemoryError>())?;
    m.add("CheckpointError", py.get_type::<CheckpointError>())?;
    m.add("OffloadStateError", py.get_type::<OffloadStateError>())?;
    Ok(())
}

pub(crate) fn core_err(e: CoreError) -> PyErr {
    let msg = e.to_string();
    match e {
        CoreError::Checkpoint { .. } | CoreError::ShardIndex { .. } | CoreError::Io { .. } => {
            CheckpointError::new_err(msg)
        }
        CoreError::BudgetTooSmall { .. } => BudgetError::new_err(msg),
        CoreError::InvalidPlanRequest(_) => PlanError::new_err(msg),
        CoreError::InvalidArgument(_) => ConfigError::new_err(msg),
    }
}

pub(crate) fn cuda_err(e: RawCudaError) -> PyErr {
    let msg = e.to_string();
    match e {
        RawCudaError::NotAvailable(_) => CudaNotAvailableError::new_err(msg),
        RawCudaError::OutOfMemory(_) => OffloadMemoryError::new_err(msg),
        RawCudaError::InvalidArgument(_) => ConfigError::new_err(msg),
        RawCudaError::Read(_) => CheckpointError::new_err(msg),
        RawCudaError::Driver { .. }
        | RawCudaError::Staging(_)
        | RawCudaError::Compile(_)
        | RawCudaError::Deferred(_) => CudaError::new_err(msg),
    }
}

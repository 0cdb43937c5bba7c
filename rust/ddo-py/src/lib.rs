//! `ddo_blocks._native`: the thin PyO3 layer. Python passes addresses, sizes and stream handles and
//! keeps the tensors behind them alive; Rust plans, copies and orders. Every error leaves through
//! [`errors`], one exhaustive mapping into the Python hierarchy rooted at `DdoError`.

mod codec;
mod errors;
mod graph;
mod hooks;
mod index;
mod kernel;
mod planning;
mod transport;
mod vmm;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    hooks::register(m)?;
    graph::register(m)?;
    planning::register(m)?;
    index::register(m)?;
    transport::register(m)?;
    kernel::register(m)?;
    codec::register(m)?;
    vmm::register(m)?;
    Ok(())
}

//! One pass over a component's module `__dict__`s for what the per-call hook checks read
//! (`ddo_blocks.streaming.guards.HookScan`): the forward hooks (their count and the newest hook's
//! id, for a CUDA graph's key) and any `_diffusers_hook` registry or `_hf_hook` (which the Python
//! side then looks at). The same lookups as the Python scan, in one loop without the interpreter.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

/// Returns `(hook count, newest hook id or -1, found)` where `found` lists, in module order,
/// `(index, registry or None, hf hook or None)` for every module that has either attribute.
/// A hook dict that is not a dict (someone replaced it with another mapping) is counted through
/// `len()` and its keys as it iterates them.
#[pyfunction]
#[allow(clippy::type_complexity)]
fn scan_module_dicts<'py>(
    py: Python<'py>,
    dicts: &Bound<'py, PyList>,
) -> PyResult<(
    usize,
    i64,
    Vec<(usize, Option<Bound<'py, PyAny>>, Option<Bound<'py, PyAny>>)>,
)> {
    let hook_keys = [
        intern!(py, "_forward_hooks"),
        intern!(py, "_forward_pre_hooks"),
    ];
    let registry_key = intern!(py, "_diffusers_hook");
    let hf_key = intern!(py, "_hf_hook");
    let (mut count, mut newest) = (0usize, -1i64);
    let mut found = Vec::new();
    for (i, d) in dicts.iter().enumerate() {
        let d = d.cast::<PyDict>()?;
        for key in hook_keys {
            let Some(hooks) = d.get_item(key)? else {
                continue;
            };
            if !hooks.is_truthy()? {
                continue;
            }
            count += hooks.len()?;
            if let Ok(dict) = hooks.cast::<PyDict>() {
                for (k, _) in dict.iter() {
                    newest = newest.max(key_id(&k)?);
                }
            } else {
                for k in hooks.try_iter()? {
                    newest = newest.max(key_id(&k?)?); // a mapping's keys, as Python iterates it
                }
            }
        }
        let registry = d.get_item(registry_key)?.filter(|r| !r.is_none());
        let hf = d.get_item(hf_key)?.filter(|h| !h.is_none());
        if registry.is_some() || hf.is_some() {
            found.push((i, registry, hf));
        }
    }
    Ok((count, newest, found))
}

/// A hook's id: torch's are ints from one counter. Any other key (a string, an int past `i64`) is
/// put in the key by its hash, which is stable within the process, rather than refused.
fn key_id(k: &Bound<'_, PyAny>) -> PyResult<i64> {
    match k.extract::<i64>() {
        Ok(v) => Ok(v),
        Err(_) => Ok(k.hash()? as i64),
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(scan_module_dicts, m)?)
}

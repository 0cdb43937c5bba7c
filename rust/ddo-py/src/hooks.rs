//! One pass over a component's module `__dict__`s for what the per-call hook checks read
//! (`ddo_blocks.streaming.guards.HookScan`): the forward hooks (their count and the newest hook's
//! id, for a CUDA graph's key), a hash of the tree's tensors and submodules by identity (for the
//! same key), and any `_diffusers_hook` registry or `_hf_hook` (which the Python side then looks
//! at). The same lookups as the Python scan, in one loop without the interpreter.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

/// Returns `(hook count, newest hook id or -1, found, tree)` where `found` lists, in module order,
/// `(index, registry or None, hf hook or None)` for every module that has either attribute, and
/// `tree` is a hash of a `forward` set on each instance and of what each module's `_parameters`,
/// `_buffers` and `_modules` hold (looked up every call: torch's own `ModuleList.__delitem__`
/// replaces `_modules`): each entry's name and the identity of its value, `None` included. A tensor
/// or submodule put in another's place, removed or added changes it whatever the way (`setattr`, a
/// direct dict write, `torch.func.functional_call`). The caller keeps the old values (and forwards)
/// alive, so an identity is never reused. A hook dict that is not a dict (someone replaced it with
/// another mapping) is counted through `len()` and its keys as it iterates them.
#[pyfunction]
#[allow(clippy::type_complexity)]
fn scan_module_dicts<'py>(
    py: Python<'py>,
    dicts: &Bound<'py, PyList>,
) -> PyResult<(
    usize,
    i64,
    Vec<(usize, Option<Bound<'py, PyAny>>, Option<Bound<'py, PyAny>>)>,
    u64,
)> {
    let hook_keys = [
        intern!(py, "_forward_hooks"),
        intern!(py, "_forward_pre_hooks"),
    ];
    let tree_keys = [
        intern!(py, "_parameters"),
        intern!(py, "_buffers"),
        intern!(py, "_modules"),
    ];
    let forward_key = intern!(py, "forward");
    let registry_key = intern!(py, "_diffusers_hook");
    let hf_key = intern!(py, "_hf_hook");
    let (mut count, mut newest) = (0usize, -1i64);
    let mut tree = Fx::new();
    let mut found = Vec::new();
    for (i, d) in dicts.iter().enumerate() {
        let d = d.cast::<PyDict>()?;
        // a forward set on the instance (`m.forward = f`) replaces what a graph replays
        match d.get_item(forward_key)? {
            Some(f) => tree.add(f.as_ptr() as usize as u64),
            None => tree.add(u64::MAX),
        }
        for key in tree_keys {
            let Some(entries) = d.get_item(key)? else {
                tree.add(u64::MAX);
                continue;
            };
            match entries.cast::<PyDict>() {
                Ok(entries) => {
                    tree.add(entries.len() as u64);
                    for (name, value) in entries.iter() {
                        tree.add(name.as_ptr() as usize as u64);
                        tree.add(value.as_ptr() as usize as u64);
                    }
                }
                // not a dict: its identity and length
                Err(_) => {
                    tree.add(entries.as_ptr() as usize as u64);
                    tree.add(entries.len().unwrap_or(0) as u64);
                }
            }
        }
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
    Ok((count, newest, found, tree.0))
}

/// The Fx hash over 64-bit words (rustc's): what the tree hash needs, one multiply a word (no
/// adversary, nothing persisted).
struct Fx(u64);

impl Fx {
    fn new() -> Self {
        Self(0)
    }
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
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

//! One pass over a component's module `__dict__`s for what the per-call hook checks read
//! (`ddo_blocks.streaming.guards.HookScan`): the forward hooks (their count and the newest hook's
//! id, for a CUDA graph's key), a hash of the tree's tensors and submodules by identity (for the
//! same key), and any `_diffusers_hook` registry or `_hf_hook` (which the Python side then looks
//! at). The same lookups as the Python scan, in one loop without the interpreter.
//!
//! [`TreeWatch`] makes the scan's result reusable: it holds every dict the scan reads (each
//! module's `__dict__`, `_parameters`, `_buffers`, `_modules` and hook dicts) with the version tag
//! CPython gives a dict on every change (PEP 509's `ma_version_tag`), so a call whose dicts all
//! kept their tags has the last scan's result in one read a dict. Used only where a self-test at
//! run time has shown the tag to change on every write of this interpreter's dicts (instance dicts
//! included) and to stay put otherwise; elsewhere (a layout or a Python without the tag) every call
//! scans.

use std::ffi::c_void;

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList};
use pyo3::{PyTraverseError, PyVisit};

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

/// The head of CPython's `PyDictObject` up to its version tag (3.11-3.13 without a debug
/// `Py_TRACE_REFS` or a free-threaded build: [`versions_work`] refuses any other layout).
#[repr(C)]
struct DictHead {
    ob_refcnt: isize,
    ob_type: *const c_void,
    ma_used: isize,
    ma_version_tag: u64,
}

/// The version tag of `d`, as this layout reads it; meaningful only once [`versions_work`] holds.
fn version(d: &Bound<'_, PyDict>) -> u64 {
    // SAFETY: `d` is a live dict object (the borrow keeps it alive), at least `DictHead`'s 32
    // bytes long in every CPython build, and nothing writes it while the GIL is held here: the
    // read is of initialised memory of the object. Whether the word is the version tag is what
    // `versions_work` checks before any result depends on it.
    unsafe {
        std::ptr::read(std::ptr::addr_of!(
            (*(d.as_ptr() as *const DictHead)).ma_version_tag
        ))
    }
}

/// Whether this interpreter's dicts carry a version tag where [`DictHead`] reads it, changed by
/// every write (a new value for an existing key, a delete and the same insert again, an attribute
/// set on an instance whose `__dict__` was made) and by nothing else, from one increasing counter.
/// Checked once per process (a lock that gives the GIL up while it waits: the self-test runs
/// Python, which may switch threads). CPython 3.13 stores instance attributes in the object's
/// inline values without moving the dict's tag, 3.14 moves no tag: the test fails there.
fn versions_work(py: Python<'_>) -> bool {
    static WORKS: PyOnceLock<bool> = PyOnceLock::new();
    *WORKS.get_or_init(py, || self_test(py).unwrap_or(false))
}

fn self_test(py: Python<'_>) -> PyResult<bool> {
    if py
        .import("sys")?
        .getattr("implementation")?
        .getattr("name")?
        .extract::<String>()?
        != "cpython"
    {
        return Ok(false);
    }
    let d = PyDict::new(py);
    d.set_item("a", 1)?;
    let v1 = version(&d);
    let _ = d.get_item("a")?;
    let same = version(&d) == v1;
    d.set_item("a", 2)?; // the same size, another value
    let v2 = version(&d);
    d.del_item("a")?;
    d.set_item("a", 2)?; // the same contents as before
    let v3 = version(&d);
    let e = PyDict::new(py);
    e.set_item("a", 2)?;
    let v4 = version(&e);
    // an instance's own `__dict__` once made (a module's), written through `setattr`
    let obj = py.eval(c"type('_DdoProbe', (), {})()", None, None)?;
    obj.setattr("a", 1)?;
    let inst = obj.getattr("__dict__")?.cast_into::<PyDict>()?;
    let w1 = version(&inst);
    obj.setattr("a", 2)?;
    let w2 = version(&inst);
    obj.setattr("b", 3)?;
    let w3 = version(&inst);
    obj.delattr("b")?;
    let w4 = version(&inst);
    Ok(same
        && v1 < v2
        && v2 < v3
        && v3 < v4
        && w1 < w2
        && w2 < w3
        && w3 < w4
        && version(&inst) == w4)
}

/// Every dict a scan of some modules read, with its version tag taken before the scan: while no
/// tag moved, no module's `forward`, tensors, layers or hooks changed, and the scan's result holds.
#[pyclass(frozen, module = "ddo_blocks._native")]
pub struct TreeWatch {
    dicts: Vec<(Py<PyDict>, u64)>,
}

#[pymethods]
impl TreeWatch {
    /// The watch of `dicts` (modules' `__dict__`s) and of the dicts they hold that the scan reads,
    /// or `None` where it cannot stand for the scan: the tags do not work here, or one of those
    /// attributes is a mapping that is not a dict. Take it before the scan, so that a change made
    /// between the two is seen at the next check.
    #[staticmethod]
    fn snapshot(py: Python<'_>, dicts: &Bound<'_, PyList>) -> PyResult<Option<TreeWatch>> {
        if !versions_work(py) {
            return Ok(None);
        }
        let keys = [
            intern!(py, "_parameters"),
            intern!(py, "_buffers"),
            intern!(py, "_modules"),
            intern!(py, "_forward_hooks"),
            intern!(py, "_forward_pre_hooks"),
        ];
        let mut out = Vec::with_capacity(dicts.len() * (keys.len() + 1));
        for d in dicts.iter() {
            let d = d.cast_into::<PyDict>()?;
            out.push((version(&d), d.clone().unbind()));
            for key in keys {
                let Some(held) = d.get_item(key)? else {
                    continue; // set later: a write of the watched `__dict__`
                };
                match held.cast_into::<PyDict>() {
                    Ok(held) => out.push((version(&held), held.unbind())),
                    Err(_) => return Ok(None),
                }
            }
        }
        Ok(Some(TreeWatch {
            dicts: out.into_iter().map(|(v, d)| (d, v)).collect(),
        }))
    }

    /// The garbage collector sees the dicts held (a module's `__dict__` holds the offload's handle,
    /// which holds this watch: without it that cycle would keep a dropped model alive).
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        for (d, _) in &self.dicts {
            visit.call(d)?;
        }
        Ok(())
    }

    /// Whether no watched dict changed since the snapshot.
    fn unchanged(&self, py: Python<'_>) -> bool {
        self.dicts.iter().all(|(d, v)| version(d.bind(py)) == *v)
    }

    fn __len__(&self) -> usize {
        self.dicts.len()
    }
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
    m.add_function(wrap_pyfunction!(scan_module_dicts, m)?)?;
    m.add_class::<TreeWatch>()
}

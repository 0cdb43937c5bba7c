//! Loading the driver, the primary context, and the result-code check.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use cudarc::driver::sys;

use crate::deferred::ErrorSlot;
use crate::error::{CudaError, Result};

/// A `CUstream` handle owned by someone else (normally PyTorch: `torch.cuda.Stream.cuda_stream`).
/// Zero is the legacy default stream. The handle is handed to the driver as is, so only
/// [`Stream::DEFAULT`] is made without `unsafe`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stream(u64);

impl Stream {
    /// The legacy default stream of the current context (handle 0).
    pub const DEFAULT: Stream = Stream(0);

    /// Wraps a stream handle.
    ///
    /// # Safety
    /// `handle` is 0 or a live `CUstream` of the context it will be used with (the target's
    /// primary context), and stays alive as long as work is queued on it through this value (for
    /// a transport's copy stream: until the transport is dropped).
    pub unsafe fn from_raw(handle: u64) -> Self {
        Self(handle)
    }

    /// The handle.
    pub fn handle(self) -> u64 {
        self.0
    }

    pub(crate) fn raw(self) -> sys::CUstream {
        self.0 as usize as sys::CUstream
    }
}

static INIT: OnceLock<std::result::Result<(), CudaError>> = OnceLock::new();
static PRIMARY: OnceLock<Mutex<HashMap<usize, usize>>> = OnceLock::new();

/// Loads the driver library and calls `cuInit` once per process. Cheap after the first call.
pub fn init() -> Result<()> {
    INIT.get_or_init(load_and_init).clone()
}

fn load_and_init() -> Result<()> {
    // SAFETY: probing only tries to open the library by its usual names; nothing is called.
    let present = unsafe { sys::is_culib_present() };
    if !present {
        return Err(CudaError::NotAvailable(
            "no CUDA driver library (libcuda.so) was found; install the NVIDIA driver or use device=\"cpu\""
                .into(),
        ));
    }
    // cudarc panics when a symbol is missing from an old driver: turn that into an error.
    // SAFETY: cuInit(0) has no preconditions; it is idempotent.
    let code = std::panic::catch_unwind(|| unsafe { sys::cuInit(0) }).map_err(|_| {
        CudaError::NotAvailable(
            "the CUDA driver library lacks cuInit; the driver is too old or broken".into(),
        )
    })?;
    check(code, "cuInit", "initialising the driver")
        .map_err(|e| CudaError::NotAvailable(e.to_string()))
}

/// Why CUDA cannot be used here, or `None` when it can.
pub fn unavailable_reason() -> Option<String> {
    init().err().map(|e| e.to_string())
}

/// Number of CUDA devices.
pub fn device_count() -> Result<usize> {
    init()?;
    let mut n: std::ffi::c_int = 0;
    // SAFETY: `n` is a valid out-pointer for the duration of the call.
    check(
        unsafe { sys::cuDeviceGetCount(&mut n) },
        "cuDeviceGetCount",
        "counting devices",
    )?;
    Ok(n.max(0) as usize)
}

/// The driver's CUDA version as an integer such as 12080.
pub fn driver_version() -> Result<i32> {
    init()?;
    let mut v: std::ffi::c_int = 0;
    // SAFETY: `v` is a valid out-pointer for the duration of the call.
    check(
        unsafe { sys::cuDriverGetVersion(&mut v) },
        "cuDriverGetVersion",
        "reading the driver version",
    )?;
    Ok(v)
}

/// Makes the primary context of device `ordinal` current on the calling thread (retaining it once
/// per process, never creating a context of our own).
pub fn make_current(ordinal: usize) -> Result<()> {
    init()?;
    let ctx = primary_context(ordinal)?;
    // SAFETY: `ctx` is a retained primary context that is never released while the process runs.
    check(
        unsafe { sys::cuCtxSetCurrent(ctx as sys::CUcontext) },
        "cuCtxSetCurrent",
        "binding the primary context",
    )
}

/// The primary context of a device bound to the calling thread for the guard's lifetime; dropping it
/// puts back whatever context was current before. PyTorch's current device follows the thread's
/// current context, so a call from Python must never leave another device's context behind.
#[derive(Debug)]
pub struct ContextGuard {
    /// The context to restore, when binding changed it (`Some(0)`: none was current).
    previous: Option<usize>,
}

/// Binds the primary context of device `ordinal` until the returned guard is dropped.
///
/// First returns what the process [`ErrorSlot`] holds, if anything: a failure no call could report
/// (a context not restored, host memory not unregistered) surfaces at the next use of a context.
pub fn bind_context(ordinal: usize) -> Result<ContextGuard> {
    init()?;
    ErrorSlot::process().check()?;
    bind_primary(ordinal)
}

/// [`bind_context`] without the check of the process slot: for `Drop`, which must not take an
/// error that belongs to the next caller.
pub(crate) fn bind_primary(ordinal: usize) -> Result<ContextGuard> {
    init()?;
    let ctx = primary_context(ordinal)?;
    let mut current: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    check(
        unsafe { sys::cuCtxGetCurrent(&mut current) },
        "cuCtxGetCurrent",
        "reading the current context",
    )?;
    if current as usize == ctx {
        return Ok(ContextGuard { previous: None });
    }
    // SAFETY: `ctx` is a retained primary context that is never released while the process runs.
    check(
        unsafe { sys::cuCtxSetCurrent(ctx as sys::CUcontext) },
        "cuCtxSetCurrent",
        "binding the primary context",
    )?;
    Ok(ContextGuard {
        previous: Some(current as usize),
    })
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        if let Some(previous) = self.previous {
            // SAFETY: `previous` was the thread's current context (or null) before the guard.
            let code = unsafe { sys::cuCtxSetCurrent(previous as sys::CUcontext) };
            let during = "restoring the caller's CUDA context";
            if let Err(e) = check(code, "cuCtxSetCurrent", during) {
                ErrorSlot::process().record(during, e);
            }
        }
    }
}

/// The driver's handle of device `ordinal`, or an error naming how many devices there are.
pub(crate) fn device(ordinal: usize) -> Result<sys::CUdevice> {
    let count = device_count()?;
    if ordinal >= count {
        return Err(CudaError::InvalidArgument(format!(
            "CUDA device {ordinal} does not exist; this machine has {count} device(s)"
        )));
    }
    let mut dev: sys::CUdevice = 0;
    // SAFETY: valid out-pointer; ordinal checked above.
    check(
        unsafe { sys::cuDeviceGet(&mut dev, ordinal as std::ffi::c_int) },
        "cuDeviceGet",
        "opening the device",
    )?;
    Ok(dev)
}

fn primary_context(ordinal: usize) -> Result<usize> {
    let map = PRIMARY.get_or_init(|| Mutex::new(HashMap::new()));
    let mut map = map
        .lock()
        .map_err(|_| CudaError::InvalidArgument("context table poisoned".into()))?;
    if let Some(&ctx) = map.get(&ordinal) {
        return Ok(ctx);
    }
    let dev = device(ordinal)?;
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer; retaining the primary context is reference counted and shares
    // the context PyTorch's runtime uses.
    check(
        unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) },
        "cuDevicePrimaryCtxRetain",
        "retaining the primary context",
    )?;
    map.insert(ordinal, ctx as usize);
    Ok(ctx as usize)
}

/// The compute capability `(major, minor)` of device `ordinal`, e.g. `(9, 0)` for an H100/H200.
pub fn compute_capability(ordinal: usize) -> Result<(i32, i32)> {
    let dev = device(ordinal)?;
    let attr = |a: sys::CUdevice_attribute| -> Result<i32> {
        let mut v: std::ffi::c_int = 0;
        // SAFETY: valid out-pointer and device handle.
        check(
            unsafe { sys::cuDeviceGetAttribute(&mut v, a, dev) },
            "cuDeviceGetAttribute",
            "reading the compute capability",
        )?;
        Ok(v)
    };
    Ok((
        attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
    ))
}

/// Blocks the host until the work queued so far on `stream` (of the current context) completed.
pub(crate) fn synchronize_stream(stream: Stream, context: &str) -> Result<()> {
    // SAFETY: `Stream` holds 0 or a live stream of the current context, alive while its owner is
    // (`Stream::from_raw`'s contract).
    check(
        unsafe { sys::cuStreamSynchronize(stream.raw()) },
        "cuStreamSynchronize",
        context,
    )
}

/// Turns a driver result code into a [`CudaError`], naming the call and what it was doing.
pub(crate) fn check(code: sys::CUresult, call: &'static str, context: &str) -> Result<()> {
    if code == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    if code == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        return Err(CudaError::OutOfMemory(format!("{call} while {context}")));
    }
    Err(CudaError::Driver {
        call,
        code: format!("{code:?}"),
        context: context.to_string(),
    })
}

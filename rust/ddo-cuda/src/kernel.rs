//! Kernels compiled at run time: CUDA C source -> PTX with NVRTC, loaded as a module in a device's
//! primary context, launched on a stream the caller owns (the engine's copy stream, PyTorch's
//! current stream). The first user is to be a decode kernel after a compressed transfer (a
//! post-copy stage of the copy job).
//!
//! NVRTC is loaded at run time like the driver (cudarc's `nvrtc` feature with dynamic loading),
//! under the names cudarc looks for (`libnvrtc.so`, `libnvrtc.so.12`, ... on the loader's path).
//! Without it, or without a driver, every function here returns [`CudaError::NotAvailable`].
//!
//! Layers as in cudarc: [`compile_ptx`] and [`Module`] are safe (they own what they create);
//! [`Kernel::launch`] is an `unsafe fn`, since the kernel reads and writes whatever its arguments
//! point to.

use std::ffi::{c_void, CStr, CString};
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;
use cudarc::nvrtc::result as nvrtc;
use cudarc::nvrtc::sys as nvrtc_sys;

use crate::deferred::ErrorSlot;
use crate::driver::{bind_context, bind_primary, check, compute_capability, init, Stream};
use crate::error::{CudaError, Result};

static NVRTC: OnceLock<(i32, i32)> = OnceLock::new();

/// Loads NVRTC (once it is found, the result is kept) and returns its version `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    if let Some(v) = NVRTC.get() {
        return Ok(*v);
    }
    // SAFETY: probing only tries to open the library by cudarc's names; nothing is called.
    if !unsafe { nvrtc_sys::is_culib_present() } {
        let mut names = cudarc::get_lib_name_candidates("nvrtc");
        let unix: Vec<String> = names
            .iter()
            .filter(|n| n.starts_with("libnvrtc.so"))
            .cloned()
            .collect();
        if !unix.is_empty() {
            names = unix;
        }
        names.dedup();
        return Err(CudaError::NotAvailable(format!(
            "NVRTC (the CUDA run-time compiler) was not found: none of {} is on the loader's \
             path; install the CUDA toolkit (or its NVRTC package) and put its lib folder on \
             LD_LIBRARY_PATH (a libnvrtc.so.13 alone needs a libnvrtc.so link to it)",
            names.join(", ")
        )));
    }
    let (mut major, mut minor) = (0, 0);
    // cudarc panics when a symbol is missing from the library: turn that into an error.
    // SAFETY: valid out-pointers; nvrtcVersion has no other precondition.
    let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe {
        nvrtc_sys::nvrtcVersion(&mut major, &mut minor)
    }))
    .map_err(|_| {
        CudaError::NotAvailable("the NVRTC library found lacks nvrtcVersion; it is broken".into())
    })?;
    code.result().map_err(|e| {
        CudaError::NotAvailable(format!("NVRTC was found but nvrtcVersion failed with {e}"))
    })?;
    Ok(*NVRTC.get_or_init(|| (major, minor)))
}

/// Why kernels cannot be compiled here (no NVRTC), or `None` when they can.
pub fn nvrtc_unavailable_reason() -> Option<String> {
    nvrtc_version().err().map(|e| e.to_string())
}

/// Compiles CUDA C `source` to PTX with NVRTC. `options` are NVRTC's (e.g.
/// `--gpu-architecture=compute_90`, `-default-device`); a kernel meant to be found by name is
/// declared `extern "C" __global__`. A compile error is [`CudaError::Compile`] with NVRTC's log.
pub fn compile_ptx(source: &str, options: &[String]) -> Result<String> {
    nvrtc_version()?;
    let no_nul = |what: &str, s: &str| {
        CString::new(s).map_err(|_| {
            CudaError::InvalidArgument(format!("the kernel {what} contains a NUL byte"))
        })
    };
    let src = no_nul("source", source)?;
    for o in options {
        no_nul(&format!("option {o:?}"), o)?;
    }
    let name = c"ddo_kernel.cu";
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        compile_checked(&src, name, options)
    }))
    .unwrap_or_else(|_| {
        Err(CudaError::NotAvailable(
            "NVRTC lacks a symbol it needs".into(),
        ))
    })
}

fn compile_checked(src: &CStr, name: &CStr, options: &[String]) -> Result<String> {
    let failed = |what: &str, e: nvrtc::NvrtcError| CudaError::Compile(format!("{what}: {e}"));
    let prog = nvrtc::create_program(src, Some(name)).map_err(|e| failed("creating", e))?;
    // SAFETY: `prog` was just created and is destroyed once, below; the options hold no NUL
    // (checked by the caller), so cudarc's conversion cannot fail.
    let compiled = unsafe { nvrtc::compile_program(prog, options) };
    let out = match compiled {
        Ok(()) => {
            // SAFETY: `prog` is live and compiled.
            unsafe { nvrtc::get_ptx(prog) }
                .map_err(|e| failed("reading the PTX", e))
                .map(|ptx| c_chars_to_string(&ptx))
        }
        Err(e) => {
            // SAFETY: `prog` is live.
            let log = unsafe { nvrtc::get_program_log(prog) }
                .map(|l| c_chars_to_string(&l))
                .unwrap_or_default();
            Err(CudaError::Compile(format!(
                "{e} with options {options:?}:\n{}",
                log.trim_end()
            )))
        }
    };
    // SAFETY: `prog` is live and not used after this.
    if let Err(e) = unsafe { nvrtc::destroy_program(prog) } {
        ErrorSlot::process().record("destroying an NVRTC program", e);
    }
    out
}

fn c_chars_to_string(chars: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// A module loaded in the primary context of a device; unloaded when the last [`Module`] or
/// [`Kernel`] of it is dropped (a failure to unload goes to the process [`ErrorSlot`]).
#[derive(Debug, Clone)]
pub struct Module(Arc<Loaded>);

#[derive(Debug)]
struct Loaded {
    module: usize,
    ordinal: usize,
}

impl Module {
    /// Loads PTX (or a cubin) image `ptx` into the primary context of device `ordinal`.
    pub fn load_ptx(ordinal: usize, ptx: &str) -> Result<Self> {
        let image = CString::new(ptx)
            .map_err(|_| CudaError::InvalidArgument("the PTX contains a NUL byte".into()))?;
        let _ctx = bind_context(ordinal)?;
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: valid out-pointer; `image` is a NUL-terminated PTX text the driver parses
        // (it rejects what is not PTX with an error); the primary context is current.
        let code = unsafe { sys::cuModuleLoadData(&mut module, image.as_ptr() as *const c_void) };
        check(code, "cuModuleLoadData", "loading a compiled kernel").map_err(|e| match code {
            sys::CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION => CudaError::Compile(format!(
                "{e}: the PTX is newer than the driver ({}) accepts; use an NVRTC no newer \
                     than the driver",
                crate::driver_version().map_or("?".into(), |v| v.to_string())
            )),
            _ => e,
        })?;
        Ok(Self(Arc::new(Loaded {
            module: module as usize,
            ordinal,
        })))
    }

    /// Compiles `source` for device `ordinal` (its compute capability, as PTX the driver finishes)
    /// and loads it. `options` are added to NVRTC's.
    pub fn compile(ordinal: usize, source: &str, options: &[String]) -> Result<Self> {
        init()?;
        let (major, minor) = compute_capability(ordinal)?;
        let mut opts = vec![format!("--gpu-architecture=compute_{major}{minor}")];
        opts.extend(options.iter().cloned());
        let ptx = compile_ptx(source, &opts)?;
        Self::load_ptx(ordinal, &ptx)
    }

    /// The device whose primary context holds the module.
    pub fn ordinal(&self) -> usize {
        self.0.ordinal
    }

    /// The kernel `name` (declared `extern "C" __global__`, or a mangled name).
    pub fn kernel(&self, name: &str) -> Result<Kernel> {
        let c_name = CString::new(name)
            .map_err(|_| CudaError::InvalidArgument("a kernel name contains a NUL byte".into()))?;
        let _ctx = bind_context(self.0.ordinal)?;
        let mut f: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the module is loaded (owned by `self`) in the current context.
        let code = unsafe {
            sys::cuModuleGetFunction(&mut f, self.0.module as sys::CUmodule, c_name.as_ptr())
        };
        check(
            code,
            "cuModuleGetFunction",
            &format!("finding kernel {name:?}"),
        )
        .map_err(|e| {
            if code == sys::CUresult::CUDA_ERROR_NOT_FOUND {
                CudaError::InvalidArgument(format!(
                    "the module has no kernel named {name:?}; declare it extern \"C\" __global__ \
                     so that its name is not mangled"
                ))
            } else {
                e
            }
        })?;
        Ok(Kernel {
            module: self.clone(),
            function: f as usize,
            name: name.to_string(),
        })
    }
}

impl Drop for Loaded {
    fn drop(&mut self) {
        let unloaded = bind_primary(self.ordinal).and_then(|_ctx| {
            // SAFETY: the module was loaded by `load_ptx` and is unloaded once, here, with its
            // context current; no kernel of it is left (each holds the module).
            check(
                unsafe { sys::cuModuleUnload(self.module as sys::CUmodule) },
                "cuModuleUnload",
                "unloading a kernel module",
            )
        });
        if let Err(e) = unloaded {
            ErrorSlot::process().record("unloading a kernel module", e);
        }
    }
}

/// Grid and block shape of a launch, and its dynamic shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchConfig {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_mem_bytes: u32,
}

/// One kernel argument, passed by value (a device pointer is a `Ptr`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arg {
    Ptr(u64),
    U64(u64),
    I64(i64),
    U32(u32),
    I32(i32),
    F32(f32),
    F64(f64),
}

/// Storage of one argument, aligned for any scalar type.
#[repr(C, align(8))]
#[derive(Clone, Copy)]
struct ArgSlot([u8; 8]);

impl Arg {
    fn slot(self) -> ArgSlot {
        let mut b = [0u8; 8];
        match self {
            Arg::Ptr(v) | Arg::U64(v) => b.copy_from_slice(&v.to_ne_bytes()),
            Arg::I64(v) => b.copy_from_slice(&v.to_ne_bytes()),
            Arg::F64(v) => b.copy_from_slice(&v.to_ne_bytes()),
            Arg::U32(v) => b[..4].copy_from_slice(&v.to_ne_bytes()),
            Arg::I32(v) => b[..4].copy_from_slice(&v.to_ne_bytes()),
            Arg::F32(v) => b[..4].copy_from_slice(&v.to_ne_bytes()),
        }
        ArgSlot(b)
    }
}

/// A kernel of a loaded [`Module`] (which it keeps loaded).
#[derive(Debug, Clone)]
pub struct Kernel {
    module: Module,
    function: usize,
    name: String,
}

impl Kernel {
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn module(&self) -> &Module {
        &self.module
    }

    /// Queues the kernel on `stream` with `args`; returns without waiting for it.
    ///
    /// # Safety
    /// `args` match the kernel's parameters in number, order and type; every pointer argument is
    /// device memory of the module's context holding everything the kernel reads or writes
    /// through it (for the grid launched), allocated until the kernel has completed and not used
    /// by other work that is not ordered with `stream`; `stream` holds a live stream of that
    /// context ([`Stream::from_raw`]).
    pub unsafe fn launch(&self, config: LaunchConfig, stream: Stream, args: &[Arg]) -> Result<()> {
        let (g, b) = (config.grid, config.block);
        if [g.0, g.1, g.2, b.0, b.1, b.2].contains(&0) {
            return Err(CudaError::InvalidArgument(format!(
                "kernel {:?}: grid {g:?} and block {b:?} need every dimension at least 1",
                self.name
            )));
        }
        let mut slots: Vec<ArgSlot> = args.iter().map(|a| a.slot()).collect();
        let mut params: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| s as *mut ArgSlot as *mut c_void)
            .collect();
        let _ctx = bind_context(self.module.0.ordinal)?;
        // SAFETY: the function belongs to a module loaded in the current context and kept loaded
        // by `self`; `params` holds one pointer per argument into `slots`, both alive for the call
        // (the driver copies the values before it returns); the caller upholds the contract on
        // what the arguments point to and on the stream.
        let code = unsafe {
            sys::cuLaunchKernel(
                self.function as sys::CUfunction,
                g.0,
                g.1,
                g.2,
                b.0,
                b.1,
                b.2,
                config.shared_mem_bytes,
                stream.raw(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        check(
            code,
            "cuLaunchKernel",
            &format!(
                "launching kernel {:?} on grid {g:?}, block {b:?} with {} arguments",
                self.name,
                args.len()
            ),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ADD_ONE: &str = r#"
extern "C" __global__ void add_one(unsigned char* x, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1;
}
"#;

    #[test]
    fn without_nvrtc_or_a_driver_kernels_are_a_clear_not_available_error() {
        match nvrtc_version() {
            Ok(_) => {
                // NVRTC is here: the source compiles, and a broken one reports NVRTC's log
                let ptx = compile_ptx(ADD_ONE, &[]).unwrap();
                assert!(ptx.contains(".entry add_one"), "{ptx}");
                let err = compile_ptx("__global__ void f() { nope; }", &[]).unwrap_err();
                assert!(matches!(err, CudaError::Compile(_)), "{err}");
                assert!(err.to_string().contains("nope"), "{err}");
            }
            Err(e) => {
                assert!(matches!(e, CudaError::NotAvailable(_)), "{e}");
                assert!(e.to_string().contains("NVRTC"), "{e}");
                assert!(nvrtc_unavailable_reason().is_some());
                let err = compile_ptx(ADD_ONE, &[]).unwrap_err();
                assert!(matches!(err, CudaError::NotAvailable(_)), "{err}");
            }
        }
        if init().is_err() {
            let err = Module::compile(0, ADD_ONE, &[]).unwrap_err();
            assert!(matches!(err, CudaError::NotAvailable(_)), "{err}");
            let err = Module::load_ptx(0, "// no driver").unwrap_err();
            assert!(err.to_string().contains("CUDA is not available"), "{err}");
        }
    }

    #[test]
    fn sources_and_options_with_nul_bytes_are_refused() {
        if nvrtc_version().is_err() {
            return; // NotAvailable comes first (tested above)
        }
        let err = compile_ptx("a\0b", &[]).unwrap_err();
        assert!(matches!(err, CudaError::InvalidArgument(_)), "{err}");
        let err = compile_ptx(ADD_ONE, &["-x\0".into()]).unwrap_err();
        assert!(matches!(err, CudaError::InvalidArgument(_)), "{err}");
    }

    /// Runs on a machine with a GPU and NVRTC; elsewhere it checks nothing more than the test above.
    #[test]
    fn a_kernel_compiled_at_run_time_adds_one_on_the_gpu() {
        if init().is_err() || crate::device_count().unwrap_or(0) == 0 || nvrtc_version().is_err() {
            return;
        }
        let module = Module::compile(0, ADD_ONE, &[]).unwrap();
        let kernel = module.kernel("add_one").unwrap();
        let err = module.kernel("missing").unwrap_err();
        assert!(err.to_string().contains("extern \"C\""), "{err}");
        let n = 1000usize;
        let host: Vec<u8> = (0..n).map(|i| (i % 255) as u8).collect();
        let _ctx = bind_context(0).unwrap();
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointer; the primary context is current.
        check(
            unsafe { sys::cuMemAlloc_v2(&mut dev, n) },
            "cuMemAlloc",
            "test",
        )
        .unwrap();
        // SAFETY: `host` is `n` live bytes, `dev` `n` device bytes.
        check(
            unsafe { sys::cuMemcpyHtoD_v2(dev, host.as_ptr() as *const c_void, n) },
            "cuMemcpyHtoD",
            "test",
        )
        .unwrap();
        let config = LaunchConfig {
            grid: (n.div_ceil(256) as u32, 1, 1),
            block: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `add_one(unsigned char*, unsigned long long)` gets a device pointer to `n` bytes
        // and `n`; the default stream is synchronised (cuMemcpyDtoH) before the memory is freed.
        unsafe {
            kernel.launch(
                config,
                Stream::DEFAULT,
                &[Arg::Ptr(dev), Arg::U64(n as u64)],
            )
        }
        .unwrap();
        let mut back = vec![0u8; n];
        // SAFETY: `back` holds `n` writable bytes; the synchronous copy follows the kernel on the
        // legacy default stream.
        check(
            unsafe { sys::cuMemcpyDtoH_v2(back.as_mut_ptr() as *mut c_void, dev, n) },
            "cuMemcpyDtoH",
            "test",
        )
        .unwrap();
        // SAFETY: allocated above, freed once, no work left on it.
        check(unsafe { sys::cuMemFree_v2(dev) }, "cuMemFree", "test").unwrap();
        let want: Vec<u8> = host.iter().map(|&b| b + 1).collect();
        assert_eq!(back, want);
        // an empty grid is refused before the driver sees it
        let empty = LaunchConfig {
            grid: (0, 1, 1),
            ..config
        };
        // SAFETY: refused before any launch.
        let err = unsafe { kernel.launch(empty, Stream::DEFAULT, &[]) }.unwrap_err();
        assert!(matches!(err, CudaError::InvalidArgument(_)), "{err}");
    }
}

use thiserror::Error;

/// Errors of the CUDA layer. Cloneable so a failed driver load can be cached and reported again.
#[derive(Debug, Clone, Error)]
pub enum CudaError {
    /// No usable CUDA driver: the library is missing, lacks a symbol, or `cuInit` failed.
    #[error("CUDA is not available: {0}")]
    NotAvailable(String),
    /// A driver call returned an error code.
    #[error("CUDA driver call {call} failed with {code} ({context})")]
    Driver {
        call: &'static str,
        code: String,
        context: String,
    },
    /// Out of page-locked or device memory while setting up.
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    /// A caller passed an argument the layer cannot use.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Reading weights from a file failed (missing, truncated or unreadable while offloaded).
    #[error("reading weights from disk failed: {0}")]
    Read(String),
    /// The background staging thread stopped.
    #[error("staging thread failed: {0}")]
    Staging(String),
    /// A kernel did not compile (NVRTC's log) or its PTX could not be loaded.
    #[error("compiling a CUDA kernel failed: {0}")]
    Compile(String),
    /// An error met where it could not be returned (in `Drop`, at a thread's shutdown), returned by
    /// the next fallible call (see [`crate::ErrorSlot`]).
    #[error(
        "an earlier clean-up failed and could not be reported then: {0}; the CUDA context may be \
         unusable (restart the process if later calls fail too)"
    )]
    Deferred(String),
}

pub type Result<T> = std::result::Result<T, CudaError>;

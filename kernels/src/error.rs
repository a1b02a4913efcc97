//! The crate's one error type: every fallible kernel, pool, store or device call returns it.

use std::path::PathBuf;

/// Everything that can go wrong in `troupe-kernels`, named so the caller can act on it.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// Tensor shapes do not fit the operation.
    #[error("shape mismatch in {op}: {detail}")]
    Shape {
        /// The operation that checked the shapes.
        op: &'static str,
        /// What did not fit.
        detail: String,
    },
    /// An argument is out of its valid range (not a shape problem).
    #[error("invalid argument to {op}: {detail}")]
    InvalidArgument {
        /// The operation that rejected the argument.
        op: &'static str,
        /// What was wrong.
        detail: String,
    },
    /// No usable CUDA device: no driver library, no device, or a missing CUDA library.
    #[error("CUDA unavailable: {0}")]
    CudaUnavailable(String),
    /// A CUDA driver, cuBLAS or NVRTC call failed on a device that exists.
    #[error("CUDA error in {context}: {detail}")]
    Cuda {
        /// What we were doing.
        context: &'static str,
        /// The library's own description.
        detail: String,
    },
    /// The op has no implementation for this device.
    #[error("op {op} is not implemented on {device}")]
    Unsupported {
        /// The op's name.
        op: &'static str,
        /// The device's name.
        device: String,
    },
    /// A memory pool cannot satisfy an allocation.
    #[error(
        "pool {pool}: cannot allocate {requested} bytes (free {free}, largest free block {largest_free}, budget {budget})"
    )]
    OutOfMemory {
        /// Pool label.
        pool: String,
        /// Bytes asked for (after alignment).
        requested: u64,
        /// Total free bytes.
        free: u64,
        /// Largest contiguous free block.
        largest_free: u64,
        /// The pool's budget.
        budget: u64,
    },
    /// A pool was asked to free something it never handed out (or already freed).
    #[error("pool {pool}: invalid free of offset {offset} len {len}")]
    InvalidFree {
        /// Pool label.
        pool: String,
        /// Offset given.
        offset: u64,
        /// Length given.
        len: u64,
    },
    /// A weight-store tier has no room for a blob.
    #[error("{tier} tier cannot hold blob {blob}: needs {needed} bytes, {available} of {budget} available")]
    TierFull {
        /// Tier name.
        tier: &'static str,
        /// Blob id.
        blob: String,
        /// Bytes needed.
        needed: u64,
        /// Bytes available.
        available: u64,
        /// Tier budget.
        budget: u64,
    },
    /// A blob's bytes do not match the checksum recorded when it was stored.
    #[error("blob {blob} is corrupted ({source_tier}): blake3 {actual} != recorded {expected}")]
    Corrupted {
        /// Blob id.
        blob: String,
        /// Where the bad bytes came from.
        source_tier: &'static str,
        /// Recorded checksum (hex).
        expected: String,
        /// Checksum of the bytes read (hex).
        actual: String,
    },
    /// A blob file on disk is malformed (bad header, wrong length).
    #[error("blob file {path} is malformed: {detail}")]
    BadBlobFile {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// No blob with this id.
    #[error("unknown blob {0}")]
    UnknownBlob(String),
    /// An I/O call failed.
    #[error("I/O error while {context} {path}: {source}")]
    Io {
        /// What we were doing.
        context: &'static str,
        /// The file involved.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// Result with [`KernelError`].
pub type Result<T> = std::result::Result<T, KernelError>;

impl KernelError {
    /// Shorthand for a [`KernelError::Shape`].
    pub fn shape(op: &'static str, detail: impl Into<String>) -> Self {
        Self::Shape { op, detail: detail.into() }
    }

    /// Shorthand for a [`KernelError::InvalidArgument`].
    pub fn invalid(op: &'static str, detail: impl Into<String>) -> Self {
        Self::InvalidArgument { op, detail: detail.into() }
    }

    /// Shorthand for a [`KernelError::Io`].
    pub fn io(context: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io { context, path: path.into(), source }
    }

    /// Shorthand for a [`KernelError::Cuda`] from any displayable library error.
    pub fn cuda(context: &'static str, err: impl std::fmt::Display) -> Self {
        Self::Cuda { context, detail: err.to_string() }
    }
}

//! ONNX executor over ONNX Runtime (the `ort` crate, loaded at run time from `libonnxruntime.so`).
//!
//! - [`runtime`]: finds the library (env `ORT_DYLIB_PATH`, else the one `scripts/setup` recorded in the
//!   cache manifest) and initialises ONNX Runtime once per process, returning an error (never a
//!   panic) when the library is missing or unusable.
//! - [`OnnxSession`]: a session from a file or from bytes, run with named f32/i64 tensors
//!   ([`NamedTensor`]), with its inputs/outputs introspected ([`IoSpec`]) and its resident memory
//!   measured ([`SessionMemory`]); [`check_chain`] checks that stage files fit together.
//! - [`Embedder`] / [`embed`]: sentence embeddings with all-MiniLM-L6-v2.
//! - [`writer`]: writes MLP graphs as ONNX models from Rust (no Python at run time).
//! - [`session_ms_per_mb`]: session creation cost, for `troupe bench kernels`.

mod bench;
mod embed;
mod memory;
mod runtime;
mod session;
mod tensor;
pub mod writer;

use std::path::PathBuf;

pub use bench::session_ms_per_mb;
pub use embed::{Embedder, cosine, embed};
pub use memory::{peak_resident_bytes, resident_bytes};
pub use runtime::{LibrarySource, ORT_DYLIB_ENV, library_path, runtime};
pub use session::{IoSpec, OnnxSession, SessionConfig, SessionMemory, check_chain};
pub use tensor::{ElementType, NamedTensor, TensorData};

use crate::assets::{AssetError, SETUP_HINT};
use crate::tokenizer::TokenizerError;

/// What went wrong loading ONNX Runtime, a model, or running one. Each variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum OnnxError {
    /// The ONNX Runtime shared library is not at the configured path.
    #[error(
        "ONNX Runtime library {path} ({source_kind}) does not exist; {SETUP_HINT} or set ORT_DYLIB_PATH to libonnxruntime.so"
    )]
    LibraryMissing {
        /// Where it was expected.
        path: PathBuf,
        /// Where that path came from.
        source_kind: LibrarySource,
    },
    /// No library path is configured: `ORT_DYLIB_PATH` is unset and the setup cache was not found.
    #[error(
        "no ONNX Runtime library configured ({detail}); {SETUP_HINT} or set ORT_DYLIB_PATH to libonnxruntime.so"
    )]
    LibraryNotConfigured {
        /// Why the cache could not provide one.
        detail: String,
    },
    /// The library exists but could not be loaded or initialised (wrong file, wrong version, ...).
    #[error("ONNX Runtime library {path} could not be initialised: {detail}")]
    LibraryLoad {
        /// The library file.
        path: PathBuf,
        /// ONNX Runtime's or the loader's message.
        detail: String,
    },
    /// The model file does not exist.
    #[error("model file {path} does not exist")]
    ModelMissing {
        /// The missing file.
        path: PathBuf,
    },
    /// The model file or bytes are not a valid ONNX model.
    #[error("model {origin} is not a valid ONNX model: {detail}")]
    ModelMalformed {
        /// The file path, or the label given to bytes.
        origin: String,
        /// ONNX Runtime's message.
        detail: String,
    },
    /// Creating the session failed for another reason (options, resources).
    #[error("model {origin}: session creation failed: {detail}")]
    Session {
        /// The file path, or the label given to bytes.
        origin: String,
        /// ONNX Runtime's message.
        detail: String,
    },
    /// The inputs given do not match the model's inputs.
    #[error("model {origin}: bad inputs: {detail}")]
    Input {
        /// The model.
        origin: String,
        /// Which input and what is wrong.
        detail: String,
    },
    /// ONNX Runtime failed while running the model.
    #[error("model {origin}: run failed: {detail}")]
    Run {
        /// The model.
        origin: String,
        /// ONNX Runtime's message.
        detail: String,
    },
    /// An output has an element type this executor does not carry (only f32 and i64).
    #[error("model {origin}: output {name} has unsupported type {dtype}")]
    Output {
        /// The model.
        origin: String,
        /// The output.
        name: String,
        /// Its type as ONNX Runtime reports it.
        dtype: String,
    },
    /// Stage files do not fit together.
    #[error("stage chain: {detail}")]
    Chain {
        /// Which stage input is not provided, or provided with the wrong type.
        detail: String,
    },
    /// A file from the setup cache is missing or changed.
    #[error(transparent)]
    Assets(#[from] AssetError),
    /// The tokenizer could not be built.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// Reading a model file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}

//! Finding `libonnxruntime.so` and initialising ONNX Runtime once per process.
//!
//! `ort` (feature `load-dynamic`) panics inside `EnvironmentBuilder::build` when no library can be
//! loaded, so the path is resolved and checked here first, loaded with `ort::init_from` (which
//! returns errors for a wrong file or version), and the whole initialisation runs under
//! `catch_unwind`. The outcome, success or failure, is kept for the life of the process: ONNX
//! Runtime can be loaded only once.

use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::OnceLock;

use ort::environment::Environment;

use super::OnnxError;
use crate::assets::Assets;

/// Env var naming the library explicitly (the same one `ort` itself honours).
pub const ORT_DYLIB_ENV: &str = "ORT_DYLIB_PATH";

/// Env var that keeps ONNX Runtime's telemetry from starting (on Linux since 1.25: an uploader
/// thread, an offline SQLite cache under `~/.cache/Microsoft` and ~3 MB of RSS per process). It
/// must be set before the library loads; the API switch only suppresses events.
pub const TELEMETRY_OPT_OUT_ENV: &str = "ORT_DISABLE_TELEMETRY";

/// Opts this process out of ONNX Runtime's telemetry (sets [`TELEMETRY_OPT_OUT_ENV`] to `1`)
/// unless the variable is already set, so an operator may still opt in with `0`. An edge node
/// sends nothing unasked, and a phone-weight worker has no room for an uploader.
///
/// # Safety
/// It sets an environment variable: call it first thing in `main`, before any other thread exists.
pub unsafe fn opt_out_of_telemetry() {
    if std::env::var_os(TELEMETRY_OPT_OUT_ENV).is_none() {
        // SAFETY: the caller guarantees no other thread runs, so nothing reads the environment
        // concurrently.
        unsafe { std::env::set_var(TELEMETRY_OPT_OUT_ENV, "1") };
    }
}

/// Where the library path came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LibrarySource {
    /// The `ORT_DYLIB_PATH` env var.
    Env,
    /// The setup cache manifest (`.cache/manifest.json`, `ort_library`).
    Cache,
}

impl fmt::Display for LibrarySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Env => "from ORT_DYLIB_PATH",
            Self::Cache => "recorded by scripts/setup",
        })
    }
}

/// Resolves the library path: `ORT_DYLIB_PATH` if set and non-empty, else the path in the setup
/// cache's manifest. Does not check that the file exists.
pub fn library_path() -> Result<(PathBuf, LibrarySource), OnnxError> {
    if let Some(p) = std::env::var_os(ORT_DYLIB_ENV).filter(|p| !p.is_empty()) {
        return Ok((PathBuf::from(p), LibrarySource::Env));
    }
    let assets = Assets::locate().map_err(|e| OnnxError::LibraryNotConfigured {
        detail: format!("{ORT_DYLIB_ENV} is unset and {e}"),
    })?;
    match assets.ort_library() {
        Ok(path) => Ok((path, LibrarySource::Cache)),
        Err(crate::assets::AssetError::Missing { path }) => {
            Err(OnnxError::LibraryMissing { path, source_kind: LibrarySource::Cache })
        }
        Err(e) => Err(OnnxError::LibraryNotConfigured { detail: e.to_string() }),
    }
}

/// A failed initialisation, kept so every later call reports the same problem.
#[derive(Debug, Clone)]
enum InitFailure {
    NotConfigured(String),
    Missing(PathBuf, LibrarySource),
    Load(PathBuf, String),
}

impl From<InitFailure> for OnnxError {
    fn from(f: InitFailure) -> Self {
        match f {
            InitFailure::NotConfigured(detail) => OnnxError::LibraryNotConfigured { detail },
            InitFailure::Missing(path, source_kind) => OnnxError::LibraryMissing { path, source_kind },
            InitFailure::Load(path, detail) => OnnxError::LibraryLoad { path, detail },
        }
    }
}

static RUNTIME: OnceLock<Result<Environment, InitFailure>> = OnceLock::new();

/// The process-wide ONNX Runtime environment, initialised on first use.
pub fn runtime() -> Result<&'static Environment, OnnxError> {
    RUNTIME.get_or_init(init).as_ref().map_err(|f| f.clone().into())
}

fn init() -> Result<Environment, InitFailure> {
    let (path, source) = library_path().map_err(|e| match e {
        OnnxError::LibraryMissing { path, source_kind } => InitFailure::Missing(path, source_kind),
        other => InitFailure::NotConfigured(other.to_string()),
    })?;
    if !path.is_file() {
        return Err(InitFailure::Missing(path, source));
    }
    let attempt = catch_unwind(AssertUnwindSafe(|| {
        ort::init_from(&path)
            .map_err(|e| e.to_string())?
            .with_name("troupe")
            // Microsoft's builds turn telemetry on by default: events off here too, for processes
            // that did not call `opt_out_of_telemetry`
            .with_telemetry(false)
            .build()
            .map_err(|e| e.to_string())
    }));
    match attempt {
        Ok(Ok(env)) => Ok(env),
        Ok(Err(detail)) => Err(InitFailure::Load(path, detail)),
        Err(panic) => {
            let detail = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_else(|| "panicked during initialisation".to_owned());
            Err(InitFailure::Load(path, detail))
        }
    }
}

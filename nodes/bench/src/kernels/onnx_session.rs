//! Session creation cost per model size, for `troupe bench kernels`.

use std::path::Path;
use std::time::Instant;

use super::OnnxError;
use super::session::{OnnxSession, SessionConfig};

/// Session creations timed per call.
const REPEATS: usize = 5;

/// Median wall time of 5 session creations from `path`, in milliseconds per MB of model
/// file (MB = 10^6 bytes). The file is read from the page cache after the first creation, so this
/// measures parsing and graph preparation, not disk reads. Runtime initialisation is excluded.
pub fn session_ms_per_mb(path: &Path) -> Result<f64, OnnxError> {
    let bytes = std::fs::metadata(path)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => OnnxError::ModelMissing { path: path.to_path_buf() },
            _ => OnnxError::Io { path: path.to_path_buf(), source: e },
        })?
        .len();
    super::runtime::runtime()?;
    let config = SessionConfig::default();
    let mut times = Vec::with_capacity(REPEATS);
    for _ in 0..REPEATS {
        let start = Instant::now();
        let session = OnnxSession::from_file(path, &config)?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
        drop(session);
    }
    times.sort_by(f64::total_cmp);
    let mb = (bytes as f64 / 1e6).max(1e-6);
    Ok(times[REPEATS / 2] / mb)
}

//! Session creation cost per model size, for `troupe bench kernels`.

use std::path::Path;
use std::time::Instant;

use troupe_kernels::onnx::{OnnxError, OnnxSession, SessionConfig};

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
    troupe_kernels::onnx::runtime()?;
    let config = SessionConfig::default();
    let mut times = Vec::with_capacity(REPEATS);
    for _ in 0..REPEATS {
        let start = Instant::now();
        let session = OnnxSession::from_file(path, &config)?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
        drop(session);
    }
    let mb = (bytes as f64 / 1e6).max(1e-6);
    Ok(troupe_policy::stats::median(&mut times) / mb)
}

#[cfg(test)]
mod tests {
    use troupe_kernels::assets::{self, Assets};

    /// Needs `scripts/setup`.
    #[test]
    fn session_creation_benchmark_reports_a_cost() {
        let a = Assets::locate().unwrap_or_else(|e| panic!("{e}"));
        let models = [
            assets::MINILM_WHOLE,
            assets::MINILM_STAGES[0],
            assets::MINILM_STAGES[1],
            assets::MINILM_STAGES[2],
            assets::TINY_MLP,
        ];
        for name in models {
            let ms = super::session_ms_per_mb(&a.path(name).unwrap()).unwrap();
            println!("{name}: {ms:.2} ms per MB");
            assert!(ms.is_finite() && ms > 0.0, "{name}: {ms}");
        }
    }
}

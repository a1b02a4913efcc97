//! Helpers for the pipeline tests: sentences, the whole-model reference, settings.
//!
//! Each cluster test lives in its own test file (its own process): ractor's registry and process
//! groups are process-wide, so two foremen in one process would see each other's workers.

use std::time::Duration;

use troupe::actors::pipeline::{JobOutcome, ShellSettings};
use troupe::kernels::onnx::{NamedTensor, OnnxSession, SessionConfig};
use troupe::workloads::pipeline::{final_vector, tokenize};

/// A handful of real sentences (CI budget: seconds).
pub const SENTENCES: [&str; 5] = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome.",
    "Each phone keeps only one stage of the model in memory at a time.",
    "A monkey is playing drums.",
];

/// [`SENTENCES`] as owned strings.
pub fn sentences() -> Vec<String> {
    SENTENCES.iter().map(|s| s.to_string()).collect()
}

/// A fresh temporary folder for one test, removed when dropped (also when the test fails).
pub struct WorkDir(tempfile::TempDir);

impl std::ops::Deref for WorkDir {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        self.0.path()
    }
}

impl AsRef<std::path::Path> for WorkDir {
    fn as_ref(&self) -> &std::path::Path {
        self.0.path()
    }
}

/// A fresh temporary folder for one test. With `TROUPE_KEEP_WORKDIR` set, a failed test leaves
/// it behind (the workers' logs, `NAME.log`: for a failure seen only under load).
pub fn workdir(name: &str) -> WorkDir {
    let d = tempfile::Builder::new()
        .prefix(&format!("troupe-pipeline-{name}-"))
        .disable_cleanup(std::env::var_os("TROUPE_KEEP_WORKDIR").is_some())
        .tempdir()
        .expect("a temporary folder for the test");
    WorkDir(d)
}

/// The whole model's embedding of each sentence, run here.
pub fn whole_model(sentences: &[String]) -> Vec<Vec<f32>> {
    let assets = troupe::kernels::assets::Assets::locate().expect("reference model from the setup cache");
    let path =
        assets.path(troupe::kernels::assets::MINILM_WHOLE).expect("reference model from the setup cache");
    let mut session = OnnxSession::from_file(&path, &SessionConfig::default())
        .expect("reference model from the setup cache");
    tokenize(sentences)
        .expect("reference model from the setup cache")
        .into_iter()
        .map(|inputs| {
            let out: Vec<NamedTensor> = session.run(&inputs).expect("reference model from the setup cache");
            out.iter()
                .find(|t| t.name == "sentence_embedding")
                .expect("reference model from the setup cache")
                .as_f32()
                .expect("reference model from the setup cache")
                .to_vec()
        })
        .collect()
}

/// The whole model's `sentence_embedding` for one prepared input (any batch size), flattened.
pub fn whole_model_on(input: &[NamedTensor]) -> Vec<f32> {
    let assets = troupe::kernels::assets::Assets::locate().expect("setup cache");
    let path = assets.path(troupe::kernels::assets::MINILM_WHOLE).expect("whole model in the setup cache");
    let mut session = OnnxSession::from_file(&path, &SessionConfig::default()).expect("whole model loads");
    let out = session.run(input).expect("whole model runs");
    out.into_iter()
        .find(|t| t.name == "sentence_embedding")
        .and_then(|t| t.as_f32().map(<[f32]>::to_vec))
        .expect("whole model has a sentence_embedding output")
}

/// Largest absolute difference between the job's final vectors and the reference.
pub fn max_abs_error(outcome: &JobOutcome, whole: &[Vec<f32>]) -> f32 {
    assert_eq!(outcome.outputs.len(), whole.len());
    let mut worst = 0.0f32;
    for (i, w) in whole.iter().enumerate() {
        let got = final_vector(&outcome.outputs[i]).unwrap_or_else(|| panic!("input {i} has no output"));
        assert_eq!(got.len(), w.len(), "input {i}");
        for (a, b) in got.iter().zip(w) {
            worst = worst.max((a - b).abs());
        }
    }
    worst
}

/// Foreman settings for tests: generous deadlines.
pub fn settings(workers: usize) -> ShellSettings {
    ShellSettings {
        workers,
        join_timeout: Duration::from_secs(60),
        telemetry_period: Duration::from_millis(200),
        ..ShellSettings::default()
    }
}

/// Awaits `f` with a generous deadline, naming what did not finish.
pub async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(120), f)
        .await
        .unwrap_or_else(|_| panic!("{what}: no result within 120 s"))
}

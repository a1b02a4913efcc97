//! The budget contrast: in the same cgroup memory limit (120 MiB: below the whole MiniLM
//! model's, above one memory-mapped stage's), the whole model loaded and run in a real process is
//! killed by the OS, while a pipeline worker process running every stage of a K = 3 split (cut by
//! the Rust splitter) completes the job with the whole model's outputs.

use std::os::unix::process::ExitStatusExt;

use troupe::kernels::assets::{Assets, MINILM_WHOLE};
use troupe::kernels::onnx::split::{CutPlan, Limits};
use troupe::policy::pipeline::Mode;
use troupe::workloads::pipeline::local::{LocalCluster, WorkerSpec};
use troupe::workloads::pipeline::{load_job, split_to_dir};
use troupe_tests::pipeline::{max_abs_error, sentences, settings, whole_model, within, workdir};

const LIMIT_MB: u64 = 120;

fn exe() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_BIN_EXE_troupe-node"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_whole_model_is_killed_in_a_limit_a_stage_worker_completes_in() {
    // Without the controller nothing is enforced and the contrast proves nothing: fail, saying why.
    let controller = troupe::actors::pipeline::telemetry::memory_controller().unwrap_or_else(|why| {
        panic!("{why}: the memory limit cannot be enforced and this test cannot run (it needs root and a cgroup v2 or v1 memory controller)")
    });
    let dir = workdir("memory-split");
    let whole = Assets::locate().unwrap().path(MINILM_WHOLE).unwrap();

    // The whole model, in a fresh process inside the limit: the OS kills it (SIGKILL).
    let status = std::process::Command::new(exe())
        .args(["pipeline", "probe-rss", "--model"])
        .arg(&whole)
        .args(["--memory-limit-mb", &LIMIT_MB.to_string()])
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert_eq!(
        status.signal(),
        Some(libc::SIGKILL),
        "the whole model in a {LIMIT_MB} MiB memory cgroup was expected to be OOM-killed: {status}"
    );

    // The same model cut into 3 stages, all run by one worker process in the same limit.
    let split =
        split_to_dir(&whole, &CutPlan::Balanced { stages: 3 }, &dir.join("split"), &Limits::default())
            .unwrap();
    let job = load_job(&split.stages, &sentences(), Mode::Streaming, false).unwrap();
    let mut spec = WorkerSpec::new("worker-1", 100, &dir);
    spec.ram_budget_mb = LIMIT_MB;
    spec.enforce_ram_budget = true;
    let cluster = LocalCluster::start(&exe(), &dir, std::slice::from_ref(&spec)).await.unwrap();
    let outcome = within("job in a memory limit", cluster.run(job, settings(1), None)).await;
    cluster.shutdown().await;
    let log = std::fs::read_to_string(dir.join(format!("{}.log", spec.name))).unwrap_or_default();
    let tail: Vec<&str> = log.lines().rev().take(8).collect();
    let outcome = outcome.unwrap_or_else(|e| panic!("{e}; worker log tail (newest first): {tail:#?}"));
    let w = outcome.workers.iter().find(|w| w.node == spec.name).unwrap();
    assert!(w.straggler.contains(&format!("{controller} memory limit {LIMIT_MB} MiB")), "{}", w.straggler);
    assert!(!w.lost, "the worker was lost in its {LIMIT_MB} MiB limit: {:?}", outcome.log);
    let err = max_abs_error(&outcome, &whole_model(&sentences()));
    assert!(err <= 1e-5, "max abs error {err}");
}

//! A real RAM budget: a worker whose cgroup memory limit is below what stage 0 really needs
//! (the foreman's estimate says it fits) is killed by the OS when it loads it; the foreman
//! re-plans its task and the job still completes with the whole model's outputs.

use troupe::kernels::assets::{Assets, MINILM_WHOLE};
use troupe::kernels::onnx::split::{CutPlan, Limits};
use troupe::policy::pipeline::Mode;
use troupe::workloads::pipeline::local::{LocalCluster, WorkerSpec};
use troupe::workloads::pipeline::{load_job, split_to_dir};
use troupe_tests::pipeline::{max_abs_error, sentences, settings, whole_model, within, workdir};

fn exe() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_BIN_EXE_troupe-node"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "since a worker holds one copy of a pulled stage (2026-12-06), stage 0's real peak (~119 MiB in debug) is within 1-4 MiB of the foreman's estimate (1.5 x 69 MB + 16 MiB), so no budget both passes the estimate and is surely exceeded; to be staged again with an estimate override"]
async fn a_worker_over_its_enforced_budget_is_killed_and_its_task_moves() {
    // Without the controller the budget cannot be enforced and this test would prove nothing:
    // fail with the reason rather than pass without running.
    let controller = troupe::actors::pipeline::telemetry::memory_controller().unwrap_or_else(|why| {
        panic!("{why}: a RAM budget cannot be enforced and this test cannot run (it needs root and a cgroup v2 or v1 memory controller; skip it explicitly with `--skip a_worker_over_its_enforced_budget` on such hosts)")
    });
    let dir = workdir("budget");
    // Cut at hidden_2, hidden_5 (embeddings + layers 0-2 in stage 0) rather than setup's balanced
    // stages: no balanced stage needs more than its estimate once mapped (their anonymous memory
    // fits; the mapped weights are file pages the cgroup reclaims), so none would be killed.
    let whole = Assets::locate().unwrap().path(MINILM_WHOLE).unwrap();
    let plan = CutPlan::At(vec!["hidden_2".into(), "hidden_5".into()]);
    let cut = split_to_dir(&whole, &plan, &dir.join("stages"), &Limits::default()).unwrap();
    let job = load_job(&cut.stages, &sentences(), Mode::Streaming, false).unwrap();
    let mut specs: Vec<WorkerSpec> =
        (1..=3).map(|i| WorkerSpec::new(&format!("worker-{i}"), 100, &dir)).collect();
    // The foreman estimates stage 0 (69 MB file) at 1.5 x 69 + 16 MB = 119 MB: it fits 125 MiB on
    // paper; the real session needs about 150 MiB.
    specs[1].ram_budget_mb = 125;
    specs[1].enforce_ram_budget = true;
    let victim = specs[1].name.clone();
    let cluster = LocalCluster::start(&exe(), &dir, &specs).await.unwrap();
    let outcome = within("job with a budget", cluster.run(job, settings(3), None)).await;
    cluster.shutdown().await;
    let outcome = outcome.unwrap();
    for line in &outcome.log {
        eprintln!("{line}");
    }
    let w = outcome.workers.iter().find(|w| w.node == victim).unwrap();
    assert!(w.straggler.contains(&format!("{controller} memory limit 125 MiB")), "{}", w.straggler);
    assert!(w.lost, "{victim} went over its enforced budget but was not lost");
    assert!(outcome.moves.iter().any(|m| m.contains(&format!("from {victim}"))), "{:?}", outcome.moves);
    let err = max_abs_error(&outcome, &whole_model(&sentences()));
    assert!(err <= 1e-5, "max abs error {err}");
    let log = std::fs::read_to_string(dir.join(format!("{victim}.log"))).unwrap_or_default();
    eprintln!("{victim} log tail: {}", log.lines().rev().take(3).collect::<Vec<_>>().join(" | "));
    let _ = std::fs::remove_dir_all(&dir);
}

//! Pipeline over real processes: a foreman in the test process, 3 workers as `troupe node`
//! processes on loopback, MiniLM in 3 stages on ONNX Runtime; outputs vs the whole model.

use troupe::policy::pipeline::Mode;
use troupe::workloads::pipeline::local::{LocalCluster, WorkerSpec};
use troupe::workloads::pipeline::{load_job, minilm_stages};
use troupe_tests::pipeline::{SENTENCES, max_abs_error, sentences, settings, whole_model, within, workdir};

fn exe() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_BIN_EXE_troupe-node"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chained_outputs_equal_the_whole_model_and_workers_never_hold_two_sessions() {
    let dir = workdir("chain");
    let job = load_job(&minilm_stages().unwrap(), &sentences(), Mode::Streaming, false).unwrap();
    let specs: Vec<WorkerSpec> =
        (1..=3).map(|i| WorkerSpec::new(&format!("worker-{i}"), 100, &dir)).collect();
    let cluster = LocalCluster::start(&exe(), &dir, &specs).await.unwrap();
    let outcome = within("streaming job", cluster.run(job, settings(3), None)).await;
    cluster.shutdown().await;
    let outcome = outcome.unwrap();
    let err = max_abs_error(&outcome, &whole_model(&sentences()));
    assert!(err <= 1e-5, "chained vs whole model: max abs error {err}");
    // Residency, from each worker's own report: never two live sessions at once.
    assert_eq!(outcome.workers.len(), 3);
    let mut loads = 0;
    for w in &outcome.workers {
        let stats = w.stats.unwrap_or_else(|| panic!("{} sent no final report", w.node));
        assert!(
            stats.max_live_sessions <= 1,
            "{}: {} sessions live at once",
            w.node,
            stats.max_live_sessions
        );
        assert_eq!(
            stats.refused_loads, 0,
            "{}: the foreman asked for a load while a session was live",
            w.node
        );
        loads += stats.loads;
    }
    // 3 stages need at least 3 loads; every task ran once.
    assert!(loads >= 3, "{loads} loads");
    assert_eq!(outcome.workers.iter().map(|w| w.tasks).sum::<usize>(), SENTENCES.len() * 3);
    let _ = std::fs::remove_dir_all(&dir);
}

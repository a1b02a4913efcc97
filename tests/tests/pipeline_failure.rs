//! Pipeline failure: `kill -9` of a worker process mid-job; its tasks move, the job completes and
//! the outputs equal the whole model's.

use troupe::actors::pipeline::Progress;
use troupe::policy::pipeline::Mode;
use troupe::workloads::pipeline::local::{LocalCluster, WorkerSpec};
use troupe::workloads::pipeline::{load_job, minilm_stages};
use troupe_tests::pipeline::{max_abs_error, sentences, settings, whole_model, within, workdir};

fn exe() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_BIN_EXE_troupe-node"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_killed_mid_job_has_its_tasks_moved_and_outputs_match() {
    let dir = workdir("kill");
    let job = load_job(&minilm_stages().unwrap(), &sentences(), Mode::Streaming, false).unwrap();
    // The victim runs at 20% of a CPU (a real cgroup quota here, pacing elsewhere) so it still
    // holds its task when the kill lands.
    let mut specs: Vec<WorkerSpec> =
        (1..=3).map(|i| WorkerSpec::new(&format!("worker-{i}"), 100, &dir)).collect();
    specs[1].cpu_quota_pct = 20;
    let victim = specs[1].name.clone();
    let cluster = LocalCluster::start(&exe(), &dir, &specs).await.unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let outcome = {
        let run = cluster.run(job, settings(3), Some(tx));
        tokio::pin!(run);
        let mut killed = false;
        within("job with a kill", async {
            loop {
                tokio::select! {
                    r = &mut run => break r,
                    Some(p) = rx.recv(), if !killed => {
                        // Mid-job: at the first completed task, or when the victim is given a
                        // task, whichever comes first. Either way the victim holds a task then:
                        // every worker claims a stage-0 task at the start, and the victim, at a
                        // fifth of the speed, is still pulling or loading stage 0 when the first
                        // task anywhere completes.
                        let now = match &p {
                            Progress::Done { task } => Some(format!("after {task} completed")),
                            Progress::Assigned { node, task } if *node == victim => {
                                Some(format!("as it was given {task}"))
                            }
                            Progress::Assigned { .. } | Progress::Lost { .. } | Progress::Rejoined { .. } => None,
                        };
                        if let Some(when) = now {
                            eprintln!("killing {victim} with SIGKILL {when}");
                            cluster.kill9(&victim).unwrap();
                            killed = true;
                        }
                    }
                }
            }
        })
        .await
    };
    cluster.shutdown().await;
    let outcome = outcome.unwrap();
    for line in &outcome.log {
        eprintln!("{line}");
    }
    let lost = outcome.workers.iter().find(|w| w.node == victim).unwrap();
    assert!(lost.lost, "the killed worker was not declared lost");
    assert!(
        outcome.moves.iter().any(|m| m.contains(&format!("from {victim}"))),
        "no task moved from {victim}: {:?}",
        outcome.moves
    );
    let err = max_abs_error(&outcome, &whole_model(&sentences()));
    assert!(err <= 1e-5, "after the kill: max abs error {err}");
    let _ = std::fs::remove_dir_all(&dir);
}

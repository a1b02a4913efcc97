//! Pipeline restoration: a worker killed with `kill -9` mid-job and started again under its name
//! is put back in service within the same job and runs tasks again; the outputs equal the whole
//! model's. Twice: first started again once membership declared it lost; then killed again once
//! back and started again at once, before the failure detector's timeout, so no member-down
//! comes: the foreman notices the new incarnation by the pid its telemetry answers with and
//! gives up the calls out to the dead one (otherwise it would wait out its 60 s call timeout,
//! past the job's end). A loss before the kill is not the kill's: on a loaded box a worker
//! whose process stalls past the membership timeout (seen: 3.5 s while the first stages load)
//! is declared lost and comes back by itself; starting it again then would find its port held.
//! (Its own test binary: the foreman node runs in the test process.)

use troupe::actors::pipeline::Progress;
use troupe::policy::pipeline::Mode;
use troupe::workloads::pipeline::local::{LocalCluster, WorkerSpec};
use troupe::workloads::pipeline::{load_job, minilm_stages};
use troupe_tests::pipeline::{max_abs_error, sentences, settings, whole_model, within, workdir};

/// Whether `line` is the job log's per-input completion line (`[ t s] input N done`).
fn is_input_done(line: &str) -> bool {
    line.split_once("] input ").is_some_and(|(_, rest)| rest.ends_with(" done"))
}

fn exe() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_BIN_EXE_troupe-node"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_killed_and_restarted_mid_job_gets_tasks_again() {
    let dir = workdir("rejoin");
    // a longer job (200 x the test sentences, 1,000 inputs) so work is left when the worker comes
    // back twice: the loss is noticed after the membership timeout, each restart takes a process
    // start and a join (about 2 s of the job here; with 500 inputs a faster machine may have
    // ended the job first: one CI failure whose message was lost)
    let inputs: Vec<String> = (0..200).flat_map(|_| sentences()).collect();
    let job = load_job(&minilm_stages().unwrap(), &inputs, Mode::Streaming, false).unwrap();
    let specs: Vec<WorkerSpec> =
        (1..=3).map(|i| WorkerSpec::new(&format!("worker-{i}"), 100, &dir)).collect();
    let victim = specs[1].name.clone();
    let cluster = LocalCluster::start(&exe(), &dir, &specs).await.unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let outcome = {
        let run = cluster.run(job, settings(3), Some(tx));
        tokio::pin!(run);
        let (mut killed, mut restarted, mut killed_again) = (false, false, false);
        // whether the foreman holds the victim lost now: on a loaded box a stalled worker can be
        // declared lost before the kill (and comes back by itself); only a loss after the kill
        // is the kill's, and a victim already lost when killed gets no second loss
        let mut victim_lost = false;
        within("job with a kill and a restart", async {
            loop {
                tokio::select! {
                    r = &mut run => break r,
                    Some(p) = rx.recv() => match p {
                        Progress::Done { task } if !killed => {
                            eprintln!("killing {victim} with SIGKILL after {task} completed");
                            cluster.kill9(&victim).unwrap();
                            killed = true;
                            if victim_lost {
                                eprintln!("{victim} was already declared lost; starting it again");
                                cluster.restart(&victim).unwrap();
                                restarted = true;
                            }
                        }
                        Progress::Lost { node } if node == victim => {
                            victim_lost = true;
                            if killed && !restarted {
                                eprintln!("{victim} declared lost; starting it again");
                                cluster.restart(&victim).unwrap();
                                restarted = true;
                            } else if !killed {
                                eprintln!("{victim} declared lost before the kill (a stall); not the kill's loss");
                            }
                        }
                        Progress::Rejoined { node } if node == victim && !restarted => {
                            victim_lost = false;
                        }
                        Progress::Rejoined { node } if node == victim && !killed_again => {
                            victim_lost = false;
                            eprintln!("{victim} back in service; killing it again and starting it at once");
                            cluster.kill9(&victim).unwrap();
                            cluster.restart(&victim).unwrap();
                            killed_again = true;
                        }
                        _ => {}
                    }
                }
            }
        })
        .await
    };
    cluster.shutdown().await;
    let outcome = outcome.unwrap();
    // the job's log without its per-task lines (thousands of them would push a failure's message
    // out of a truncated CI log): loads, losses, rejoins, the end
    let events = outcome
        .log
        .iter()
        .filter(|l| !l.contains("] assign ") && !is_input_done(l))
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join("\n");
    let w = outcome.workers.iter().find(|w| w.node == victim).unwrap();
    let victim_log = std::fs::read_to_string(dir.join(format!("{victim}.log"))).unwrap_or_default();
    let victim_tail: String = {
        let lines: Vec<&str> = victim_log.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    };
    assert!(
        w.rejoined >= 2,
        "{victim} was put back in service {} times, not twice; the job's events:\n{events}\n\
         the last lines of its log:\n{victim_tail}",
        w.rejoined
    );
    assert!(!w.lost, "{victim} ended the job lost; the job's events:\n{events}");
    assert!(w.tasks_since_rejoin > 0, "{victim} got no task after it rejoined; the job's events:\n{events}");
    let err = max_abs_error(&outcome, &whole_model(&inputs));
    assert!(err <= 1e-5, "after the kill and restart: max abs error {err}");
    let _ = std::fs::remove_dir_all(&dir);
}

//! The coadapt workload end to end with real node processes over loopback QUIC: an edge and two
//! cameras. Each camera streams digits that turn foggy (or sunlit), notices the drift from its
//! tiny V-MoE's falling confidence, uploads frames; the edge labels them with the teacher,
//! co-adapts both students' experts and projectors in one memory-budgeted pool under the
//! twin-buffer scheduler and sends the parameters back; each camera installs them.
//!
//! Checked from the job's printout (the edge's own reports): every camera's exact match against
//! the teacher on its held-out evaluation window rises by at least [`MIN_GAIN`] (fixed seeds), both
//! tasks completed, and the pool's peak use never exceeded its 16 MiB budget (about two tiny
//! models' adaptation state, 0.4 MB each, plus one step's buffers: 15 MB for 32 images of 64 tokens,
//! attention's `heads * 64^2` probabilities per image and block included). Measured once (debug
//! build, tiny student with attention over 64 tokens): fog 0.8 0.141 -> 0.401, sun 0.6 0.094 -> 0.375
//! (see the kernels' vmoe_adapt test for the same corruptions).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use troupe_tests::ProcCluster;

const EXE: &str = env!("CARGO_BIN_EXE_troupe-node");

/// Stated margin: exact-match gain against the teacher each camera must show.
const MIN_GAIN: f64 = 0.10;

const TOPOLOGY: &str = r#"name = "coadapt-test"
[membership]
heartbeat_ms = 200
timeout_ms = 5000

[transport]
idle_timeout_ms = 30000

[[nodes]]
name = "edge"
actors = [{ kind = "coadapt-edge", params = { memory_mb = 16, scheduler = "twin", target_gain = 0.15, max_epochs = 25, steps_per_epoch = 6 } }]
job = { kind = "coadapt", timeout_s = 900, params = { cameras = 2 } }

[[nodes]]
name = "cam-fog"
actors = [{ kind = "coadapt-camera", params = { seed = 21, drift = ["0 clean 0", "256 fog 0.8"], uploads = 256, eval = 192 } }]

[[nodes]]
name = "cam-sun"
actors = [{ kind = "coadapt-camera", params = { seed = 22, drift = ["0 clean 0", "192 sun 0.6"], uploads = 256, eval = 192 } }]
"#;

/// `(camera, exact before, exact after)` from the job's camera lines.
fn camera_lines(log: &str) -> Vec<(String, f64, f64)> {
    log.lines()
        .filter_map(|l| {
            let rest = &l[l.find("coadapt: camera ")? + "coadapt: camera ".len()..];
            let words: Vec<&str> = rest.split_whitespace().collect();
            let i = words.iter().position(|w| *w == "exact_match_vs_teacher")?;
            Some((words[0].to_string(), words.get(i + 1)?.parse().ok()?, words.get(i + 3)?.parse().ok()?))
        })
        .collect()
}

/// Runs the topology to the end of the edge's job; the edge's log and a dump of every log.
async fn run_to_end(topology: &str) -> (String, String) {
    let mut cluster = ProcCluster::start(EXE.as_ref(), topology).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(900);
    let status = loop {
        if let Some(s) = cluster.exited("edge").unwrap() {
            break s;
        }
        assert!(std::time::Instant::now() < deadline, "job did not end:\n{}", cluster.log("edge"));
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let log = cluster.log("edge");
    let dump =
        format!("edge:\n{log}\ncam-fog:\n{}\ncam-sun:\n{}", cluster.log("cam-fog"), cluster.log("cam-sun"));
    assert!(status.success(), "edge job failed: {status}\n{dump}");
    (log, dump)
}

/// Every camera gained at least [`MIN_GAIN`], both tasks were answered (once each: the edge
/// counts an answer only when it consumes the camera's reply channel), the pool stayed in budget.
fn assert_adapted(log: &str, dump: &str) {
    let cams = camera_lines(log);
    assert_eq!(cams.len(), 2, "{dump}");
    for (cam, before, after) in &cams {
        println!("{cam}: exact match vs teacher {before:.3} -> {after:.3}");
        assert!(after - before >= MIN_GAIN, "{cam}: gain {:.3} below {MIN_GAIN}\n{dump}", after - before);
    }
    let mut names: Vec<&str> = cams.iter().map(|c| c.0.as_str()).collect();
    names.sort_unstable();
    assert_eq!(names, ["cam-fog", "cam-sun"]);
    let mem = log.lines().find(|l| l.contains("pool_budget")).expect("memory line");
    assert!(mem.contains("within_budget true") && mem.contains("tasks_done 2"), "{mem}");
    assert!(log.contains("fragmentation over"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cameras_adapt_through_the_edge_and_gain_against_the_teacher() {
    let (log, dump) = run_to_end(TOPOLOGY).await;
    assert_adapted(&log, &dump);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_scheduler_panicking_mid_adaptation_is_restarted_and_answers_every_camera_once() {
    // the edge node's fault switch panics its scheduler at its 4th input (uploads accepted,
    // adaptation cycles under way); the supervisor restarts it and it re-admits both uploads
    let faulty = TOPOLOGY.replace(
        "job = { kind = \"coadapt\", timeout_s = 900, params = { cameras = 2 } }\n",
        "job = { kind = \"coadapt\", timeout_s = 900, params = { cameras = 2 } }\nfaults = { seed = 1, sites = [{ site = \"coadapt.scheduler\", after = 4 }] }\n",
    );
    assert_ne!(faulty, TOPOLOGY);
    let (log, dump) = run_to_end(&faulty).await;
    assert_eq!(log.matches("fault switch: injecting a panic").count(), 1, "{dump}");
    assert!(log.contains("child failed; restarting"), "{dump}");
    assert_adapted(&log, &dump);
}

#[test]
fn camera_lines_parse_by_hand() {
    let log = "[x] coadapt: camera cam-1 drift_frame 320 exact_match_vs_teacher 0.250 -> 0.812 accuracy 0.2 -> 0.7 edge_latency_ms 5\nnoise\n";
    assert_eq!(camera_lines(log), vec![("cam-1".to_string(), 0.25, 0.812)]);
}

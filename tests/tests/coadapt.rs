//! The coadapt workload end to end with real node processes over loopback QUIC: an edge and
//! cameras. Each camera streams digits whose weather changes, notices each drift from its tiny
//! V-MoE's falling confidence, uploads frames; the edge labels them with the teacher, co-adapts
//! the students' experts and projectors in one memory-budgeted pool under the twin-buffer
//! scheduler and sends the parameters back; each camera installs them and streams on.
//!
//! Checked from the job's printout (the edge's own reports): every adaptation's exact match
//! against the teacher on its held-out evaluation window rises by at least [`MIN_GAIN`] (fixed
//! seeds), the tasks completed, and the pool's peak use never exceeded its 16 MiB budget (about two
//! tiny models' adaptation state, 0.4 MB each, plus one step's buffers: 15 MB for 32 images of 64
//! tokens, attention's `heads * 64^2` probabilities per image and block included). Measured once
//! (debug build, tiny student with attention over 64 tokens): fog 0.8 0.141 -> 0.401, sun 0.6
//! 0.094 -> 0.375 (see the kernels' vmoe_adapt test for the same corruptions). The online test: a
//! camera with two drift phases is adapted twice, each time gaining [`MIN_GAIN`], and a camera
//! started only after the first adaptation completed is served.
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
actors = [{ kind = "coadapt-edge", params = { memory_mb = 16, scheduler = "twin", target_gain = 0.15, max_epochs = 25, steps_per_epoch = 6, journal = "{JOURNAL}" } }]
job = { kind = "coadapt", timeout_s = 900, params = { cameras = 2 } }

[[nodes]]
name = "cam-fog"
actors = [{ kind = "coadapt-camera", params = { seed = 21, drift = ["0 clean 0", "256 fog 0.8"], uploads = 256, eval = 192, frames = 1024 } }]

[[nodes]]
name = "cam-sun"
actors = [{ kind = "coadapt-camera", params = { seed = 22, drift = ["0 clean 0", "192 sun 0.6"], uploads = 256, eval = 192, frames = 1024 } }]
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

/// `(camera, adaptation, drift frame, exact before, exact after)` from the job's camera lines.
fn adaptation_lines(log: &str) -> Vec<(String, u32, u64, f64, f64)> {
    log.lines()
        .filter_map(|l| {
            let rest = &l[l.find("coadapt: camera ")? + "coadapt: camera ".len()..];
            let w: Vec<&str> = rest.split_whitespace().collect();
            let at = |key: &str| w.iter().position(|x| *x == key).and_then(|i| w.get(i + 1));
            let i = w.iter().position(|x| *x == "exact_match_vs_teacher")?;
            Some((
                w[0].to_string(),
                at("adaptation")?.parse().ok()?,
                at("drift_frame")?.parse().ok()?,
                w.get(i + 1)?.parse().ok()?,
                w.get(i + 3)?.parse().ok()?,
            ))
        })
        .collect()
}

/// Waits for the edge's job to end (polling the process); the edge's log and a dump of every log.
async fn wait_job(cluster: &mut ProcCluster, cameras: &[&str]) -> (String, String) {
    let deadline = std::time::Instant::now() + Duration::from_secs(900);
    let status = loop {
        if let Some(s) = cluster.exited("edge").unwrap() {
            break s;
        }
        assert!(std::time::Instant::now() < deadline, "job did not end:\n{}", cluster.log("edge"));
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let log = cluster.log("edge");
    let mut dump = format!("edge:\n{log}");
    for c in cameras {
        dump.push_str(&format!("\n{c}:\n{}", cluster.log(c)));
    }
    assert!(status.success(), "edge job failed: {status}\n{dump}");
    (log, dump)
}

/// `topology` with the edge's journal at `journal`.
fn journaled(topology: &str, journal: &std::path::Path) -> String {
    topology.replace("{JOURNAL}", &journal.display().to_string())
}

/// Runs the topology to the end of the edge's job; the edge's log and a dump of every log.
async fn run_to_end(topology: &str) -> (String, String) {
    let tmp = tempfile::tempdir().unwrap();
    let journal = tmp.path().join("edge.journal");
    let mut cluster = ProcCluster::start(EXE.as_ref(), &journaled(topology, &journal)).unwrap();
    let out = wait_job(&mut cluster, &["cam-fog", "cam-sun"]).await;
    assert!(!journal.exists(), "the finished job's journal is removed");
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_node_killed_mid_adaptation_resumes_from_its_journal_and_answers_every_camera_once() {
    let tmp = tempfile::tempdir().unwrap();
    let journal = tmp.path().join("edge.journal");
    let mut cluster = ProcCluster::start(EXE.as_ref(), &journaled(TOPOLOGY, &journal)).unwrap();
    // both uploads are journaled (accepted) and adapting when the edge's node dies
    for cam in ["cam-fog", "cam-sun"] {
        cluster.wait_log("edge", Duration::from_secs(600), &["upload accepted", cam]).await.unwrap();
    }
    cluster.kill9("edge").await.unwrap();
    assert!(journal.exists());
    cluster.restart("edge").unwrap();
    let (log, dump) = wait_job(&mut cluster, &["cam-fog", "cam-sun"]).await;
    assert!(log.contains("coadapt: resuming from journal"), "{dump}");
    let resumed = log.lines().find(|l| l.contains("coadapt: resuming from journal")).unwrap();
    // both uploads were journaled before the kill: each is resumed as pending or as answered
    let count = |key: &str| -> u64 {
        let w: Vec<&str> = resumed.split_whitespace().collect();
        let i = w.iter().position(|x| *x == key).unwrap_or_else(|| panic!("no {key:?} in {resumed}"));
        w[i - 1].parse().unwrap_or_else(|e| panic!("{resumed}: {e}"))
    };
    assert_eq!(count("uploads") + count("adaptations"), 2, "{resumed}");
    // each camera's lost call was made again and answered by the resumed adaptation, once
    let asked_again = ["cam-fog", "cam-sun"]
        .iter()
        .filter(|c| cluster.log(c).contains("the call to the edge was lost"))
        .count();
    assert!(asked_again >= 1, "{dump}");
    assert_adapted(&log[log.find("coadapt: resuming from journal").unwrap()..], &dump);
    assert!(!journal.exists(), "the finished job's journal is removed");
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

/// One camera drifting twice (fog, then sun) and one that joins late (fog); `{OUT}` is the job's
/// output folder. The edge's target gain (0.25) keeps each task adapting past the asserted
/// margin. Measured once (debug): cam-twice fog 0.26 -> 0.60, then sun (noticed from the input
/// statistics, the adapted model's confidence barely moved) 0.59 -> 0.79.
const ONLINE: &str = r#"name = "coadapt-online-test"
[membership]
heartbeat_ms = 200
timeout_ms = 5000

[transport]
idle_timeout_ms = 30000

[[nodes]]
name = "edge"
actors = [{ kind = "coadapt-edge", params = { memory_mb = 16, scheduler = "twin", target_gain = 0.25, max_epochs = 25, steps_per_epoch = 6, journal = "{OUT}/edge.journal" } }]
job = { kind = "coadapt", timeout_s = 900, params = { cameras = 2, out = "{OUT}" } }

[[nodes]]
name = "cam-twice"
actors = [{ kind = "coadapt-camera", params = { seed = 21, drift = ["0 clean 0", "256 fog 0.8", "1024 sun 0.6"], uploads = 256, eval = 192, frames = 1792 } }]

[[nodes]]
name = "cam-late"
actors = [{ kind = "coadapt-camera", params = { seed = 23, drift = ["0 clean 0", "192 fog 0.8"], uploads = 256, eval = 192, frames = 768 } }]
"#;

/// Start frames of cam-twice's drift phases.
const TWICE_PHASES: [u64; 2] = [256, 1024];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_camera_drifting_twice_is_adapted_twice_and_a_late_camera_is_served() {
    let out = tempfile::tempdir().unwrap();
    let topology = ONLINE.replace("{OUT}", &out.path().display().to_string());
    let mut cluster = ProcCluster::start_holding(EXE.as_ref(), &topology, &["cam-late"]).unwrap();
    // the late camera starts only once cam-twice's first adaptation has come back
    cluster
        .wait_log("edge", Duration::from_secs(900), &["adaptation task complete", "cam-twice"])
        .await
        .unwrap();
    cluster.restart("cam-late").unwrap();
    let (log, dump) = wait_job(&mut cluster, &["cam-twice", "cam-late"]).await;

    let all = adaptation_lines(&log);
    let twice: Vec<_> = all.iter().filter(|a| a.0 == "cam-twice").collect();
    assert_eq!(twice.len(), 2, "one adaptation per drift phase:\n{dump}");
    for (k, a) in twice.iter().enumerate() {
        println!("cam-twice adaptation {}: drift frame {} exact match {:.3} -> {:.3}", a.1, a.2, a.3, a.4);
        assert_eq!(a.1, k as u32);
        let next = TWICE_PHASES.get(k + 1).copied().unwrap_or(u64::MAX);
        assert!(a.2 > TWICE_PHASES[k] && a.2 < next, "adaptation {k} noticed in its phase: {a:?}");
        assert!(a.4 - a.3 >= MIN_GAIN, "adaptation {k}: gain {:.3} below {MIN_GAIN}\n{dump}", a.4 - a.3);
    }
    let late: Vec<_> = all.iter().filter(|a| a.0 == "cam-late").collect();
    assert_eq!(late.len(), 1, "{dump}");
    println!("cam-late: exact match {:.3} -> {:.3}", late[0].3, late[0].4);
    assert!(late[0].4 - late[0].3 >= MIN_GAIN, "cam-late gain below {MIN_GAIN}\n{dump}");
    // it joined late: the edge first heard of it after cam-twice's first adaptation completed
    let line_of = |needles: &[&str]| log.lines().position(|l| needles.iter().all(|n| l.contains(n)));
    let first_done = line_of(&["adaptation task complete", "cam-twice"]).unwrap();
    let late_heard = line_of(&["camera heard from", "cam-late"]).expect("cam-late heard from");
    assert!(late_heard > first_done, "{dump}");
    for cam in ["cam-twice", "cam-late"] {
        assert!(log.contains(&format!("coadapt: stream {cam} frames")), "{dump}");
    }
    assert!(log.contains("coadapt: stream cam-twice frames 1792 ended true adaptations 2 of 2"), "{dump}");
    assert!(log.contains("coadapt: stream cam-late frames 768 ended true adaptations 1 of 1"), "{dump}");
    let mem = log.lines().find(|l| l.contains("pool_budget")).expect("memory line");
    assert!(mem.contains("within_budget true") && mem.contains("tasks_done 3"), "{mem}");

    // accuracy over time: samples of both cameras spanning their streams, and the plot
    let csv = std::fs::read_to_string(out.path().join("accuracy.csv")).unwrap();
    for (cam, frames) in [("cam-twice", 1792), ("cam-late", 768)] {
        let rows: Vec<u64> = csv
            .lines()
            .filter(|l| l.starts_with(&format!("{cam},")))
            .map(|l| l.split(',').nth(1).unwrap().parse().unwrap())
            .collect();
        assert_eq!(rows.len() as u64, frames / 64, "one sample per batch for {cam}:\n{csv}");
        assert_eq!(rows.last(), Some(&frames));
    }
    let svg = std::fs::read_to_string(out.path().join("accuracy.svg")).unwrap();
    assert_eq!(svg.matches("<polyline").count(), 2);
    assert!(svg.contains(">update 2<") && svg.contains(">sun 0.6<"), "{svg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_missing_a_camera_fails_at_its_timeout_naming_what_is_missing() {
    // three cameras expected, two in the topology: the job cannot end before its timeout
    let short = TOPOLOGY.replace(
        "job = { kind = \"coadapt\", timeout_s = 900, params = { cameras = 2 } }",
        "job = { kind = \"coadapt\", timeout_s = 30, params = { cameras = 3 } }",
    );
    assert_ne!(short, TOPOLOGY);
    let tmp = tempfile::tempdir().unwrap();
    let journal = tmp.path().join("edge.journal");
    let mut cluster = ProcCluster::start(EXE.as_ref(), &journaled(&short, &journal)).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(300);
    let status = loop {
        if let Some(s) = cluster.exited("edge").unwrap() {
            break s;
        }
        assert!(std::time::Instant::now() < deadline, "job did not end:\n{}", cluster.log("edge"));
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let log = cluster.log("edge");
    assert!(!status.success(), "{log}");
    assert!(log.contains("coadapt: not done within 29 s: 1 of 3 cameras not heard from yet"), "{log}");
}

#[test]
fn camera_lines_parse_by_hand() {
    let log = "[x] coadapt: camera cam-1 drift_frame 320 exact_match_vs_teacher 0.250 -> 0.812 accuracy 0.2 -> 0.7 edge_latency_ms 5 adaptation 1 installed_frame 640\nnoise\n";
    assert_eq!(camera_lines(log), vec![("cam-1".to_string(), 0.25, 0.812)]);
    assert_eq!(adaptation_lines(log), vec![("cam-1".to_string(), 1, 320, 0.25, 0.812)]);
}

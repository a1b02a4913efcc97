//! Recovery of the distributed coe job, with real node processes on loopback QUIC and a real
//! ci app (ONNX experts). Each test compares the per-request output digests with a fault-free
//! local run: every request answered exactly once (ids 0..n, each once), the same outputs.
//!
//! - the scheduler actor panics twice through the fault switch (node config `[faults]`): the
//!   root supervisor restarts it and it rebuilds from its journal;
//! - the scheduler's node is killed with SIGKILL mid-job, a torn record is appended to its
//!   journal (a crash in the middle of a write), and the node is started again: the damage is
//!   named, the job resumes from the journal and completes;
//! - an executor node is killed and restarted: it is put back in service in the same job and
//!   answers requests again;
//! - an executor node is killed for good: its queued and in-flight requests are reassigned.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use troupe_tests::LineCluster;

const EXE: &str = env!("CARGO_BIN_EXE_troupe-node");

fn troupe(args: &[&str]) -> String {
    troupe_tests::run_ok(EXE.as_ref(), args).unwrap_or_else(|e| panic!("{e:#}"))
}

fn parse_results(text: &str) -> Vec<(u64, String)> {
    troupe_tests::parse_coe_results(text).unwrap_or_else(|e| panic!("{e:#}"))
}

/// A ci app and the fault-free local run's results.
fn app_and_reference(tmp: &Path) -> (std::path::PathBuf, Vec<(u64, String)>) {
    let app = tmp.join("app");
    let app_s = app.to_str().unwrap();
    troupe_tests::coe_gen(EXE.as_ref(), &app, &["--scale", "ci", "--seed", "5", "--no-single-model"])
        .unwrap_or_else(|e| panic!("{e:#}"));
    troupe(&["coe", "profile", "--dir", app_s]);
    let reference = tmp.join("reference.txt");
    troupe(&["coe", "run", "--dir", app_s, "--out", reference.to_str().unwrap()]);
    (app, parse_results(&std::fs::read_to_string(&reference).unwrap()))
}

/// The ci app and its fault-free results, made once per test process (the app itself comes from
/// `coe_gen`'s cache, generated once per build). Tests only read it; each keeps its journal, outputs and
/// nodes' folders in its own temporary folder.
fn shared_app() -> &'static (PathBuf, Vec<(u64, String)>) {
    static APP: OnceLock<(PathBuf, Vec<(u64, String)>)> = OnceLock::new();
    APP.get_or_init(|| {
        // A folder of this process's own (nextest runs each test in a process of its own, several
        // at once), made afresh; folders of processes that have ended are removed.
        let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("coe_recovery");
        for entry in std::fs::read_dir(&root).into_iter().flatten().flatten() {
            let pid = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok());
            if pid.is_some_and(|p| !Path::new("/proc").join(p.to_string()).exists()) {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
        let dir = root.join(std::process::id().to_string());
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        app_and_reference(&dir)
    })
}

/// `shared_app` plus the journal path of a test whose folder is `tmp`.
fn app_for(tmp: &Path) -> (&'static Path, &'static [(u64, String)], PathBuf) {
    let (app, reference) = shared_app();
    (app, reference, tmp.join("scheduler.journal"))
}

fn topology(app: &Path, out: &Path, journal: &Path, arrival_scale: f64, scheduler_faults: &str) -> String {
    format!(
        r#"name = "coe-recovery"
[membership]
heartbeat_ms = 100
timeout_ms = 800

[[nodes]]
name = "scheduler"
job = {{ kind = "coe", timeout_s = 150, params = {{ dir = "{app}", out = "{out}", journal = "{journal}", arrival_scale = {arrival_scale}, call_timeout_s = 20 }} }}
{scheduler_faults}

[[nodes]]
name = "gpu-executor"
actors = [{{ kind = "coe-executor", params = {{ dir = "{app}", executor = "gpu0-standin-cpu" }} }}]

[[nodes]]
name = "cpu-executor"
actors = [{{ kind = "coe-executor", params = {{ dir = "{app}", executor = "cpu0" }} }}]
"#,
        app = app.display(),
        out = out.display(),
        journal = journal.display()
    )
}

fn start(tmp: &Path, topo: &str) -> LineCluster {
    let path = tmp.join("topology.toml");
    std::fs::write(&path, topo).unwrap();
    LineCluster::start(Path::new(EXE), &path, &tmp.join("up")).expect("starting the cluster")
}

fn assert_exactly_once(out: &Path, reference: &[(u64, String)], log: &str) {
    let got = parse_results(&std::fs::read_to_string(out).unwrap_or_else(|e| panic!("{e}\n{log}")));
    assert_eq!(got.len(), reference.len(), "{log}");
    assert!(got.iter().enumerate().all(|(i, (id, _))| *id == i as u64), "ids not 0..n once each");
    assert_eq!(got, reference, "outputs differ from the fault-free run");
}

const FINISHED: &str = "[scheduler] coe: results written to";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduler_panicking_through_the_fault_switch_is_restarted_and_loses_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let (app, reference, journal) = app_for(tmp.path());
    let out = tmp.path().join("out.txt");
    let faults =
        "[nodes.faults]\nseed = 3\nsites = [{ site = \"coe.scheduler\", after = 30, every = 40, times = 2 }]";
    let mut c = start(tmp.path(), &topology(app, &out, &journal, 10.0, faults));
    let done = c.wait_line(Duration::from_secs(150), |l| l.starts_with(FINISHED)).await;
    let log = c.text();
    assert!(done.is_some(), "the job did not finish:\n{log}");
    assert_eq!(log.matches("fault switch: injecting a panic").count(), 2, "two injected panics:\n{log}");
    assert_exactly_once(&out, reference, &log);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduler_node_killed_mid_job_resumes_from_its_journal() {
    let tmp = tempfile::tempdir().unwrap();
    let (app, reference, journal) = app_for(tmp.path());
    let out = tmp.path().join("out.txt");
    let mut c = start(tmp.path(), &topology(app, &out, &journal, 40.0, ""));
    let at50 =
        c.wait_line(Duration::from_secs(120), |l| l.starts_with("[scheduler] coe: completed 50 of")).await;
    assert!(at50.is_some(), "the job never reached 50 answers:\n{}", c.text());
    c.kill9("scheduler").await.unwrap();
    // A crash in the middle of a write leaves part of a record behind.
    let mut bytes = std::fs::read(&journal).expect("the scheduler journaled its work");
    bytes.extend_from_slice(&[40, 0, 0, 0, 1, 2, 3]);
    std::fs::write(&journal, &bytes).unwrap();
    c.restart("scheduler").unwrap();
    let done = c.wait_line(Duration::from_secs(150), |l| l.starts_with(FINISHED)).await;
    let log = c.text();
    assert!(done.is_some(), "the restarted scheduler did not finish:\n{log}");
    assert!(
        log.contains("damaged tail at byte") && log.contains("record header cut short"),
        "damage not named:\n{log}"
    );
    let resumed =
        log.lines().find(|l| l.contains("coe: resuming from journal")).unwrap_or_else(|| panic!("{log}"));
    let answered: usize =
        resumed.split(", ").nth(1).and_then(|s| s.split(' ').next()).unwrap().parse().unwrap();
    assert!(answered >= 50, "the journal kept the answers given before the kill: {resumed}");
    assert_exactly_once(&out, reference, &log);
    assert!(!journal.exists(), "a finished job removes its journal");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_node_killed_and_restarted_serves_again_in_the_same_job() {
    let tmp = tempfile::tempdir().unwrap();
    let (app, reference, journal) = app_for(tmp.path());
    let out = tmp.path().join("out.txt");
    let mut c = start(tmp.path(), &topology(app, &out, &journal, 60.0, ""));
    let at50 =
        c.wait_line(Duration::from_secs(120), |l| l.starts_with("[scheduler] coe: completed 50 of")).await;
    assert!(at50.is_some(), "the job never reached 50 answers:\n{}", c.text());
    c.kill9("gpu-executor").await.unwrap();
    let down = c
        .wait_line(Duration::from_secs(30), |l| {
            l.contains("executor gpu0-standin-cpu on gpu-executor is down")
        })
        .await;
    assert!(down.is_some(), "the loss was not noticed:\n{}", c.text());
    c.restart("gpu-executor").unwrap();
    let done = c.wait_line(Duration::from_secs(150), |l| l.starts_with(FINISHED)).await;
    let log = c.text();
    assert!(done.is_some(), "the job did not finish:\n{log}");
    assert!(log.contains("executor gpu0-standin-cpu rejoined on gpu-executor; back in service"), "{log}");
    let line = log
        .lines()
        .find(|l| l.contains("requests ran on a restored executor"))
        .unwrap_or_else(|| panic!("{log}"));
    let after: usize = line.split("; ").nth(1).and_then(|s| s.split(' ').next()).unwrap().parse().unwrap();
    assert!(after > 0, "the restored executor answered nothing: {line}");
    assert_exactly_once(&out, reference, &log);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_node_killed_for_good_has_its_work_reassigned_and_loses_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let (app, reference, journal) = app_for(tmp.path());
    let out = tmp.path().join("out.txt");
    let mut c = start(tmp.path(), &topology(app, &out, &journal, 60.0, ""));
    let at50 =
        c.wait_line(Duration::from_secs(120), |l| l.starts_with("[scheduler] coe: completed 50 of")).await;
    assert!(at50.is_some(), "the job never reached 50 answers:\n{}", c.text());
    c.kill9("gpu-executor").await.unwrap();
    let done = c.wait_line(Duration::from_secs(150), |l| l.starts_with(FINISHED)).await;
    let log = c.text();
    assert!(done.is_some(), "the scheduler did not finish:\n{log}");
    assert!(log.contains("lost executors [\"gpu0-standin-cpu\"]"), "the loss was not noticed:\n{log}");
    assert_exactly_once(&out, reference, &log);
}

//! The coadapt edge and cameras on the simulated cluster: the real shells, journal and policies
//! on the model-compute stand-ins, one thread, paused time. Every upload is answered once with
//! the fault-free run's answer, a run is its seed's (the event log byte for byte), and a camera's
//! or the edge node's crash is survived (the edge resumes from its journal).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use troupe_actors::coadapt::sim_compute::{SimAdaptSpec, SimCameraLog};
use troupe_actors::sim::SimCluster;
use troupe_actors::sim::coadapt::{
    EVAL_FRAMES, NodeHandles, all_ended, answers, camera_args, spec, start_camera, start_edge,
};
use troupe_actors::sim::explore::{Answers, net_for};
use troupe_transport::Role;

/// ractor's registry and the edges' store map are process-wide: one simulation at a time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Cameras per run.
const CAMERAS: u64 = 3;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    None,
    /// Crash camera 1 while its first upload is out, restart it 1.5 s later.
    Camera,
    /// Crash the edge node while an upload it accepted is unanswered, restart it 1.5 s later.
    Edge,
}

struct Outcome {
    answers: Answers,
    log: Vec<String>,
    /// Incarnations per camera.
    incarnations: Vec<usize>,
    /// Uploads the restarted edge found pending in its journal.
    resumed: usize,
}

/// Polls `done` every 5 ms of virtual time, for at most `within` of it.
async fn until(within: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    while !done() {
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    true
}

async fn scenario(tag: &str, seed: u64, fault: Fault) -> Outcome {
    let _one = ONE_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("edge.journal");
    let edge = format!("{tag}-edge");
    let cams: Vec<String> = (1..=CAMERAS).map(|i| format!("{tag}-cam{i}")).collect();
    let mut specs = vec![spec(&edge, Role::Edge)];
    specs.extend(cams.iter().map(|c| spec(c, Role::Camera)));
    let mut cluster = SimCluster::start(net_for(seed), specs).await.unwrap();
    let log = SimCameraLog::default();
    start_edge(&cluster.node(&edge).unwrap().into(), tag, &journal).await.unwrap();
    for (i, c) in cams.iter().enumerate() {
        let node = NodeHandles::from(cluster.node(c).unwrap());
        start_camera(&node, camera_args(&node, i as u64, seed, &log)).await.unwrap();
    }
    let outage = Duration::from_millis(1500);
    let mut resumed = 0;
    match fault {
        Fault::None => {}
        Fault::Camera => {
            let cam = &cams[0];
            let out = until(Duration::from_secs(60), || {
                log.snapshot().get(cam).and_then(|v| v.last()).is_some_and(|i| !i.uploaded.is_empty())
            })
            .await;
            assert!(out, "camera 1 never uploaded");
            assert!(log.snapshot()[cam][0].answered.is_empty(), "crashed with its upload out");
            cluster.crash(cam).await;
            tokio::time::sleep(outage).await;
            let node = NodeHandles::from(cluster.restart(cam).await.unwrap().unwrap());
            start_camera(&node, camera_args(&node, 0, seed, &log)).await.unwrap();
        }
        Fault::Edge => {
            let pending = || {
                log.snapshot()
                    .values()
                    .filter_map(|v| v.last())
                    .any(|i| i.uploaded.iter().any(|a| !i.answered.iter().any(|(b, _)| b == a)))
            };
            assert!(until(Duration::from_secs(60), pending).await, "no upload ever out");
            // past its evaluation window's modelled cost and the net's delay (accepted onto the
            // journal), short of its labelling and first epoch (not yet answered)
            let window = Duration::from_micros(SimAdaptSpec::default().frame_us * EVAL_FRAMES);
            tokio::time::sleep(window + Duration::from_millis(45)).await;
            cluster.crash(&edge).await;
            tokio::time::sleep(outage).await;
            let node = NodeHandles::from(cluster.restart(&edge).await.unwrap().unwrap());
            resumed = start_edge(&node, tag, &journal).await.unwrap().pending;
        }
    }
    let ended = until(Duration::from_secs(120), || all_ended(&log, &cams)).await;
    assert!(ended, "every camera streams to its end: {:?}", log.snapshot());
    let out = Outcome {
        answers: answers(&log, &cams),
        log: cluster.log(),
        incarnations: cams.iter().map(|c| log.snapshot()[c].len()).collect(),
        resumed,
    };
    cluster.shutdown().await;
    out
}

fn run(tag: &str, seed: u64, fault: Fault) -> Outcome {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap();
    rt.block_on(scenario(tag, seed, fault))
}

/// Every adaptation answered once, nothing given up.
fn assert_each_once(a: &Answers) {
    assert!(a.given_up.is_empty(), "given up: {:?}", a.given_up);
    for (id, got) in &a.answers {
        assert_eq!(got.len(), 1, "request {id} answered {got:?}");
    }
    // two drifts per camera, each adapted
    assert_eq!(a.answers.len() as u64, 2 * CAMERAS, "{:?}", a.answers);
}

#[test]
fn sim_coadapt_every_upload_is_answered_once_and_a_seed_is_its_run() {
    let a = run("simca", 11, Fault::None);
    assert_each_once(&a.answers);
    assert_eq!(a.incarnations, vec![1; CAMERAS as usize]);
    assert!(a.log.len() > 200, "a run worth comparing: {} events", a.log.len());
    let b = run("simca", 11, Fault::None);
    assert_eq!(a.log, b.log, "same seed, same event log byte for byte");
    assert_eq!(a.answers, b.answers);
    let other = run("simca", 12, Fault::None);
    assert_ne!(a.log, other.log, "another seed, another run");
}

#[test]
fn sim_coadapt_a_camera_crash_is_survived_with_the_reference_answers() {
    let reference = run("simcc", 21, Fault::None).answers;
    let crashed = run("simcc", 21, Fault::Camera);
    assert_eq!(crashed.incarnations[0], 2, "camera 1 ran again");
    assert_each_once(&crashed.answers);
    assert_eq!(crashed.answers, reference, "the answers of the fault-free run");
}

#[test]
fn sim_coadapt_an_edge_crash_resumes_from_the_journal_with_the_reference_answers() {
    let reference = run("simce", 31, Fault::None).answers;
    let crashed = run("simce", 31, Fault::Edge);
    assert!(crashed.log.iter().any(|l| l.contains("test restarts simce-edge")), "the edge restarted");
    assert!(crashed.resumed > 0, "the edge crashed holding an accepted upload, resumed from its journal");
    assert_each_once(&crashed.answers);
    assert_eq!(crashed.answers, reference, "the answers of the fault-free run");
}

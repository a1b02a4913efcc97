//! The real coe shells on a simulated cluster (one thread, paused tokio time, one seeded hub):
//! the coe scheduler actor (policy, journal on a real temp dir, links, recovery), the executor
//! actors on the deterministic compute stand-in `SimCompute`, and the client request service,
//! called by a client node. Every accepted request is answered exactly once with the outputs a
//! walk of `SimCompute` computes directly; an executor node crashing mid-run has its work
//! redone by the survivor; one seed gives one event log byte for byte, with or without the crash.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use troupe_actors::MembershipConfig;
use troupe_actors::coe::app::{App, INPUT_WIDTH, output_digest, quantise, select_children};
use troupe_actors::coe::requests::{
    CoeAnswer, REQUEST, REQUEST_SERVICE, WireCoeRequest, decode_answer, serve_requests,
};
use troupe_actors::coe::serve::CoeShared;
use troupe_actors::coe::sim_compute::SimCompute;
use troupe_actors::service::to_body;
use troupe_actors::sim::coe::{output_width, sim_app, start_executor, start_scheduler};
use troupe_actors::sim::{SimCluster, SimNodeSpec};
use troupe_policy::Micros;
use troupe_policy::coe::admission::AdmissionLimits;
use troupe_policy::coe::{ExpertId, SchedulerConfig};
use troupe_transport::{NodeId, Role, RoleSet, SimConfig};

/// Virtual time a test waits for anything (tokio skips it when nothing else runs).
const T: Duration = Duration::from_secs(60);
/// Requests each run submits.
const N: usize = 24;

/// The coe scheduler registers under one fixed name in ractor's process-wide registry, so the
/// simulations of this file run one at a time.
static ONE_SCHEDULER: Mutex<()> = Mutex::new(());

fn net(seed: u64) -> SimConfig {
    SimConfig { seed, min_delay: Micros::from_millis(1), max_delay: Micros::from_millis(20), loss: 0.0 }
}

fn node(name: &str, role: Role) -> SimNodeSpec {
    SimNodeSpec::new(name, RoleSet::only(role)).membership(MembershipConfig {
        heartbeat: Duration::from_millis(100),
        timeout: Duration::from_millis(1000),
    })
}

/// Request `i`'s entry expert and input (made from `seed`).
fn request(app: &App, seed: u64, i: usize) -> (ExpertId, Vec<f32>) {
    let roots: Vec<ExpertId> = app.trace.model.roots().map(|e| e.id).collect();
    let pixels = (0..INPUT_WIDTH).map(|j| ((seed as usize + i * 31 + j * 7) % 17) as f32 / 16.0).collect();
    (roots[i % roots.len()], pixels)
}

/// What the scheduler should answer for a request: its walk through the app with every
/// output computed by `SimCompute` directly (root first, then the children each output
/// selects), quantised as the scheduler quantises.
fn reference(app: &App, root: ExpertId, pixels: &[f32]) -> BTreeMap<ExpertId, Vec<i32>> {
    let mut out = BTreeMap::new();
    let mut todo = vec![root];
    while let Some(e) = todo.pop() {
        let probs = SimCompute::output(e, output_width(app, e), pixels);
        let children = app.trace.model.expert(e).map(|x| x.children.clone()).unwrap_or_default();
        if !children.is_empty() {
            todo.extend(select_children(&app.child_scores(e, &probs), &children));
        }
        out.insert(e, quantise(&probs));
    }
    out
}

/// One run: a scheduler node, executor nodes `gpu0` and `cpu0`, a client node submitting `N`
/// requests at once through the request service; with `crash`, `cpu0`'s node crashes once a
/// third are answered. Returns the event log and the answers by request id.
async fn serve(tag: &str, seed: u64, journal: &Path, crash: bool) -> (Vec<String>, BTreeMap<u64, CoeAnswer>) {
    let (app, latency) = sim_app(seed).unwrap();
    let name = |n: &str| format!("{tag}-{n}");
    let specs = vec![
        node(&name("sched"), Role::Scheduler),
        node(&name("gpu0"), Role::Executor),
        node(&name("cpu0"), Role::Executor),
        node(&name("client"), Role::Client),
    ];
    let mut cluster = SimCluster::start(net(seed), specs).await.unwrap();
    for (e, n) in ["gpu0", "cpu0"].into_iter().enumerate() {
        start_executor(&cluster.node(&name(n)).unwrap().actors, &app, &latency, e).await.unwrap();
    }
    let (shared, _) = CoeShared::open(app.clone(), latency, SchedulerConfig::ours(), Some(journal)).unwrap();
    let sched = cluster.node(&name("sched")).unwrap();
    let found =
        start_scheduler(&sched.actors, &sched.supervisor, &shared, T, Duration::from_secs(5)).await.unwrap();
    assert_eq!(found.iter().map(|f| f.node.as_str()).collect::<Vec<_>>(), [name("gpu0"), name("cpu0")]);
    let limits = AdmissionLimits { per_node: N, per_peer: N };
    serve_requests(&sched.services, shared.clone(), limits, T);

    let client = cluster.node(&name("client")).unwrap().services.clone();
    let sched_id = NodeId::new(name("sched"));
    client.wait_for(T, |s| s.providers(REQUEST_SERVICE).contains(&sched_id).then_some(())).await.unwrap();
    cluster.note(&format!("client submits {N} requests"));
    let calls: Vec<_> = (0..N)
        .map(|i| {
            let (root, pixels) = request(&app, seed, i);
            let body = to_body(&WireCoeRequest { root: Some(root.0), pixels }).unwrap();
            let (client, to) = (client.clone(), sched_id.clone());
            tokio::spawn(async move { client.call(&to, REQUEST_SERVICE, REQUEST, body, T).await })
        })
        .collect();
    if crash {
        let mut answered = shared.answered();
        let at_crash = *answered.wait_for(|&n| n >= N / 3).await.unwrap();
        assert!(at_crash < N, "the crash comes with work left: {at_crash} of {N} answered");
        let cpu0 = &shared.report("sim", Vec::new()).unwrap().executors[1];
        assert!(cpu0.1.batches > 0, "{} served before its node crashed: {:?}", cpu0.0, cpu0.1);
        assert!(cluster.crash(&name("cpu0")).await);
    }
    let mut answers = BTreeMap::new();
    for (i, call) in calls.into_iter().enumerate() {
        let body = call.await.unwrap().unwrap_or_else(|e| panic!("request {i}: {e}"));
        let answer = decode_answer(&body).unwrap();
        cluster.note(&format!("answer {} digest {:016x}", answer.request, answer.digest));
        assert!(answers.insert(answer.request, answer).is_none(), "one answer per request id");
    }
    assert_eq!(*shared.answered().borrow(), N, "every accepted request answered");
    assert!(shared.pending().is_empty(), "nothing accepted is left open");
    let log = cluster.log();
    cluster.shutdown().await;
    (log, answers)
}

/// Checks each answer against the reference walk of request `i` (ids are taken in order).
fn check_answers(seed: u64, answers: &BTreeMap<u64, CoeAnswer>) {
    let (app, _) = sim_app(seed).unwrap();
    assert_eq!(answers.keys().copied().collect::<BTreeSet<u64>>(), (0..N as u64).collect());
    for (&id, answer) in answers {
        let (root, pixels) = request(&app, seed, id as usize);
        let want = reference(&app, root, &pixels);
        assert_eq!(answer.outputs, want, "request {id}'s outputs");
        assert_eq!(answer.digest, output_digest(&want), "request {id}'s digest");
    }
}

/// One run on a fresh one-thread runtime with paused time.
fn run(tag: &str, seed: u64, crash: bool) -> (Vec<String>, BTreeMap<u64, CoeAnswer>) {
    let _one = ONE_SCHEDULER.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let tmp = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap();
    rt.block_on(serve(tag, seed, &tmp.path().join("coe.journal"), crash))
}

#[test]
fn sim_coe_answers_every_request_once_as_sim_compute_does_and_one_seed_gives_one_log() {
    let (a, answers) = run("coe", 3, false);
    check_answers(3, &answers);
    assert!(a.len() > 100, "a run worth comparing: {} lines", a.len());
    let (b, _) = run("coe", 3, false);
    if a != b {
        let at = a.iter().zip(&b).position(|(x, y)| x != y);
        panic!("same seed, different logs: first difference at line {at:?}");
    }
    let (c, answers) = run("coe", 4, false);
    check_answers(4, &answers);
    assert_ne!(a, c, "another seed, another log");
}

#[test]
fn sim_coe_an_executor_node_crashing_mid_run_has_its_work_redone_by_the_survivor_reproducibly() {
    let (log, answers) = run("crash", 5, true);
    check_answers(5, &answers);
    assert!(log.iter().any(|l| l.contains("test crashes crash-cpu0")), "the crash is in the log");
    let (again, _) = run("crash", 5, true);
    assert!(log == again, "the same seed and crash, a different log");
}

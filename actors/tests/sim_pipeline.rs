//! The real pipeline shells on a simulated cluster (one thread, paused tokio time, one seeded
//! hub): the foreman service (stage pulls from the client, the job's ledger on a real temp
//! file, the foreman shell and policy) and three workers on the deterministic stage stand-in
//! `SimStage`, called by a client node. Every input is answered exactly once with the outputs
//! of a reference walk through the stand-in stages; one seed gives one event log byte for byte,
//! another seed another; a worker crashing mid-job is survived with the same outputs; a foreman
//! node crashing mid-job resumes the job from its ledger on restart; a foreman panic through
//! the fault switch is restarted by its supervisor with the same outputs.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::Duration;

use troupe_actors::MembershipConfig;
use troupe_actors::pipeline::service::{Answer, FOREMAN_SERVICE, ForemanClient};
use troupe_actors::sim::pipeline::{
    reference, service_settings, sim_inputs, sim_stages, start_foreman, start_worker,
};
use troupe_actors::sim::{SimCluster, SimNodeSpec};
use troupe_policy::Micros;
use troupe_policy::pipeline::Mode;
use troupe_transport::{NodeId, Role, RoleSet, SimConfig};

/// Virtual time a test waits for anything (tokio skips it when nothing else runs).
const T: Duration = Duration::from_secs(120);
/// Inputs of each job.
const N: usize = 12;
/// The workers.
const WORKERS: [&str; 3] = ["w1", "w2", "w3"];

fn net(seed: u64) -> SimConfig {
    SimConfig { seed, min_delay: Micros::from_millis(1), max_delay: Micros::from_millis(20), loss: 0.0 }
}

fn node(name: &str, role: Role) -> SimNodeSpec {
    SimNodeSpec::new(name, RoleSet::only(role)).membership(MembershipConfig {
        heartbeat: Duration::from_millis(100),
        timeout: Duration::from_millis(1000),
    })
}

/// What a run does to the cluster once the job has run for a while.
#[derive(Clone, Copy)]
enum Fault {
    /// Nothing.
    None,
    /// Worker `w2`'s node crashes after this much virtual time.
    Worker(Duration),
    /// The foreman's node crashes after this much virtual time and restarts one second later
    /// (its service started again there); the client submits the job again.
    Foreman(Duration),
}

/// One job of `N` inputs over three workers, with `fault`. Returns the event log and the
/// answer.
async fn job(tag: &str, seed: u64, dir: &Path, fault: Fault) -> (Vec<String>, Answer) {
    let name = |n: &str| format!("{tag}-{n}");
    let mut specs = vec![node(&name("client"), Role::Client), node(&name("foreman"), Role::Scheduler)];
    specs.extend(WORKERS.iter().map(|w| node(&name(w), Role::Executor)));
    let mut cluster = SimCluster::start(net(seed), specs).await.unwrap();
    for w in WORKERS {
        start_worker(&cluster.node(&name(w)).unwrap().actors, &name(w), &dir.join("cache")).await.unwrap();
    }
    let foreman = cluster.node(&name("foreman")).unwrap();
    let settings = service_settings(WORKERS.len(), &dir.join("journal"));
    start_foreman(foreman, &name("pipeline-foreman"), settings).await.unwrap();
    let client_node = cluster.node(&name("client")).unwrap();
    let foreman_id = NodeId::new(name("foreman"));
    let services = client_node.services.clone();
    services.wait_for(T, |s| s.providers(FOREMAN_SERVICE).contains(&foreman_id).then_some(())).await.unwrap();
    let client = ForemanClient::on_node(&client_node.actors, foreman_id.clone());
    let stages: Vec<_> = sim_stages(seed).iter().map(|s| s.stage_file()).collect();
    cluster.note(&format!("client submits {N} inputs"));
    let (first, again) = (stages.clone(), stages);
    let client = std::sync::Arc::new(client);
    let submitter = client.clone();
    let mut call =
        tokio::spawn(async move { submitter.submit(&first, &sim_inputs(seed, N), Mode::Streaming, T).await });
    let (Fault::Worker(after) | Fault::Foreman(after)) = fault else {
        let answer = call.await.unwrap().unwrap_or_else(|e| panic!("the job failed: {e}"));
        return finish(cluster, answer).await;
    };
    tokio::select! {
        r = &mut call => panic!("the job ended before the crash: {:?}", r.map(|a| a.map(|a| a.makespan_s))),
        () = tokio::time::sleep(after) => {}
    }
    if let Fault::Worker(_) = fault {
        assert!(cluster.crash(&name("w2")).await);
        let answer = call.await.unwrap().unwrap_or_else(|e| panic!("the job failed: {e}"));
        return finish(cluster, answer).await;
    }
    assert!(cluster.crash(&name("foreman")).await);
    let lost = call.await.unwrap();
    assert!(lost.is_err(), "the call to the crashed foreman failed");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let foreman = cluster.restart(&name("foreman")).await.unwrap().unwrap();
    let settings = service_settings(WORKERS.len(), &dir.join("journal"));
    start_foreman(foreman, &name("pipeline-foreman"), settings).await.unwrap();
    services.wait_for(T, |s| s.providers(FOREMAN_SERVICE).contains(&foreman_id).then_some(())).await.unwrap();
    cluster.note("client submits the job again");
    let answer = client.submit(&again, &sim_inputs(seed, N), Mode::Streaming, T).await;
    finish(cluster, answer.unwrap_or_else(|e| panic!("the job failed again: {e}"))).await
}

/// Notes the answer, and returns the log with it once the cluster is down.
async fn finish(cluster: SimCluster, answer: Answer) -> (Vec<String>, Answer) {
    cluster.note(&format!("answered {} inputs", answer.outputs.len()));
    let log = cluster.log();
    cluster.shutdown().await;
    (log, answer)
}

/// Checks each input's answer against the reference walk.
fn check(seed: u64, answer: &Answer) {
    let want = reference(&sim_stages(seed), &sim_inputs(seed, N)).unwrap();
    assert_eq!(answer.outputs.len(), N, "one answer per input");
    for (i, (got, want)) in answer.outputs.iter().zip(&want).enumerate() {
        assert_eq!(got, want, "input {i}'s outputs");
    }
}

/// The fault switch is process-wide and every foreman hits its site: the runs of this file
/// take turns.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// One run on a fresh one-thread runtime with paused time, in a fresh folder.
fn run(tag: &str, seed: u64, fault: Fault) -> (Vec<String>, Answer) {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    run_alone(tag, seed, fault)
}

/// [`run`], for a caller that holds the turn already.
fn run_alone(tag: &str, seed: u64, fault: Fault) -> (Vec<String>, Answer) {
    let tmp = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap();
    rt.block_on(job(tag, seed, tmp.path(), fault))
}

#[test]
fn sim_pipeline_answers_every_input_once_as_the_stand_in_stages_do_and_one_seed_gives_one_log() {
    let (a, answer) = run("pipe", 3, Fault::None);
    check(3, &answer);
    assert_eq!(answer.workers.len(), WORKERS.len(), "{:?}", answer.workers);
    assert!(a.len() > 100, "a run worth comparing: {} lines", a.len());
    assert!(
        a.iter().any(|l| l.contains("blob pipe-foreman<-pipe-client")),
        "stage files pulled from the client"
    );
    let (b, _) = run("pipe", 3, Fault::None);
    if a != b {
        let at = a.iter().zip(&b).position(|(x, y)| x != y);
        panic!("same seed, different logs: first difference at line {at:?}");
    }
    let (c, answer) = run("pipe", 4, Fault::None);
    check(4, &answer);
    assert_ne!(a, c, "another seed, another log");
}

#[test]
fn sim_pipeline_a_worker_crashing_mid_job_is_survived_with_the_same_outputs_reproducibly() {
    let after = Duration::from_millis(600);
    let (log, answer) = run("pcrash", 5, Fault::Worker(after));
    check(5, &answer);
    let crash =
        log.iter().position(|l| l.contains("test crashes pcrash-w2")).expect("the crash is in the log");
    assert!(
        log[..crash].iter().any(|l| l.contains("pcrash-w2->pcrash-foreman")),
        "w2 had answered the foreman before it crashed"
    );
    let (again, _) = run("pcrash", 5, Fault::Worker(after));
    assert!(log == again, "the same seed and crash, a different log");
}

#[test]
fn sim_pipeline_a_foreman_node_crashing_mid_job_resumes_from_its_ledger_on_restart() {
    let (log, answer) = run("pfcrash", 6, Fault::Foreman(Duration::from_millis(1000)));
    check(6, &answer);
    assert!(answer.resumed > 0, "inputs answered before the crash come from the journal: {}", answer.resumed);
    assert!((answer.resumed as usize) < N, "and some were left to run: {}", answer.resumed);
    assert!(log.iter().any(|l| l.contains("test restarts pfcrash-foreman")), "the restart is in the log");
}

#[test]
fn sim_pipeline_a_foreman_panic_through_the_fault_switch_is_restarted_and_answers_every_input() {
    use troupe_actors::pipeline::FAULT_SITE;
    use troupe_policy::{FaultPlan, SiteRule};
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let panicking = |tag: &str| {
        troupe_actors::fault::install(FaultPlan::new(0).with_site(FAULT_SITE, SiteRule::once_at(30)));
        let out = run_alone(tag, 7, Fault::None);
        let (hits, fired) = troupe_actors::fault::counts(FAULT_SITE);
        troupe_actors::fault::install(FaultPlan::new(0));
        (out, hits, fired)
    };
    let ((log, answer), hits, fired) = panicking("ppanic");
    assert_eq!(fired, 1, "the foreman panicked once, at hit 30 of {hits}");
    assert!(hits > 30, "and carried on after its restart: {hits} hits");
    check(7, &answer);
    let ((again, _), _, _) = panicking("ppanic");
    assert!(log == again, "the same seed and panic, a different log");
}

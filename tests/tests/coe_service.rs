//! The coe scheduler as a service, with real node processes on loopback QUIC, a real ci app
//! (ONNX experts) and `troupe coe request` clients:
//!
//! - inputs sent by a client (a trace request's digit image as a JSON file, and its entry
//!   expert) are answered with the experts and the output digest a local `troupe coe run` gives
//!   for the same request; each request is accepted on its own (distinct ids); a client whose
//!   certificate lacks the client role (a scheduler's) is refused, naming the role;
//! - with the queue made tiny (one outstanding request per client), an open-loop burst gets
//!   busy answers, and every request not answered busy is answered correctly, exactly once.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use troupe::actors::coe::app::App;
use troupe_tests::ProcCluster;

const EXE: &str = env!("CARGO_BIN_EXE_troupe-node");

fn troupe(args: &[&str]) -> String {
    troupe_tests::run_ok(EXE.as_ref(), args).unwrap_or_else(|e| panic!("{e:#}"))
}

/// A ci app and the local run's results (`(id, digest hex)` per trace request).
fn app_and_reference(tmp: &Path) -> (PathBuf, Vec<(u64, String)>) {
    let app = tmp.join("app");
    let app_s = app.to_str().unwrap();
    troupe_tests::coe_gen(EXE.as_ref(), &app, &["--scale", "ci", "--seed", "5", "--no-single-model"])
        .unwrap_or_else(|e| panic!("{e:#}"));
    troupe(&["coe", "profile", "--dir", app_s]);
    let reference = tmp.join("reference.txt");
    troupe(&["coe", "run", "--dir", app_s, "--requests", "8", "--out", reference.to_str().unwrap()]);
    let text = std::fs::read_to_string(&reference).unwrap();
    (app, troupe_tests::parse_coe_results(&text).unwrap_or_else(|e| panic!("{e:#}")))
}

fn topology(app: &Path, queue: usize, per_client: usize) -> String {
    format!(
        r#"name = "coe-service"
[membership]
heartbeat_ms = 100
timeout_ms = 1500

[[nodes]]
name = "scheduler"
job = {{ kind = "coe", timeout_s = 900, params = {{ dir = "{app}", serve = true, queue = {queue}, queue_per_client = {per_client}, journal = "{journal}", call_timeout_s = 20 }} }}

[[nodes]]
name = "gpu-executor"
actors = [{{ kind = "coe-executor", params = {{ dir = "{app}", executor = "gpu0-standin-cpu" }} }}]

[[nodes]]
name = "cpu-executor"
actors = [{{ kind = "coe-executor", params = {{ dir = "{app}", executor = "cpu0" }} }}]
"#,
        app = app.display(),
        journal = app.join("serve.journal").display(),
    )
}

/// Trace request `i`'s input written as a JSON file, and its entry expert and experts.
fn input_of(app: &App, tmp: &Path, i: usize) -> (PathBuf, u32, Vec<u64>) {
    let r = &app.trace.requests[i];
    let file = tmp.join(format!("input-{i}.json"));
    std::fs::write(&file, serde_json::to_string(&app.input(r.input)).unwrap()).unwrap();
    let experts: BTreeSet<u64> = r.experts().iter().map(|e| u64::from(e.0)).collect();
    (file, r.root.0, experts.into_iter().collect())
}

/// Starts the cluster, makes the client identities, waits until the scheduler serves.
async fn serving(app: &Path, queue: usize, per_client: usize) -> (ProcCluster, String, PathBuf) {
    let cluster = ProcCluster::start(EXE.as_ref(), &topology(app, queue, per_client)).unwrap();
    let keys = cluster.dir().join("keys");
    troupe(&["keys", "node", "client", "--role", "client", "--keys", keys.to_str().unwrap()]);
    troupe(&["keys", "node", "intruder", "--role", "scheduler", "--keys", keys.to_str().unwrap()]);
    let line = cluster.wait_log("scheduler", Duration::from_secs(120), &["coe: serving requests on"]).await;
    line.unwrap_or_else(|e| panic!("the scheduler never served: {e:#}\n{}", cluster.log("scheduler")));
    let addr = cluster.nodes.iter().find(|n| n.name == "scheduler").unwrap().parsed.listen.to_string();
    (cluster, addr, keys)
}

fn request(
    addr: &str,
    keys: &Path,
    who: &str,
    input: &Path,
    root: u32,
    extra: &[&str],
) -> std::process::Output {
    std::process::Command::new(EXE)
        .args(["coe", "request", "--node", addr, "--as", who, "--root", &root.to_string(), "--keys"])
        .arg(keys)
        .arg("--input")
        .arg(input)
        .args(extra)
        .output()
        .unwrap()
}

fn json_of(out: &std::process::Output, what: &str) -> serde_json::Value {
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{what} failed:\n{text}{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_str(text.lines().last().unwrap_or("")).unwrap_or_else(|e| panic!("{what}: {e}: {text}"))
}

#[tokio::test]
async fn requests_from_a_client_are_answered_as_a_local_run_answers_them() {
    let tmp = tempfile::tempdir().unwrap();
    let (app_dir, reference) = app_and_reference(tmp.path());
    let app = App::open(&app_dir, None).unwrap();
    let (cluster, addr, keys) = serving(&app_dir, 64, 16).await;
    let mut ids = BTreeSet::new();
    for i in [0usize, 1, 2, 3, 0] {
        let (input, root, experts) = input_of(&app, tmp.path(), i);
        let answer = json_of(&request(&addr, &keys, "client", &input, root, &[]), &format!("request {i}"));
        assert_eq!(
            answer["digest"].as_str(),
            Some(reference[i].1.as_str()),
            "request {i}: {answer}\n{}",
            cluster.log("scheduler")
        );
        let got: Vec<u64> =
            answer["experts"].as_array().unwrap().iter().map(|e| e.as_u64().unwrap()).collect();
        assert_eq!(got, experts, "request {i} ran other experts than the trace records");
        assert!(ids.insert(answer["request"].as_u64().unwrap()), "request ids repeat: {answer}");
    }
    // open loop at a modest rate: every answer is the local run's
    let (input, root, _) = input_of(&app, tmp.path(), 2);
    let summary = json_of(
        &request(&addr, &keys, "client", &input, root, &["--count", "40", "--rate", "20"]),
        "open-loop load",
    );
    eprintln!("open loop: {summary}");
    assert_eq!(summary["answered"].as_u64().unwrap() + summary["busy"].as_u64().unwrap(), 40, "{summary}");
    assert_eq!(summary["digests"], serde_json::json!([reference[2].1]), "{summary}");
    // a certificate without the client role (here: scheduler) is refused, naming the role
    let refused = request(&addr, &keys, "intruder", &input, root, &[]);
    let text =
        format!("{}{}", String::from_utf8_lossy(&refused.stdout), String::from_utf8_lossy(&refused.stderr));
    assert!(
        !refused.status.success() && text.contains("needs role client"),
        "a scheduler-role client was served:\n{text}"
    );
    assert!(cluster.log("scheduler").contains("coe: serving requests on"), "the scheduler is still serving");
}

#[tokio::test]
async fn a_full_queue_answers_busy_and_every_other_request_exactly_once() {
    let tmp = tempfile::tempdir().unwrap();
    let (app_dir, reference) = app_and_reference(tmp.path());
    let app = App::open(&app_dir, None).unwrap();
    let (cluster, addr, keys) = serving(&app_dir, 2, 1).await;
    let (input, root, _) = input_of(&app, tmp.path(), 1);
    let out = tmp.path().join("burst.jsonl");
    let summary = json_of(
        &request(
            &addr,
            &keys,
            "client",
            &input,
            root,
            &["--count", "30", "--rate", "2000", "--out", out.to_str().unwrap()],
        ),
        "burst",
    );
    let lines: Vec<serde_json::Value> =
        std::fs::read_to_string(&out).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 30, "one line per request");
    let busy = lines.iter().filter(|l| l["busy"] == serde_json::json!(true)).count();
    let answered: Vec<&serde_json::Value> = lines.iter().filter(|l| l.get("digest").is_some()).collect();
    assert!(
        busy >= 1,
        "a burst past a one-request queue got no busy answer: {summary}\n{}",
        cluster.log("scheduler")
    );
    assert!(!answered.is_empty(), "nothing was answered: {summary}");
    assert_eq!(busy + answered.len(), 30, "every request is answered or busy: {summary}");
    let mut ids = BTreeSet::new();
    for a in &answered {
        assert_eq!(a["digest"].as_str(), Some(reference[1].1.as_str()), "{a}");
        assert!(ids.insert(a["request"].as_u64().unwrap()), "request answered twice: {a}");
    }
    // the busy requests were never accepted: the scheduler answers the next one normally
    let again = json_of(&request(&addr, &keys, "client", &input, root, &[]), "after the burst");
    assert_eq!(again["digest"].as_str(), Some(reference[1].1.as_str()));
    // ids are given in acceptance order: the answered ones took consecutive ids, the busy ones none
    let first = *ids.first().unwrap();
    assert_eq!(
        ids.iter().copied().collect::<Vec<u64>>(),
        (first..first + ids.len() as u64).collect::<Vec<u64>>()
    );
    assert_eq!(again["request"].as_u64(), Some(first + ids.len() as u64), "a busy request took an id");
}

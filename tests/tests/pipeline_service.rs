//! Jobs sent to a running crowd: a cluster of real node processes with a long-lived foreman
//! service (`pipeline-foreman` actor) and two workers takes jobs from `troupe pipeline submit
//! --foreman ADDR` clients: two jobs in a row, then two at once (the second queues behind the
//! first). Every job's outputs file has one row per input, equal to the whole model's. Clients
//! hold the `client` role; a `scheduler` certificate is refused, naming the role it needs.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Command;

use troupe_tests::ProcCluster;
use troupe_tests::pipeline::{sentences, whole_model};

const EXE: &str = env!("CARGO_BIN_EXE_troupe-node");

fn topology(tmp: &Path) -> String {
    let worker = |name: &str| {
        format!(
            "[[nodes]]\nname = \"{name}\"\nactors = [{{ kind = \"pipeline-worker\", params = {{ cache_dir = \"{}\" }} }}]\n",
            tmp.join("cache").join(name).display()
        )
    };
    format!(
        "name = \"crowd\"\n[membership]\nheartbeat_ms = 100\ntimeout_ms = 1500\n\n[[nodes]]\nname = \"foreman\"\n\
         actors = [{{ kind = \"pipeline-foreman\", params = {{ workers = 2, journal_dir = \"{}\" }} }}]\n\n{}\n{}",
        tmp.join("journal").display(),
        worker("phone-1"),
        worker("phone-2")
    )
}

/// Starts `troupe pipeline submit --foreman` for `inputs` (written to a file); its outputs go to
/// `name.jsonl`.
fn submit(
    cluster: &ProcCluster,
    tmp: &Path,
    client: &str,
    name: &str,
    inputs: &[String],
) -> std::process::Child {
    let file = tmp.join(format!("{name}.txt"));
    std::fs::write(&file, inputs.join("\n")).unwrap();
    let addr = cluster.nodes.iter().find(|n| n.name == "foreman").unwrap().parsed.listen.to_string();
    Command::new(EXE)
        .args(["pipeline", "submit", "--foreman", &addr, "--as", client, "--keys"])
        .arg(cluster.dir().join("keys"))
        .arg("--inputs")
        .arg(&file)
        .arg("--out")
        .arg(tmp.join(format!("{name}.jsonl")))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits for a client and checks its outputs against the whole model.
fn check(child: std::process::Child, tmp: &Path, name: &str, inputs: &[String]) {
    let out = child.wait_with_output().unwrap();
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "job {name} failed ({}):\n{log}", out.status);
    let rows = std::fs::read_to_string(tmp.join(format!("{name}.jsonl"))).unwrap();
    let rows: Vec<serde_json::Value> = rows.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), inputs.len(), "job {name}: one row per input");
    for (i, (row, w)) in rows.iter().zip(whole_model(inputs)).enumerate() {
        assert_eq!(row["input"].as_u64(), Some(i as u64));
        assert_eq!(row["text"].as_str(), Some(inputs[i].as_str()));
        let v: Vec<f32> = row["sentence_embedding"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        let err = v.iter().zip(&w).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(v.len() == w.len() && err <= 1e-5, "job {name}, input {i}: max abs error {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_crowd_takes_jobs_in_a_row_and_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let cluster = ProcCluster::start(EXE.as_ref(), &topology(tmp.path())).unwrap();
    let keys = cluster.dir().join("keys");
    // one identity per client: a node name holds one connection at a time
    for (client, role) in [("client-a", "client"), ("client-b", "client"), ("sched-x", "scheduler")] {
        troupe_tests::run_ok(
            EXE.as_ref(),
            &["keys", "node", client, "--role", role, "--keys", keys.to_str().unwrap()],
        )
        .unwrap();
    }
    // least privilege: submitting takes the client role, not the right to drive workers
    let refused =
        submit(&cluster, tmp.path(), "sched-x", "refused", &sentences()).wait_with_output().unwrap();
    let text =
        format!("{}{}", String::from_utf8_lossy(&refused.stdout), String::from_utf8_lossy(&refused.stderr));
    assert!(
        !refused.status.success() && text.contains("needs role client"),
        "a scheduler submitted:\n{text}"
    );
    let first = sentences();
    let second: Vec<String> = sentences().into_iter().rev().chain(sentences()).collect();
    check(submit(&cluster, tmp.path(), "client-a", "first", &first), tmp.path(), "first", &first);
    check(submit(&cluster, tmp.path(), "client-a", "second", &second), tmp.path(), "second", &second);
    // two clients at once: one job runs, the other waits its turn
    let a = submit(&cluster, tmp.path(), "client-a", "a", &second);
    let b = submit(&cluster, tmp.path(), "client-b", "b", &first);
    check(a, tmp.path(), "a", &second);
    check(b, tmp.path(), "b", &first);
    assert!(
        std::fs::read_dir(tmp.path().join("journal")).unwrap().next().is_none(),
        "answered jobs leave no journal"
    );
}

//! `troupe up --netns`: every node in its own network namespace on a bridge, with the topology's
//! `[links] rtt_ms = 40, loss_pct = 1` applied in user space by each node's transport.
//!
//! - the hello job succeeds across namespaces, and the namespaces and bridge are gone after;
//! - `troupe status` from this (root) namespace reaches a node on its namespace address, and the
//!   RTT the node's connections measure to its members lies in [`RTT_BAND_MS`] around the
//!   configured 40 ms; ctrl-c removes the namespaces;
//! - where namespaces are not permitted (a user namespace without privileges) `up --netns`
//!   fails naming the reason.
//!
//! Needs root and iproute2; without them the tests fail naming what is missing.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

const EXE: &str = env!("CARGO_BIN_EXE_troupe-node");
/// Configured RTT between nodes.
const RTT_MS: f64 = 40.0;
/// The band the RTT measured by a node's QUIC connections must fall in for [`RTT_MS`]: each
/// end adds 20 ms to what it sends; quinn's smoothed estimate adds ack timing and scheduling.
const RTT_BAND_MS: std::ops::RangeInclusive<f64> = 30.0..=80.0;

/// Fails the test, naming the reason, when namespaces cannot be made here.
fn require_netns() {
    troupe::netns::preflight().unwrap_or_else(|e| panic!("this test needs network namespaces: {e:#}"));
}

/// A topology name unique to this test process (namespaces are machine-wide).
fn unique(base: &str) -> String {
    format!("{base}{}", std::process::id() % 100_000)
}

/// Namespaces whose names start with `prefix` (from `ip netns list`).
fn namespaces(prefix: &str) -> Vec<String> {
    let out =
        std::process::Command::new("ip").args(["netns", "list"]).output().expect("running ip netns list");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(prefix))
        .map(str::to_owned)
        .collect()
}

fn link_exists(name: &str) -> bool {
    std::process::Command::new("ip").args(["link", "show", name]).output().is_ok_and(|o| o.status.success())
}

/// Runs `troupe up --netns-clean TOPOLOGY` when dropped, so that a failing test does not leave
/// its namespaces (and their nodes) behind.
struct CleanOnDrop(std::path::PathBuf);

impl Drop for CleanOnDrop {
    fn drop(&mut self) {
        let _ = std::process::Command::new(EXE).arg("up").arg("--netns-clean").arg(&self.0).output();
    }
}

/// Namespaces, bridges and `/run/netns` are machine-wide: the tests here make them one at a time,
/// so that two `ip netns add` never race and one test's run never meets another's.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const LINKS: &str = "[links]\nrtt_ms = 40\nloss_pct = 1\nseed = 7\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hello_job_runs_across_namespaces_with_40ms_rtt_and_1pct_loss() {
    require_netns();
    let _serial = SERIAL.lock().await;
    let tmp = tempfile::tempdir().unwrap();
    let name = unique("nshello");
    let topo = tmp.path().join("hello.toml");
    let hello = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/hello.toml"))
        .unwrap();
    let hello = hello.replace("name = \"hello\"", &format!("name = \"{name}\"\n\n{LINKS}"));
    std::fs::write(&topo, hello).unwrap();
    let _clean = CleanOnDrop(topo.clone());
    let workdir = tmp.path().join("w");
    let child = Command::new(EXE)
        .args(["up", "--netns", topo.to_str().unwrap(), "--workdir", workdir.to_str().unwrap()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let out = tokio::time::timeout(Duration::from_secs(120), child.wait_with_output())
        .await
        .expect("troupe up --netns did not end within 120 s")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let all = format!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "up --netns failed: {}\n{all}", out.status);
    for node in ["scheduler", "expert-1", "expert-2"] {
        assert!(
            stdout.contains(&format!(
                "[up] {node}: namespace troupe-{name}-{node}, host {node}.troupe, address 10.213."
            )),
            "{node} not placed in its namespace:\n{all}"
        );
    }
    assert!(stdout.contains("hello: answer from expert-1"), "{all}");
    assert!(stdout.contains("hello: answer from expert-2"), "{all}");
    assert!(stdout.contains("hello: done, 2 answers"), "{all}");
    assert_eq!(namespaces(&format!("troupe-{name}-")), Vec::<String>::new(), "namespaces left after the run");
    // the experts found the scheduler as hosts do: by its name, through it as the one seed
    for node in ["expert-1", "expert-2"] {
        let cfg = std::fs::read_to_string(workdir.join(format!("{node}.toml"))).unwrap();
        assert!(cfg.contains("join = \"scheduler.troupe:7400\"") && !cfg.contains("[[peers]]"), "{cfg}");
        let log = std::fs::read_to_string(workdir.join(format!("{node}.log"))).unwrap();
        assert!(log.contains("joined through the seed"), "{log}");
    }
    for node in ["scheduler", "expert-1", "expert-2"] {
        let hosts = Path::new("/etc/netns").join(format!("troupe-{name}-{node}"));
        assert!(!hosts.exists(), "{} left after the run", hosts.display());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reaches_a_namespaced_node_and_its_rtt_matches_the_configured_one() {
    require_netns();
    let _serial = SERIAL.lock().await;
    let tmp = tempfile::tempdir().unwrap();
    let name = unique("nsrtt");
    let topo = tmp.path().join("rtt.toml");
    let mut text = format!("name = \"{name}\"\n\n{LINKS}\n");
    for n in ["a", "b", "c"] {
        text += &format!("[[nodes]]\nname = \"{n}\"\nactors = [{{ kind = \"hello-expert\" }}]\n\n");
    }
    std::fs::write(&topo, text).unwrap();
    let _clean = CleanOnDrop(topo.clone());
    let workdir = tmp.path().join("w");
    let up_err = tmp.path().join("up.stderr");
    let mut up = Command::new(EXE)
        .args(["up", "--netns", topo.to_str().unwrap(), "--workdir", workdir.to_str().unwrap()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&up_err).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let lines = Arc::new(Mutex::new(Vec::<String>::new()));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let reader = BufReader::new(up.stdout.take().unwrap());
    let kept = lines.clone();
    tokio::spawn(async move {
        let mut l = reader.lines();
        while let Ok(Some(line)) = l.next_line().await {
            kept.lock().unwrap().push(line.clone());
            let _ = tx.send(line);
        }
    });
    // the launcher prints each node's address, then the bridge in its first line
    let (mut addr_a, mut bridge) = (None, None);
    tokio::time::timeout(Duration::from_secs(30), async {
        while addr_a.is_none() || bridge.is_none() {
            let Some(line) = rx.recv().await else {
                panic!(
                    "troupe up ended before placing its nodes; stdout:\n{}\nstderr:\n{}",
                    lines.lock().unwrap().join("\n"),
                    std::fs::read_to_string(&up_err).unwrap_or_default()
                );
            };
            if let Some(rest) = line.strip_prefix("[up] a: namespace ") {
                addr_a = rest.split("address ").nth(1).map(str::to_owned);
            }
            if let Some(rest) = line.split("on bridge ").nth(1) {
                bridge = rest.split_whitespace().next().map(str::to_owned);
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no placement lines within 30 s: {:?}", lines.lock().unwrap()));
    let (addr_a, bridge) = (addr_a.unwrap(), bridge.unwrap());
    assert!(addr_a.starts_with("10.213."), "{addr_a}");
    assert_eq!(namespaces(&format!("troupe-{name}-")).len(), 3);

    // `troupe status` from the root namespace, until a's members b and c are up with an RTT
    let keys = workdir.join("keys");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(40);
    let mut last = String::new();
    let rtts = loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "a's members not up with an RTT within 40 s; last status: {last}; up printed {:?}",
            lines.lock().unwrap()
        );
        let out = Command::new(EXE)
            .args(["status", "--node", &addr_a, "--keys", keys.to_str().unwrap(), "--json"])
            .output()
            .await
            .unwrap();
        last = format!("{} {}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        if !out.status.success() {
            // the node may still be starting: poll again shortly
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["node"], "a");
        let members = v["members"].as_array().unwrap();
        let rtt = |m: &str| {
            members.iter().find(|x| x["name"] == m && x["status"] == "up").and_then(|x| x["rtt_ms"].as_f64())
        };
        if let (Some(b), Some(c)) = (rtt("b"), rtt("c")) {
            break [b, c];
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    eprintln!("configured RTT {RTT_MS} ms; measured by a: to b {:.1} ms, to c {:.1} ms", rtts[0], rtts[1]);
    for (peer, ms) in ["b", "c"].iter().zip(rtts) {
        assert!(
            RTT_BAND_MS.contains(&ms),
            "RTT a->{peer}: configured {RTT_MS} ms, measured {ms:.1} ms, outside {RTT_BAND_MS:?}"
        );
    }

    // ctrl-c: the nodes stop and the namespaces and bridge go
    let pid = i32::try_from(up.id().unwrap()).unwrap();
    // SAFETY: signalling our own child; no memory is touched.
    unsafe {
        libc::kill(pid, libc::SIGINT);
    }
    let status = tokio::time::timeout(Duration::from_secs(30), up.wait())
        .await
        .expect("troupe up did not stop within 30 s of ctrl-c")
        .unwrap();
    assert!(status.success(), "{status}: {:?}", lines.lock().unwrap());
    assert_eq!(namespaces(&format!("troupe-{name}-")), Vec::<String>::new(), "namespaces left after ctrl-c");
    assert!(!link_exists(&bridge), "bridge {bridge} left after ctrl-c");
}

#[tokio::test]
async fn netns_where_not_permitted_fails_naming_the_reason() {
    require_netns();
    let tmp = tempfile::tempdir().unwrap();
    let topo = tmp.path().join("t.toml");
    std::fs::write(&topo, format!("name = \"{}\"\n[[nodes]]\nname = \"a\"\n", unique("nsdenied"))).unwrap();
    // readable from an unprivileged user namespace (where this tree's owner maps to nobody)
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&topo, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = Command::new("unshare")
        .args(["--user", EXE, "up", "--netns", topo.to_str().unwrap()])
        .current_dir(tmp.path())
        .output()
        .await
        .expect("this test needs unshare (util-linux)");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "up --netns succeeded without privileges: {stderr}");
    assert!(stderr.contains("network namespaces are not permitted"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_run_is_refused_then_netns_clean_removes_what_it_left() {
    require_netns();
    let _serial = SERIAL.lock().await;
    let tmp = tempfile::tempdir().unwrap();
    let name = unique("nsstale");
    let topo = tmp.path().join("stale.toml");
    let node = |n: &str| format!("[[nodes]]\nname = \"{n}\"\nactors = [{{ kind = \"hello-expert\" }}]\n");
    std::fs::write(&topo, format!("name = \"{name}\"\n{}{}", node("a"), node("b"))).unwrap();
    let _clean = CleanOnDrop(topo.clone());
    let (t, w) = (topo.to_str().unwrap(), tmp.path().join("w"));
    let w = w.to_str().unwrap();
    let mut up = Command::new(EXE)
        .args(["up", "--netns", t, "--workdir", w])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    // the nodes' log lines come through up's stderr
    let mut lines = BufReader::new(up.stderr.take().unwrap()).lines();
    tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(l) = lines.next_line().await.unwrap() {
            if l.contains("node up node=b") {
                return;
            }
        }
        panic!("troupe up ended before node b was up");
    })
    .await
    .expect("node b not up within 30 s");
    // SIGKILL: up cannot clean up; its nodes stay in their namespaces
    up.kill().await.unwrap();
    let prefix = format!("troupe-{name}-");
    assert_eq!(namespaces(&prefix).len(), 2, "a killed run leaves its namespaces");
    let again = Command::new(EXE).args(["up", "--netns", t, "--workdir", w]).output().await.unwrap();
    let err = String::from_utf8_lossy(&again.stderr);
    assert!(!again.status.success(), "a second run started over the first one's namespaces");
    assert!(err.contains("exist already") && err.contains("--netns-clean"), "{err}");
    // The killed run's nodes may or may not outlive it (a node whose log pipe closed can exit on
    // its own), so plant a process of our own in namespace a, one that stays until it is killed,
    // and wait until it runs there: --netns-clean must kill it before removing the namespace.
    let mut planted = Command::new("ip")
        .args(["netns", "exec", &format!("{prefix}a"), "sh", "-c", "echo in-namespace; exec cat"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("running ip netns exec");
    let planted_pid = planted.id().expect("planted process has a pid");
    let mut planted_out = BufReader::new(planted.stdout.take().unwrap()).lines();
    assert_eq!(
        planted_out.next_line().await.unwrap().as_deref(),
        Some("in-namespace"),
        "the planted process did not start in {prefix}a"
    );
    let clean = Command::new(EXE).args(["up", "--netns-clean", t]).output().await.unwrap();
    let said = String::from_utf8_lossy(&clean.stdout);
    assert!(clean.status.success(), "{said} {}", String::from_utf8_lossy(&clean.stderr));
    assert!(said.contains(&format!("removed namespace {prefix}a")), "{said}");
    assert!(said.contains(&format!("removed process {planted_pid} in {prefix}a")), "{said}");
    let status = planted.wait().await.unwrap();
    use std::os::unix::process::ExitStatusExt as _;
    assert_eq!(status.signal(), Some(libc::SIGKILL), "the planted process was not killed: {status}");
    assert_eq!(namespaces(&prefix), Vec::<String>::new(), "namespaces left after --netns-clean");
}

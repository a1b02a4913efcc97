//! Whole-cluster tests with real `troupe node` processes on loopback QUIC.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use troupe::actors::hello::answer;
use troupe_tests::{ProcCluster, member_is};

const EXE: &str = env!("CARGO_BIN_EXE_troupe-node");

const TIMEOUT_MS: u64 = 1200;

fn topology(job: bool) -> String {
    let job = if job {
        "job = { kind = \"hello\", timeout_s = 60, params = { experts = 2, question = \"how are you\" } }\n"
    } else {
        ""
    };
    format!(
        r#"name = "test"
[membership]
heartbeat_ms = 100
timeout_ms = {TIMEOUT_MS}

[[nodes]]
name = "scheduler"
devices = [{{ name = "cpu0", kind = "cpu", memory_mb = 64 }}]
{job}
[[nodes]]
name = "expert-1"
actors = [{{ kind = "hello-expert" }}]

[[nodes]]
name = "expert-2"
actors = [{{ kind = "hello-expert" }}]
"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_form_a_cluster_and_report_status() {
    let cluster = ProcCluster::start(EXE.as_ref(), &topology(false)).unwrap();
    for (me, others) in [
        ("scheduler", ["expert-1", "expert-2"]),
        ("expert-1", ["scheduler", "expert-2"]),
        ("expert-2", ["scheduler", "expert-1"]),
    ] {
        let (s, _) = cluster
            .wait_status(me, Duration::from_secs(30), |s| others.iter().all(|o| member_is(s, o, "up")))
            .await
            .unwrap();
        assert_eq!(s.node, me);
        assert_eq!(s.members.len(), 2, "{s:?}");
    }
    let s = cluster.status("scheduler").await.unwrap();
    assert_eq!(s.devices.len(), 1);
    assert_eq!((s.devices[0].name.as_str(), s.devices[0].budget_bytes), ("cpu0", 64 << 20));
    let e = cluster.status("expert-1").await.unwrap();
    assert!(e.actors.iter().any(|a| a == "hello-expert"), "{:?}", e.actors);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scheduler_asks_remote_experts_over_quic() {
    let mut cluster = ProcCluster::start(EXE.as_ref(), &topology(true)).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = cluster.exited("scheduler").unwrap() {
            break s;
        }
        assert!(std::time::Instant::now() < deadline, "job did not end:\n{}", cluster.log("scheduler"));
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let log = cluster.log("scheduler");
    assert!(status.success(), "scheduler failed: {status}\n{log}");
    for expert in ["expert-1", "expert-2"] {
        let expected = format!("hello: answer from {}", answer(expert, "how are you"));
        assert!(log.contains(&expected), "missing {expected:?} in\n{log}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_node_is_reported_down_then_rejoins() {
    let mut cluster = ProcCluster::start(EXE.as_ref(), &topology(false)).unwrap();
    for me in ["scheduler", "expert-1"] {
        cluster.wait_status(me, Duration::from_secs(30), |s| member_is(s, "expert-2", "up")).await.unwrap();
    }
    cluster.kill9("expert-2").await.unwrap();
    for me in ["scheduler", "expert-1"] {
        let (s, took) = cluster
            .wait_status(me, Duration::from_secs(30), |s| member_is(s, "expert-2", "down"))
            .await
            .unwrap();
        let m = s.members.iter().find(|m| m.name == "expert-2").unwrap();
        // down is declared only after the configured silence, never before
        assert!(
            m.last_heard_ms_ago >= TIMEOUT_MS,
            "{me} declared expert-2 down after {} ms",
            m.last_heard_ms_ago
        );
        println!("{me} saw expert-2 down {took:?} after the kill (timeout {TIMEOUT_MS} ms)");
        // the others stay up
        let other = if me == "scheduler" { "expert-1" } else { "scheduler" };
        assert!(member_is(&s, other, "up"), "{s:?}");
    }
    cluster.restart("expert-2").unwrap();
    for me in ["scheduler", "expert-1"] {
        cluster.wait_status(me, Duration::from_secs(30), |s| member_is(s, "expert-2", "up")).await.unwrap();
    }
    let (s, _) = cluster
        .wait_status("expert-2", Duration::from_secs(30), |s| {
            member_is(s, "scheduler", "up") && member_is(s, "expert-1", "up")
        })
        .await
        .unwrap();
    assert_eq!(s.members.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_runs_a_topology_to_its_end_and_prefixes_logs() {
    let dir = tempfile::tempdir().unwrap();
    let topo = dir.path().join("hello.toml");
    std::fs::write(&topo, topology(true)).unwrap();
    let out = tokio::time::timeout(
        Duration::from_secs(120),
        tokio::process::Command::new(EXE)
            .arg("up")
            .arg(&topo)
            .arg("--workdir")
            .arg(dir.path().join("work"))
            .env_remove("RUST_LOG")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("troupe up did not finish")
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    for expert in ["expert-1", "expert-2"] {
        let line = format!("[scheduler] hello: answer from {}", answer(expert, "how are you"));
        assert!(stdout.contains(&line), "missing {line:?} in\n{stdout}");
    }
    assert!(stdout.contains("[up] all nodes stopped"), "{stdout}");
    // each node's full log is in a file whose path is printed; DEBUG chatter stays off the console
    let stderr = String::from_utf8_lossy(&out.stderr);
    for node in ["scheduler", "expert-1", "expert-2"] {
        let path = dir.path().join("work").join(format!("{node}.log"));
        assert!(stdout.contains(&format!("[up] {node}: full log in {}", path.display())), "{stdout}");
        let log = std::fs::read_to_string(&path).unwrap();
        assert!(
            log.contains("DEBUG") && log.contains("peer joined"),
            "{node}'s log lacks DEBUG lines:\n{log}"
        );
    }
    assert!(!stdout.contains("peer joined") && !stderr.contains("peer joined"), "{stdout}\n{stderr}");
    // idempotent: a second run reuses the keys and succeeds again
    let ca_before = std::fs::read(dir.path().join("work/keys/ca.crt")).unwrap();
    let again = tokio::process::Command::new(EXE)
        .arg("up")
        .arg(&topo)
        .arg("--workdir")
        .arg(dir.path().join("work"))
        .output();
    let again = tokio::time::timeout(Duration::from_secs(120), again).await.unwrap().unwrap();
    assert!(again.status.success());
    assert_eq!(std::fs::read(dir.path().join("work/keys/ca.crt")).unwrap(), ca_before);
}

/// Two nodes with no peers of their own join through one seed named by host (`localhost`):
/// each learns the other from the seed's members list and they become members of each other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_join_through_one_seed_named_by_host() {
    let mut cluster =
        ProcCluster::start_holding(EXE.as_ref(), &topology(false), &["expert-1", "expert-2"]).unwrap();
    let seed_port = cluster.nodes[0].parsed.listen.port();
    for name in ["expert-1", "expert-2"] {
        let node = cluster.nodes.iter_mut().find(|n| n.name == name).unwrap();
        node.parsed.peers.clear();
        node.parsed.join = Some(format!("localhost:{seed_port}").parse().unwrap());
        std::fs::write(&node.config, toml::to_string(&node.parsed).unwrap()).unwrap();
    }
    cluster.restart("expert-1").unwrap();
    cluster
        .wait_status("scheduler", Duration::from_secs(30), |s| member_is(s, "expert-1", "up"))
        .await
        .unwrap();
    cluster.restart("expert-2").unwrap();
    for (me, others) in [("expert-1", ["scheduler", "expert-2"]), ("expert-2", ["scheduler", "expert-1"])] {
        cluster
            .wait_status(me, Duration::from_secs(30), |s| others.iter().all(|o| member_is(s, o, "up")))
            .await
            .unwrap();
    }
    let log = cluster.log("expert-2");
    assert!(log.contains("joined through the seed") && log.contains("expert-1"), "{log}");
}

/// SIGTERM (what systemd and docker send) is a graceful leave: the node exits 0 and the others
/// report it "left", not "down", without waiting for the failure detector's timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_is_a_leave_that_members_report_as_left() {
    let mut cluster = ProcCluster::start(EXE.as_ref(), &topology(false)).unwrap();
    // the whole mesh first: each of the two that stay sees both others up (a node that had not
    // yet heard the other survivor would list it nowhere, not "up", after the leave)
    for (me, others) in [("scheduler", ["expert-1", "expert-2"]), ("expert-1", ["scheduler", "expert-2"])] {
        cluster
            .wait_status(me, Duration::from_secs(30), |s| others.iter().all(|o| member_is(s, o, "up")))
            .await
            .unwrap();
    }
    cluster.signal("expert-2", libc::SIGTERM).unwrap();
    for me in ["scheduler", "expert-1"] {
        let (s, _) = cluster
            .wait_status(me, Duration::from_secs(30), |s| member_is(s, "expert-2", "left"))
            .await
            .unwrap();
        assert!(member_is(&s, if me == "scheduler" { "expert-1" } else { "scheduler" }, "up"), "{s:?}");
    }
    let log = cluster.log("scheduler");
    assert!(log.contains("member left") && !log.contains("member down"), "{log}");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = cluster.exited("expert-2").unwrap() {
            break s;
        }
        assert!(std::time::Instant::now() < deadline, "expert-2 did not exit after SIGTERM");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "{status:?}\n{}", cluster.log("expert-2"));
}

//! A real node process with `[metrics] listen` on: its endpoint answers over HTTP with
//! Prometheus text whose families carry live values (a member up, heartbeat frames and bytes,
//! QUIC bytes and RTT to the peer, the device budget); `troupe status --json` reports the same
//! member. A serving coe cluster, after a client's request is answered, reports its queues and
//! its scheduler actor's mailbox depth on the scheduler, and on the executors their executor
//! actors' mailbox depths, expert residency per tier and the device arena; a pipeline crowd
//! reports the foreman's task queue and the stage its worker holds; a coadapt edge its pool and
//! drained uploads queue.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use troupe_tests::{ProcCluster, member_is, run_ok};

const EXE: &str = env!("CARGO_BIN_EXE_troupe-node");

const TOPOLOGY: &str = r#"name = "metrics"
[membership]
heartbeat_ms = 100
timeout_ms = 1500

[[nodes]]
name = "a"
devices = [{ name = "cpu0", kind = "cpu", memory_mb = 64 }]
metrics = { listen = "127.0.0.1:0" }

[[nodes]]
name = "b"
actors = [{ kind = "hello-expert" }]
"#;

/// One GET over a fresh connection; the status line and the body.
async fn get(addr: SocketAddr, path: &str) -> (String, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\n\r\n").as_bytes()).await.unwrap();
    let mut reply = String::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut reply))
        .await
        .expect("the metrics endpoint did not answer")
        .unwrap();
    let (head, body) = reply.split_once("\r\n\r\n").expect("no end of the response head");
    (head.lines().next().unwrap_or_default().to_string(), body.to_string())
}

/// The metrics address node `name` logs once its endpoint is up.
async fn metrics_addr(cluster: &ProcCluster, name: &str) -> SocketAddr {
    let line = cluster.wait_log(name, Duration::from_secs(30), &["metrics served"]).await.unwrap();
    line.split("url=http://")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .unwrap_or_else(|| panic!("no url in {line:?}"))
        .parse()
        .unwrap()
}

/// Samples of a Prometheus text body: `name{labels}` (as written) to value.
fn samples(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (key, value) = l.rsplit_once(' ').unwrap_or_else(|| panic!("bad sample line {l:?}"));
            (key.to_string(), value.parse().unwrap_or_else(|_| panic!("bad value in {l:?}")))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_serves_prometheus_text_with_live_values() {
    let cluster = ProcCluster::start(EXE.as_ref(), TOPOLOGY).unwrap();
    let addr = metrics_addr(&cluster, "a").await;
    assert!(addr.ip().is_loopback(), "{addr}");
    cluster.wait_status("a", Duration::from_secs(30), |s| member_is(s, "b", "up")).await.unwrap();

    let (status, body) = get(addr, "/metrics").await;
    assert_eq!(status, "HTTP/1.1 200 OK", "{body}");
    assert!(body.ends_with("# EOF\n"), "not OpenMetrics text:\n{body}");
    for family in [
        "troupe_members gauge",
        "troupe_member_up gauge",
        "troupe_frames counter",
        "troupe_frame_bytes counter",
        "troupe_peer_udp_bytes counter",
        "troupe_device_memory_budget_bytes gauge",
        "troupe_device_memory_used_bytes gauge",
    ] {
        assert!(body.contains(&format!("# TYPE {family}\n")), "no {family} in\n{body}");
    }
    let s = samples(&body);
    let value = |k: &str| *s.get(k).unwrap_or_else(|| panic!("no sample {k} in\n{body}"));
    assert!(value("troupe_members{state=\"up\"}") >= 1.0, "{body}");
    assert_eq!(value("troupe_member_up{member=\"b\"}"), 1.0, "{body}");
    // heartbeats went both ways on the control channel
    assert!(value("troupe_frames_total{channel=\"control\",direction=\"received\"}") >= 1.0, "{body}");
    assert!(value("troupe_frame_bytes_total{channel=\"control\",direction=\"sent\"}") >= 12.0, "{body}");
    assert!(value("troupe_peer_udp_bytes_total{peer=\"b\",direction=\"received\"}") > 0.0, "{body}");
    assert!(body.contains("# TYPE troupe_peer_rtt_seconds gauge\n"), "{body}");
    assert!(value("troupe_peer_rtt_seconds{peer=\"b\"}") > 0.0, "QUIC measured an RTT to b:\n{body}");
    assert_eq!(value("troupe_device_memory_budget_bytes{device=\"cpu0\"}"), f64::from(64u32 << 20), "{body}");

    // counters are live: a later scrape sees more heartbeats (waited for, not timed)
    let before = value("troupe_frames_total{channel=\"control\",direction=\"received\"}");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (_, later) = get(addr, "/metrics").await;
        let now = samples(&later)["troupe_frames_total{channel=\"control\",direction=\"received\"}"];
        if now > before {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no more control frames counted after {before}:\n{later}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let (status, _) = get(addr, "/nothing").await;
    assert_eq!(status, "HTTP/1.1 404 Not Found");

    // the same member, machine-readable, through the CLI
    let keys = cluster.dir().join("keys");
    let node_addr = cluster.nodes[0].parsed.listen.to_string();
    let out =
        run_ok(EXE.as_ref(), &["status", "--node", &node_addr, "--keys", keys.to_str().unwrap(), "--json"])
            .unwrap();
    let json_start = out.find('{').unwrap_or_else(|| panic!("no JSON in {out}"));
    let v: serde_json::Value =
        serde_json::from_str(&out[json_start..]).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(v["node"], "a", "{v}");
    let members = v["members"].as_array().unwrap();
    assert!(members.iter().any(|m| m["name"] == "b" && m["status"] == "up"), "{v}");
    assert_eq!(v["devices"][0]["budget_bytes"], 64u64 << 20, "{v}");
}

#[test]
fn a_non_loopback_metrics_address_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("node.toml");
    std::fs::write(
        &cfg,
        "name = \"a\"\nlisten = \"127.0.0.1:0\"\nkeys = \"keys\"\n[metrics]\nlisten = \"0.0.0.0:9464\"\n",
    )
    .unwrap();
    let out = std::process::Command::new(EXE).args(["node", "--config"]).arg(&cfg).output().unwrap();
    // a config error exits 2, apart from a runtime failure's 1
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("metrics.listen") && err.contains("0.0.0.0:9464") && err.contains("loopback"),
        "{err}"
    );
}

const COADAPT: &str = r#"name = "metrics-work"
[membership]
heartbeat_ms = 200
timeout_ms = 5000

[[nodes]]
name = "edge"
actors = [{ kind = "coadapt-edge", params = { memory_mb = 16, scheduler = "twin", target_gain = 0.10, max_epochs = 30, journal = "{JOURNAL}" } }]
job = { kind = "coadapt", timeout_s = 600, params = { cameras = 2, min_gain = 0.0 } }
metrics = { listen = "127.0.0.1:0" }

[[nodes]]
name = "cam-fog"
actors = [{ kind = "coadapt-camera", params = { seed = 11, drift = ["0 clean 0", "320 fog 0.8"] } }]

[[nodes]]
name = "cam-sun"
actors = [{ kind = "coadapt-camera", params = { seed = 12, drift = ["0 clean 0", "256 sun 0.6"] } }]
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_counters_count_what_a_finished_job_did() {
    let tmp = tempfile::tempdir().unwrap();
    let topology = COADAPT.replace("{JOURNAL}", &tmp.path().join("edge.journal").display().to_string());
    let cluster = ProcCluster::start_lingering(EXE.as_ref(), &topology).unwrap();
    let addr = metrics_addr(&cluster, "edge").await;
    cluster
        .wait_log("edge", Duration::from_secs(300), &["troupe-node: job coadapt finished: ok"])
        .await
        .unwrap();
    let (_, body) = get(addr, "/metrics").await;
    let s = samples(&body);
    let value = |k: &str| *s.get(k).unwrap_or_else(|| panic!("no sample {k} in\n{body}"));
    assert_eq!(value("troupe_work_total{workload=\"coadapt\",outcome=\"done\"}"), 2.0, "{body}");
    assert_eq!(value("troupe_work_total{workload=\"coadapt\",outcome=\"failed\"}"), 0.0, "{body}");
    assert_eq!(value("troupe_work_total{workload=\"coe\",outcome=\"done\"}"), 0.0, "{body}");
    // the edge's pool as its engine reports it after a cycle, and its uploads queue, drained
    assert_eq!(value("troupe_pool_budget_bytes{pool=\"coadapt/edge\"}"), f64::from(16u32 << 20), "{body}");
    let _ = value("troupe_pool_fragmentation{pool=\"coadapt/edge\"}");
    assert_eq!(value("troupe_queue_length{workload=\"coadapt\",queue=\"uploads\"}"), 0.0, "{body}");
}

/// A serving coe scheduler and two executor nodes over a ci app in `app`, metrics on each.
fn coe_topology(app: &std::path::Path) -> String {
    format!(
        r#"name = "metrics-coe"
[membership]
heartbeat_ms = 100
timeout_ms = 1500

[[nodes]]
name = "scheduler"
job = {{ kind = "coe", timeout_s = 900, params = {{ dir = "{app}", serve = true, call_timeout_s = 20 }} }}
metrics = {{ listen = "127.0.0.1:0" }}

[[nodes]]
name = "gpu-executor"
actors = [{{ kind = "coe-executor", params = {{ dir = "{app}", executor = "gpu0-standin-cpu" }} }}]
metrics = {{ listen = "127.0.0.1:0" }}

[[nodes]]
name = "cpu-executor"
actors = [{{ kind = "coe-executor", params = {{ dir = "{app}", executor = "cpu0" }} }}]
metrics = {{ listen = "127.0.0.1:0" }}
"#,
        app = app.display()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_serving_coe_cluster_reports_queues_and_expert_residency() {
    let tmp = tempfile::tempdir().unwrap();
    let app = tmp.path().join("app");
    let app_s = app.to_str().unwrap();
    troupe_tests::coe_gen(EXE.as_ref(), &app, &["--scale", "ci", "--seed", "5", "--no-single-model"])
        .unwrap();
    run_ok(EXE.as_ref(), &["coe", "profile", "--dir", app_s]).unwrap();
    let cluster = ProcCluster::start(EXE.as_ref(), &coe_topology(&app)).unwrap();
    let keys = cluster.dir().join("keys");
    let keys_s = keys.to_str().unwrap();
    run_ok(EXE.as_ref(), &["keys", "node", "client", "--role", "client", "--keys", keys_s]).unwrap();
    let line = cluster.wait_log("scheduler", Duration::from_secs(120), &["coe: serving requests on"]).await;
    line.unwrap_or_else(|e| panic!("the scheduler never served: {e:#}\n{}", cluster.log("scheduler")));
    let node_addr =
        |name: &str| cluster.nodes.iter().find(|n| n.name == name).unwrap().parsed.listen.to_string();

    // one client request, answered through the executors
    let input = tmp.path().join("input.json");
    let pixels: Vec<f64> = (0..64).map(|i| f64::from(i) / 64.0).collect();
    std::fs::write(&input, serde_json::to_string(&pixels).unwrap()).unwrap();
    let out = std::process::Command::new(EXE)
        .args(["coe", "request", "--node", &node_addr("scheduler"), "--as", "client", "--keys", keys_s])
        .arg("--input")
        .arg(&input)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the request was not answered:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // the scheduler: its queues, and the request counted as done
    let (_, body) = get(metrics_addr(&cluster, "scheduler").await, "/metrics").await;
    assert!(body.contains("# TYPE troupe_queue_length gauge\n"), "{body}");
    let s = samples(&body);
    let value = |k: &str| *s.get(k).unwrap_or_else(|| panic!("no sample {k} in\n{body}"));
    assert!(value("troupe_work_total{workload=\"coe\",outcome=\"done\"}") >= 1.0, "{body}");
    for queue in ["outstanding", "waiting-clients", "admitted"] {
        let _ = value(&format!("troupe_queue_length{{workload=\"coe\",queue=\"{queue}\"}}"));
    }
    assert!(value("troupe_peer_rtt_seconds{peer=\"gpu-executor\"}") > 0.0, "{body}");
    // the scheduler's mailbox, counted by the runtime: the request's inputs passed through it
    assert!(body.contains("# TYPE troupe_mailbox_depth gauge\n"), "{body}");
    let _ = value("troupe_mailbox_depth{actor=\"coe-scheduler\"}");
    assert!(value("troupe_mailbox_depth_max{actor=\"coe-scheduler\"}") >= 1.0, "{body}");

    // the executors: experts resident per tier after running the request's experts, from
    // each executor's own accounting, and its device arena
    let mut device_experts = 0.0;
    let mut executor_mailbox_max = 0.0;
    for (node, executor) in [("gpu-executor", "gpu0-standin-cpu"), ("cpu-executor", "cpu0")] {
        let (_, body) = get(metrics_addr(&cluster, node).await, "/metrics").await;
        let s = samples(&body);
        let value = |k: &str| *s.get(k).unwrap_or_else(|| panic!("no sample {k} on {node} in\n{body}"));
        let l = |tier: &str| format!("{{executor=\"{executor}\",tier=\"{tier}\"}}");
        let experts = value(&format!("troupe_expert_residency_experts{}", l("device")));
        let bytes = value(&format!("troupe_expert_residency_bytes{}", l("device")));
        let _ = value(&format!("troupe_expert_residency_experts{}", l("host")));
        assert_eq!(experts > 0.0, bytes > 0.0, "{node}: experts and bytes agree:\n{body}");
        let pool = format!("{{pool=\"coe/{executor}/device\"}}");
        assert!(value(&format!("troupe_pool_budget_bytes{pool}")) > 0.0, "{body}");
        assert!(
            value(&format!("troupe_pool_used_bytes{pool}")) >= bytes,
            "{node}: the arena holds the experts:\n{body}"
        );
        let _ = value(&format!("troupe_pool_fragmentation{pool}"));
        device_experts += experts;
        // the executor actor's mailbox (a typed actor, counted under its name): listed from its
        // start; the request's commands went through
        let actor = format!("coe-executor/{executor}");
        let _ = value(&format!("troupe_mailbox_depth{{actor=\"{actor}\"}}"));
        executor_mailbox_max += value(&format!("troupe_mailbox_depth_max{{actor=\"{actor}\"}}"));

        // `troupe status --json` reports the same residency
        let out = run_ok(EXE.as_ref(), &["status", "--node", &node_addr(node), "--keys", keys_s, "--json"])
            .unwrap();
        let v: serde_json::Value = serde_json::from_str(&out[out.find('{').unwrap()..]).unwrap();
        let r = v["residency"].as_array().unwrap_or_else(|| panic!("no residency in {v}"));
        assert!(r.iter().any(|r| r["executor"] == executor), "{node}: {v}");
        let m = v["mailboxes"].as_array().unwrap_or_else(|| panic!("no mailboxes in {v}"));
        assert!(m.iter().any(|m| m["actor"] == actor.as_str() && m["depth"].is_u64()), "{node}: {v}");
    }
    assert!(device_experts >= 1.0, "no expert resident on any executor after a request");
    assert!(executor_mailbox_max >= 1.0, "no command counted in any executor's mailbox");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_crowd_reports_its_task_queue_and_the_stage_a_worker_holds() {
    let tmp = tempfile::tempdir().unwrap();
    let topology = format!(
        "name = \"metrics-crowd\"\n[membership]\nheartbeat_ms = 100\ntimeout_ms = 1500\n\n[[nodes]]\n\
         name = \"foreman\"\nactors = [{{ kind = \"pipeline-foreman\", params = {{ workers = 1, journal_dir = \"{}\" }} }}]\n\
         metrics = {{ listen = \"127.0.0.1:0\" }}\n\n[[nodes]]\nname = \"phone-1\"\n\
         actors = [{{ kind = \"pipeline-worker\", params = {{ cache_dir = \"{}\" }} }}]\n",
        tmp.path().join("journal").display(),
        tmp.path().join("cache").display()
    );
    let cluster = ProcCluster::start(EXE.as_ref(), &topology).unwrap();
    let keys = cluster.dir().join("keys");
    let keys_s = keys.to_str().unwrap();
    run_ok(EXE.as_ref(), &["keys", "node", "client", "--role", "client", "--keys", keys_s]).unwrap();
    let inputs = tmp.path().join("inputs.txt");
    std::fs::write(&inputs, "a cat sat on the mat\n").unwrap();
    let addr = |name: &str| cluster.nodes.iter().find(|n| n.name == name).unwrap().parsed.listen.to_string();
    let out = std::process::Command::new(EXE)
        .args(["pipeline", "submit", "--foreman", &addr("foreman"), "--as", "client", "--keys", keys_s])
        .arg("--inputs")
        .arg(&inputs)
        .arg("--out")
        .arg(tmp.path().join("out.jsonl"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the job failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // the foreman's task queue, drained once the job is answered
    let (_, body) = get(metrics_addr(&cluster, "foreman").await, "/metrics").await;
    let s = samples(&body);
    let value = |k: &str| *s.get(k).unwrap_or_else(|| panic!("no sample {k} in\n{body}"));
    let _ = value("troupe_queue_length{workload=\"pipeline\",queue=\"ready\"}");
    let _ = value("troupe_queue_length{workload=\"pipeline\",queue=\"running\"}");
    assert!(value("troupe_work_total{workload=\"pipeline\",outcome=\"done\"}") >= 1.0, "{body}");

    // the worker's node reports the stage its worker holds
    let out =
        run_ok(EXE.as_ref(), &["status", "--node", &addr("phone-1"), "--keys", keys_s, "--json"]).unwrap();
    let v: serde_json::Value = serde_json::from_str(&out[out.find('{').unwrap()..]).unwrap();
    let stages = v["stages"].as_array().unwrap_or_else(|| panic!("no stages in {v}"));
    // (a foreman loads the stages it runs; after the job the worker holds the last one)
    assert!(stages.iter().any(|w| w["worker"] == "phone-1" && w["stage"].is_u64()), "{v}");
}

//! `troupe status` reaches a node on another host's address: the node runs in its own network
//! namespace (a veth pair, 10.77.x.2 inside, 10.77.x.1 outside), the status client runs here.
//! Needs root and `ip` (iproute2); without them the test fails naming what is missing.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Child, Command, Stdio};
use std::time::Duration;

const EXE: &str = env!("CARGO_BIN_EXE_troupe-node");

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("running ip {args:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ip {args:?}: {}", String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// A namespace with a veth pair to this one, removed when dropped (with its node).
struct Namespace {
    name: String,
    host_if: String,
    node: Option<Child>,
}

impl Drop for Namespace {
    fn drop(&mut self) {
        if let Some(mut c) = self.node.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = ip(&["link", "del", &self.host_if]);
        let _ = ip(&["netns", "del", &self.name]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reaches_a_node_in_another_network_namespace() {
    let tag = std::process::id() % 200 + 20;
    let ns = Namespace { name: format!("trst{tag}"), host_if: format!("trst{tag}h"), node: None };
    let (inner, outer) = (format!("10.77.{tag}.2"), format!("10.77.{tag}.1"));
    let peer_if = format!("trst{tag}n");
    let setup = || -> Result<(), String> {
        ip(&["netns", "add", &ns.name])?;
        ip(&["link", "add", &ns.host_if, "type", "veth", "peer", "name", &peer_if])?;
        ip(&["link", "set", &peer_if, "netns", &ns.name])?;
        ip(&["addr", "add", &format!("{outer}/24"), "dev", &ns.host_if])?;
        ip(&["link", "set", &ns.host_if, "up"])?;
        ip(&["netns", "exec", &ns.name, "ip", "addr", "add", &format!("{inner}/24"), "dev", &peer_if])?;
        ip(&["netns", "exec", &ns.name, "ip", "link", "set", &peer_if, "up"])?;
        ip(&["netns", "exec", &ns.name, "ip", "link", "set", "lo", "up"])
    };
    setup().unwrap_or_else(|e| panic!("network namespaces need root and iproute2: {e}"));

    let tmp = tempfile::tempdir().unwrap();
    let keys = tmp.path().join("keys");
    troupe_tests::run_ok(EXE.as_ref(), &["keys", "init", "--out", keys.to_str().unwrap()]).unwrap();
    troupe_tests::run_ok(
        EXE.as_ref(),
        &["keys", "node", "far", "--keys", keys.to_str().unwrap(), "--role", "executor"],
    )
    .unwrap();
    let listen = format!("{inner}:7400");
    let config = tmp.path().join("far.toml");
    std::fs::write(
        &config,
        format!("name = \"far\"\nlisten = \"{listen}\"\nkeys = \"{}\"\n", keys.display()),
    )
    .unwrap();
    let mut ns = ns;
    ns.node = Some(
        Command::new("ip")
            .args(["netns", "exec", &ns.name, EXE, "node", "--config", config.to_str().unwrap()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let admin = troupe::transport::NodeIdentity::load(&keys, "admin").unwrap();
    let addr: std::net::SocketAddr = listen.parse().unwrap();
    // the node may still be starting: each query waits up to 2 s for an answer, 15 tries at most
    let mut last = String::new();
    for _ in 0..15 {
        match troupe::actors::node::query_status(&admin, addr, Duration::from_secs(2)).await {
            Ok(s) => {
                assert_eq!(s.node, "far");
                return;
            }
            Err(e) => last = e.to_string(),
        }
    }
    panic!("no status from {listen} across namespaces: {last}");
}

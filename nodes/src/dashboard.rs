//! `troupe dashboard`: a live cluster page. The binary asks the given nodes for their status
//! (the same query as `troupe status`) every interval and pushes each new snapshot to the page
//! with server-sent events (`GET /events`). The page itself is static HTML and JS compiled into
//! the binary (`dashboard/index.html`, `dashboard/dashboard.js`); nothing is loaded from elsewhere.
//!
//! Access rule: local only, as for metrics. The page has no authentication, so a listen address
//! that is not loopback is refused ([`check_listen`]); a request whose `Host` is not a loopback
//! name is refused too (a web page elsewhere cannot read the dashboard through DNS rebinding).
//!
//! Untrusted input: request heads are capped at 8 KiB and must arrive within 5 s (the metrics
//! endpoint's limits and reader); at most [`MAX_CLIENTS`] connections are
//! served at once; an event stream whose client stops reading for [`WRITE_TIMEOUT`] is closed.
//!
//! What a snapshot carries is only what `NodeStatus` exposes (members and their state, actors,
//! device budgets, and the workloads' live figures: expert residency per executor and tier,
//! queue depths, the mailbox depths of the runtime's actors, the stage each pipeline worker
//! holds, pools with the used-bytes history the
//! node keeps) plus the device memory the dashboard itself sampled at each poll; [`MISSING`]
//! names what the issue asks for and the status does not carry.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use troupe_actors::wire::NodeStatus;
use troupe_transport::NodeIdentity;

use crate::metrics::{REQUEST_TIMEOUT, read_head, request_line};

/// The page, served at `/`.
const INDEX_HTML: &str = include_str!("dashboard/index.html");
/// The page's script, served at `/dashboard.js`.
const DASHBOARD_JS: &str = include_str!("dashboard/dashboard.js");
/// Connections served at once; more wait in the accept queue.
pub const MAX_CLIENTS: usize = 32;
/// An event stream whose client takes longer than this to take one write is closed.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// A comment is sent on an idle event stream this often (so a dead client is noticed).
const KEEPALIVE: Duration = Duration::from_secs(15);
/// Device memory samples kept per device (the "over time" plot).
const HISTORY: usize = 300;

/// What the issue asks the page to show and the node status does not carry: listed on the
/// page as missing rather than made up.
pub const MISSING: &[&str] =
    &["device memory over time: the node keeps a history per pool (shown with the workloads), not \
     per device actor; the device plot below is sampled by the dashboard at each poll"];

/// How `troupe dashboard` runs.
pub struct Options {
    /// Nodes to ask; every node in their member lists is shown, with its state as they see it.
    pub nodes: Vec<SocketAddr>,
    /// The identity the queries are made with (an `admin` certificate).
    pub identity: NodeIdentity,
    /// Where the page is served (loopback only).
    pub listen: SocketAddr,
    /// Time between polls.
    pub interval: Duration,
}

/// Refuses a listen address that is not loopback, naming it.
pub fn check_listen(addr: SocketAddr) -> Result<()> {
    if !addr.ip().is_loopback() {
        bail!(
            "dashboard --listen: {addr} is not a loopback address; the dashboard has no \
             authentication and serves this machine only (use 127.0.0.1:PORT, or a tunnel)"
        );
    }
    Ok(())
}

/// `troupe dashboard`: serves until ctrl-c.
pub async fn run(opts: Options) -> Result<()> {
    let server = serve(opts).await?;
    println!("dashboard: http://{}/", server.addr);
    tokio::signal::ctrl_c().await.context("waiting for ctrl-c")?;
    Ok(())
}

/// A running dashboard; dropping it stops serving and polling.
pub struct Dashboard {
    /// The bound address (the real port when port 0 was asked for).
    pub addr: SocketAddr,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Dashboard {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Checks and binds the listen address, starts polling and serving.
pub async fn serve(opts: Options) -> Result<Dashboard> {
    check_listen(opts.listen)?;
    if opts.nodes.is_empty() {
        bail!("dashboard: no --node to ask");
    }
    let listener = TcpListener::bind(opts.listen)
        .await
        .with_context(|| format!("binding the dashboard address {}", opts.listen))?;
    let addr = listener.local_addr()?;
    let (tx, rx) = watch::channel(Arc::new(snapshot_json(&Poll::default(), &Memory::default())));
    let identity = Arc::new(opts.identity);
    let poller = tokio::spawn(poll_loop(opts.nodes, identity, opts.interval, tx));
    let accept = tokio::spawn(accept_loop(listener, rx));
    Ok(Dashboard { addr, tasks: vec![poller, accept] })
}

/// One poll: what each asked address answered.
#[derive(Default)]
pub struct Poll {
    /// Poll number, from 1.
    pub seq: u64,
    /// Unix time of the poll in milliseconds.
    pub at_ms: u64,
    /// Per asked address: its status or why there is none.
    pub answers: Vec<(SocketAddr, Result<NodeStatus, String>)>,
    /// Node names of asked addresses that answered before (to show one down by name).
    pub known: HashMap<SocketAddr, String>,
}

/// Device memory samples per `node/device`: `(unix ms, used bytes)`.
#[derive(Default)]
pub struct Memory(BTreeMap<String, VecDeque<(u64, u64)>>);

impl Memory {
    fn record(&mut self, poll: &Poll) {
        for (_, answer) in &poll.answers {
            let Ok(s) = answer else { continue };
            for d in &s.devices {
                let h = self.0.entry(format!("{}/{}", s.node, d.name)).or_default();
                if h.len() == HISTORY {
                    h.pop_front();
                }
                h.push_back((poll.at_ms, d.used_bytes));
            }
        }
    }
}

async fn poll_loop(
    nodes: Vec<SocketAddr>,
    identity: Arc<NodeIdentity>,
    interval: Duration,
    tx: watch::Sender<Arc<String>>,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut memory = Memory::default();
    let mut known = HashMap::new();
    let query_timeout = interval.clamp(Duration::from_millis(500), Duration::from_secs(3));
    for seq in 1.. {
        ticker.tick().await;
        let mut set = tokio::task::JoinSet::new();
        for (i, &addr) in nodes.iter().enumerate() {
            let id = identity.clone();
            set.spawn(async move {
                let r = troupe_actors::node::query_status(&id, addr, query_timeout).await;
                (i, addr, r.map_err(|e| e.to_string()))
            });
        }
        let mut answers = Vec::new();
        while let Some(done) = set.join_next().await {
            match done {
                Ok(a) => answers.push(a),
                Err(e) => tracing::warn!(error = %e, "dashboard: a status query task failed"),
            }
        }
        answers.sort_by_key(|(i, _, _)| *i);
        let answers: Vec<_> = answers.into_iter().map(|(_, a, r)| (a, r)).collect();
        for (addr, r) in &answers {
            if let Ok(s) = r {
                known.insert(*addr, s.node.clone());
            }
        }
        let at_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let poll = Poll { seq, at_ms, answers, known: known.clone() };
        memory.record(&poll);
        if tx.send(Arc::new(snapshot_json(&poll, &memory))).is_err() {
            return;
        }
    }
}

/// The snapshot the page renders, as one line of JSON: every node named by an answer or a
/// member list with its state, actors and devices where it answered itself, the asked sources,
/// the memory history and the [`MISSING`] list.
pub fn snapshot_json(poll: &Poll, memory: &Memory) -> String {
    struct View {
        state: &'static str,
        answered: Option<SocketAddr>,
        reported_by: Vec<String>,
        last_heard_ms_ago: Option<u64>,
        actors: Option<Vec<String>>,
        devices: Option<Value>,
        live: Option<Value>,
    }
    let mut nodes: BTreeMap<String, View> = BTreeMap::new();
    let blank = || View {
        state: "down",
        answered: None,
        reported_by: Vec::new(),
        last_heard_ms_ago: None,
        actors: None,
        devices: None,
        live: None,
    };
    for (addr, answer) in &poll.answers {
        if let Ok(s) = answer {
            let v = nodes.entry(s.node.clone()).or_insert_with(blank);
            v.state = "up";
            v.answered = Some(*addr);
            v.last_heard_ms_ago = Some(0);
            v.actors = Some(s.actors.clone());
            let report = crate::status::json(s);
            v.devices = Some(report["devices"].clone());
            v.live = Some(json!({
                "residency": report["residency"],
                "queues": report["queues"],
                "mailboxes": report["mailboxes"],
                "stages": report["stages"],
                "pools": report["pools"],
            }));
        }
    }
    for (_, answer) in &poll.answers {
        let Ok(s) = answer else { continue };
        for m in &s.members {
            let v = nodes.entry(m.name.clone()).or_insert_with(blank);
            v.reported_by.push(format!("{}: {}", s.node, m.status));
            if v.answered.is_some() {
                continue;
            }
            if m.status == "up" {
                v.state = "up";
            } else if m.status == "left" && v.state != "up" {
                // said goodbye: gone on purpose, not failed
                v.state = "left";
            }
            v.last_heard_ms_ago =
                Some(v.last_heard_ms_ago.map_or(m.last_heard_ms_ago, |l| l.min(m.last_heard_ms_ago)));
        }
    }
    for (addr, answer) in &poll.answers {
        if let (Err(e), Some(name)) = (answer, poll.known.get(addr)) {
            let v = nodes.entry(name.clone()).or_insert_with(blank);
            v.reported_by.push(format!("dashboard: {e}"));
        }
    }
    let nodes: Vec<Value> = nodes
        .into_iter()
        .map(|(name, v)| {
            json!({
                "name": name,
                "state": v.state,
                "addr": v.answered.map(|a| a.to_string()),
                "reported_by": v.reported_by,
                "last_heard_ms_ago": v.last_heard_ms_ago,
                "actors": v.actors,
                "devices": v.devices,
                "live": v.live,
            })
        })
        .collect();
    let sources: Vec<Value> = poll
        .answers
        .iter()
        .map(|(addr, a)| match a {
            Ok(s) => json!({ "addr": addr.to_string(), "node": s.node, "ok": true }),
            Err(e) => {
                json!({ "addr": addr.to_string(), "node": poll.known.get(addr), "ok": false, "error": e })
            }
        })
        .collect();
    let memory: BTreeMap<&String, Vec<[u64; 2]>> =
        memory.0.iter().map(|(k, h)| (k, h.iter().map(|&(t, u)| [t, u]).collect())).collect();
    json!({
        "seq": poll.seq,
        "at_ms": poll.at_ms,
        "nodes": nodes,
        "sources": sources,
        "memory_history": memory,
        "missing": MISSING,
    })
    .to_string()
}

async fn accept_loop(listener: TcpListener, rx: watch::Receiver<Arc<String>>) {
    let slots = Arc::new(Semaphore::new(MAX_CLIENTS));
    let local = listener.local_addr().ok();
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else { return };
        let Ok((stream, _)) = listener.accept().await else { continue };
        let rx = rx.clone();
        tokio::spawn(async move {
            if let Err(e) = answer(stream, rx, local).await {
                tracing::debug!(error = %e, "dashboard: request not answered");
            }
            drop(permit);
        });
    }
}

/// What a request head asks for.
#[derive(Debug, PartialEq, Eq)]
enum Route {
    Page,
    Script,
    Events,
    Snapshot,
    NotFound,
    BadMethod,
    BadHost,
    BadRequest,
}

/// Whether a `Host` header value names this machine (or there is none, as in HTTP/1.0).
fn host_allowed(host: Option<&str>, local: Option<SocketAddr>) -> bool {
    let Some(host) = host else { return true };
    let name = match host.rsplit_once(':') {
        Some((n, port)) if port.chars().all(|c| c.is_ascii_digit()) => n,
        _ => host,
    };
    let name = name.trim_start_matches('[').trim_end_matches(']');
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback() || local.is_some_and(|l| l.ip() == ip))
}

fn route(head: &[u8], local: Option<SocketAddr>) -> Route {
    let Some((method, path)) = request_line(head) else { return Route::BadRequest };
    let host = std::str::from_utf8(head).ok().and_then(|t| {
        t.lines().skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim().eq_ignore_ascii_case("host").then(|| v.trim())
        })
    });
    if !host_allowed(host, local) {
        return Route::BadHost;
    }
    if method != "GET" {
        return Route::BadMethod;
    }
    match path {
        "/" | "/index.html" => Route::Page,
        "/dashboard.js" => Route::Script,
        "/events" => Route::Events,
        "/status.json" => Route::Snapshot,
        _ => Route::NotFound,
    }
}

async fn answer(
    mut stream: TcpStream,
    rx: watch::Receiver<Arc<String>>,
    local: Option<SocketAddr>,
) -> Result<()> {
    let head = tokio::time::timeout(REQUEST_TIMEOUT, read_head(&mut stream))
        .await
        .context("no request head in time")??;
    let snapshot;
    let (code, kind, body): (&str, &str, &str) = match route(&head, local) {
        Route::Page => ("200 OK", "text/html; charset=utf-8", INDEX_HTML),
        Route::Script => ("200 OK", "text/javascript; charset=utf-8", DASHBOARD_JS),
        Route::Snapshot => {
            snapshot = rx.borrow().clone();
            ("200 OK", "application/json", snapshot.as_str())
        }
        Route::Events => {
            tracing::debug!("dashboard: event stream opened");
            return events(stream, rx).await;
        }
        Route::NotFound => ("404 Not Found", "text/plain", "not here: see /\n"),
        Route::BadMethod => ("405 Method Not Allowed", "text/plain", "only GET is served\n"),
        Route::BadHost => ("403 Forbidden", "text/plain", "the dashboard answers loopback host names only\n"),
        Route::BadRequest => ("400 Bad Request", "text/plain", "not an HTTP request\n"),
    };
    let reply = format!(
        "HTTP/1.1 {code}\r\ncontent-type: {kind}\r\ncontent-length: {}\r\ncache-control: no-store\r\n\
         connection: close\r\n\r\n{body}",
        body.len()
    );
    tokio::time::timeout(WRITE_TIMEOUT, stream.write_all(reply.as_bytes()))
        .await
        .context("client too slow")??;
    stream.shutdown().await?;
    Ok(())
}

/// Writes `text`, giving up on a client that takes longer than [`WRITE_TIMEOUT`].
async fn send(text: String, stream: &mut TcpStream) -> Result<()> {
    tokio::time::timeout(WRITE_TIMEOUT, stream.write_all(text.as_bytes()))
        .await
        .context("client too slow")??;
    Ok(())
}

/// An event stream: the current snapshot at once, then each new one as `event: status`.
async fn events(mut stream: TcpStream, mut rx: watch::Receiver<Arc<String>>) -> Result<()> {
    let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-store\r\n\
                connection: close\r\n\r\nretry: 1000\n\n";
    send(head.to_string(), &mut stream).await?;
    loop {
        let snap = rx.borrow_and_update().clone();
        send(format!("event: status\ndata: {snap}\n\n"), &mut stream).await?;
        loop {
            match tokio::time::timeout(KEEPALIVE, rx.changed()).await {
                Ok(Ok(())) => break,
                Ok(Err(_)) => return Ok(()),
                Err(_) => send(": keep-alive\n\n".to_string(), &mut stream).await?,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use troupe_actors::wire::{DeviceView, MailboxView, MemberView, PoolView, ResidencyView, StageView};

    #[test]
    fn only_loopback_listen_addresses_are_accepted() {
        assert!(check_listen("127.0.0.1:0".parse().unwrap()).is_ok());
        assert!(check_listen("[::1]:8080".parse().unwrap()).is_ok());
        let e = check_listen("0.0.0.0:8080".parse().unwrap()).unwrap_err().to_string();
        assert!(e.contains("--listen") && e.contains("0.0.0.0:8080") && e.contains("loopback"), "{e}");
    }

    #[test]
    fn requests_are_routed_and_foreign_hosts_refused() {
        let local = Some("127.0.0.1:8080".parse().unwrap());
        assert_eq!(route(b"GET / HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n\r\n", local), Route::Page);
        assert_eq!(route(b"GET /events HTTP/1.1\r\nhost: localhost:8080\r\n\r\n", local), Route::Events);
        assert_eq!(route(b"GET /dashboard.js HTTP/1.1\r\nhost: [::1]:8080\r\n\r\n", local), Route::Script);
        assert_eq!(route(b"GET /status.json HTTP/1.0\r\n\r\n", local), Route::Snapshot);
        assert_eq!(route(b"GET / HTTP/1.1\r\nHost: evil.example:8080\r\n\r\n", local), Route::BadHost);
        assert_eq!(route(b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", local), Route::BadMethod);
        assert_eq!(route(b"GET /x HTTP/1.1\r\n\r\n", local), Route::NotFound);
        assert_eq!(route(b"\xff\r\n\r\n", local), Route::BadRequest);
    }

    #[test]
    fn a_snapshot_merges_answers_and_member_lists() {
        let a: SocketAddr = "127.0.0.1:7000".parse().unwrap();
        let c: SocketAddr = "127.0.0.1:7002".parse().unwrap();
        let member = |name: &str, status: &str| MemberView {
            name: name.into(),
            status: status.into(),
            last_heard_ms_ago: 40,
            rtt_us: None,
        };
        let status = NodeStatus {
            node: "a".into(),
            members: vec![member("b", "down"), member("c", "up")],
            actors: vec!["hello-expert".into()],
            devices: vec![DeviceView {
                name: "cpu0".into(),
                kind: "cpu".into(),
                budget_bytes: 64,
                used_bytes: 8,
                fragmentation: 0.0,
            }],
            residency: vec![ResidencyView {
                executor: "cpu0".into(),
                device_experts: 2,
                device_bytes: 4096,
                host_experts: 1,
                host_bytes: 1024,
            }],
            stages: vec![StageView { worker: "a".into(), stage: Some(1) }],
            pools: vec![PoolView {
                pool: "coe/cpu0/device".into(),
                budget_bytes: 8192,
                used_bytes: 4096,
                fragmentation: 0.25,
                history: vec![(900, 2048), (1000, 4096)],
            }],
            mailboxes: vec![MailboxView { actor: "coe-scheduler".into(), depth: 3, max_depth: 7 }],
            ..NodeStatus::default()
        };
        let poll = Poll {
            seq: 3,
            at_ms: 1000,
            answers: vec![(a, Ok(status)), (c, Err("no answer".into()))],
            known: HashMap::from([(c, "c".to_string())]),
        };
        let mut memory = Memory::default();
        memory.record(&poll);
        let v: Value = serde_json::from_str(&snapshot_json(&poll, &memory)).unwrap();
        let nodes = v["nodes"].as_array().unwrap();
        let state = |n: &str| nodes.iter().find(|x| x["name"] == n).unwrap()["state"].clone();
        assert_eq!(state("a"), "up");
        assert_eq!(state("b"), "down");
        assert_eq!(state("c"), "up", "a member list saying up wins over an unreachable address");
        assert_eq!(v["nodes"][0]["devices"][0]["budget_bytes"], 64);
        assert_eq!(v["memory_history"]["a/cpu0"][0][1], 8);
        assert_eq!(v["sources"][1]["ok"], false);
        assert_eq!(v["missing"].as_array().unwrap().len(), MISSING.len());
        let live = &v["nodes"][0]["live"];
        assert_eq!(live["residency"][0]["executor"], "cpu0");
        assert_eq!(live["residency"][0]["device_experts"], 2);
        assert_eq!(live["stages"][0]["stage"], 1);
        assert_eq!(live["pools"][0]["history"][1][1], 4096, "the node's own history is passed on");
        assert_eq!(live["queues"].as_array().map(Vec::len), Some(0));
        assert_eq!(live["mailboxes"][0]["actor"], "coe-scheduler");
        assert_eq!(
            (live["mailboxes"][0]["depth"].as_u64(), live["mailboxes"][0]["max_depth"].as_u64()),
            (Some(3), Some(7))
        );
        assert!(v["nodes"][1]["live"].is_null(), "a node that did not answer has no live figures");
    }
}

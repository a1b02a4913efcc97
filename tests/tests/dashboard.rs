//! `troupe dashboard` in a real browser: a cluster of real node processes, the dashboard process
//! asking them, and headless Chromium (Debian's package, installed by `scripts/setup-browser`)
//! loading the page. Every node shows up, with the stage a pipeline worker holds and its worker
//! actor's mailbox depth as its node reports them; after `kill -9` of one, the open page receives the
//! change over server-sent events and shows it down; a screenshot is written under
//! `target/dashboard/`. Without Chromium this test fails and says why.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use troupe_tests::ProcCluster;

const EXE: &str = env!("CARGO_BIN_EXE_troupe-node");

/// Three nodes, `a` with a device, `b` and `c` with a hello expert, and `w` with a pipeline
/// worker (its cache under `cache`), so the page has a worker's stage to show.
fn topology(cache: &Path) -> String {
    format!(
        r#"name = "dashboard"
[membership]
heartbeat_ms = 100
timeout_ms = 1500

[[nodes]]
name = "a"
devices = [{{ name = "cpu0", kind = "cpu", memory_mb = 64 }}]

[[nodes]]
name = "b"
actors = [{{ kind = "hello-expert" }}]

[[nodes]]
name = "c"
actors = [{{ kind = "hello-expert" }}]

[[nodes]]
name = "w"
actors = [{{ kind = "pipeline-worker", params = {{ cache_dir = "{}" }} }}]
"#,
        cache.display()
    )
}

/// The `chromium` on PATH, or a failure naming what to do.
fn chromium() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).map(|d| d.join("chromium")).find(|p| p.is_file()).unwrap_or_else(|| {
        panic!(
            "chromium is not installed, so the dashboard cannot be tested in a browser: \
             run scripts/setup-browser (root, Debian: apt-get install chromium)"
        )
    })
}

/// A headless Chromium run on `url` with extra flags; stdout is piped.
fn browser(profile: &Path, flags: &[&str], url: &str) -> Child {
    Command::new(chromium())
        .args(["--headless", "--disable-gpu", "--no-sandbox", "--no-first-run"])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(flags)
        .arg(url)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting chromium")
}

/// Waits for a browser run to end (it ends once the page closed its event stream and the
/// virtual-time budget ran out); kills it after `deadline`. Returns its stdout.
fn finish(mut child: Child, deadline: Duration) -> String {
    let mut out = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("chromium did not finish within {deadline:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    reader.join().unwrap()
}

/// The `data-state` of node `name`'s row in a dumped DOM.
fn state<'a>(dom: &'a str, name: &str) -> Option<&'a str> {
    let key = format!("data-node=\"{name}\" data-state=\"");
    let rest = &dom[dom.find(&key)? + key.len()..];
    rest.split('"').next()
}

/// A `data-NAME="..."` attribute of the body.
fn body_attr<'a>(dom: &'a str, name: &str) -> Option<&'a str> {
    let key = format!("data-{name}=\"");
    let rest = &dom[dom.find(&key)? + key.len()..];
    rest.split('"').next()
}

/// One raw request; the status line of the reply ("" when the connection closed without one).
fn raw(addr: &str, request: &[u8]) -> String {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let _ = s.write_all(request);
    let mut reply = Vec::new();
    let _ = s.read_to_end(&mut reply);
    String::from_utf8_lossy(&reply).lines().next().unwrap_or_default().to_string()
}

/// HTTP requests are untrusted: an oversized head is dropped unanswered, a foreign `Host` and
/// other methods are refused, unknown paths are 404, and the snapshot is served as JSON.
fn http_limits(addr: &str) {
    let host = format!("Host: {addr}\r\n\r\n");
    assert_eq!(raw(addr, format!("GET /status.json HTTP/1.1\r\n{host}").as_bytes()), "HTTP/1.1 200 OK");
    assert_eq!(raw(addr, format!("GET /nothing HTTP/1.1\r\n{host}").as_bytes()), "HTTP/1.1 404 Not Found");
    assert_eq!(
        raw(addr, format!("DELETE / HTTP/1.1\r\n{host}").as_bytes()),
        "HTTP/1.1 405 Method Not Allowed"
    );
    assert_eq!(raw(addr, b"GET / HTTP/1.1\r\nHost: evil.example\r\n\r\n"), "HTTP/1.1 403 Forbidden");
    let mut huge = b"GET / HTTP/1.1\r\nX-Pad: ".to_vec();
    huge.resize(64 << 10, b'a');
    assert_eq!(raw(addr, &huge), "", "a 64 KiB request head is not answered");
}

fn count_lines(path: &Path, needle: &str) -> usize {
    std::fs::read_to_string(path).unwrap_or_default().lines().filter(|l| l.contains(needle)).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_every_node_up_and_a_killed_one_down_in_a_browser() {
    let browser_path = chromium();
    let cache = tempfile::tempdir().unwrap();
    let mut cluster = ProcCluster::start(EXE.as_ref(), &topology(cache.path())).unwrap();
    let keys = cluster.dir().join("keys");
    let log = cluster.dir().join("dashboard.log");
    let mut cmd = Command::new(EXE);
    cmd.args([
        "dashboard",
        "--keys",
        keys.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--interval-ms",
        "300",
    ]);
    for n in &cluster.nodes {
        cmd.args(["--node", &n.parsed.listen.to_string()]);
    }
    let mut dash = cmd
        .env("RUST_LOG", "info,troupe::dashboard=debug,quinn=warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    struct Kill(Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let stdout = dash.stdout.take().unwrap();
    let dash = Kill(dash);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let base = loop {
        let line = rx.recv_timeout(Duration::from_secs(30)).unwrap_or_else(|_| {
            panic!(
                "the dashboard printed no URL; its log:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            )
        });
        if let Some(url) = line.strip_prefix("dashboard: ") {
            break url.trim_end_matches('/').to_string();
        }
    };
    assert!(base.starts_with("http://127.0.0.1:"), "{base}");
    http_limits(base.strip_prefix("http://").unwrap());
    let profile = tempfile::tempdir().unwrap();

    // 1. Every node up: load the page (it closes its stream after the first poll's snapshot)
    // until the DOM says so.
    let deadline = Instant::now() + Duration::from_secs(60);
    let dom = loop {
        let dom = finish(
            browser(profile.path(), &["--virtual-time-budget=2000", "--dump-dom"], &format!("{base}/?once")),
            Duration::from_secs(30),
        );
        let all_up = ["a", "b", "c", "w"].iter().all(|n| state(&dom, n) == Some("up"));
        if all_up && dom.contains("data-stage=\"w/w\"") {
            break dom;
        }
        assert!(
            Instant::now() < deadline,
            "not every node up (and w's stage shown) on the page within 60 s:\n{dom}"
        );
    };
    assert!(dom.contains("hello-expert"), "b's and c's actors are listed:\n{dom}");
    assert!(dom.contains("cpu0 (cpu)") && dom.contains("64.0 MiB"), "a's device budget is shown:\n{dom}");
    // w's worker reports the stage it holds (none: no foreman has loaded one), from its node
    assert!(dom.contains("w: no stage live"), "the pipeline worker's stage is shown:\n{dom}");
    // its worker actor's mailbox depth, counted by w's runtime (listed from the actor's start;
    // the worker is a typed actor, counted under its name `pipeline-worker/w`)
    assert!(dom.contains("data-mailbox=\"w/pipeline-worker/w\""), "w's worker mailbox is shown:\n{dom}");
    assert!(dom.contains("pipeline-worker/w: 0 queued"), "w's idle worker has no message queued:\n{dom}");
    assert!(dom.contains("device memory over time"), "what the status lacks is listed as missing:\n{dom}");

    // 2. An open page sees b go down: it keeps its stream until b shows down, so the browser run
    // ends only after the change was pushed. b is killed once its stream is open.
    let opened = count_lines(&log, "event stream opened");
    let live = browser(
        profile.path(),
        &["--virtual-time-budget=1000", "--dump-dom"],
        &format!("{base}/?until=b:down"),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while count_lines(&log, "event stream opened") <= opened {
        assert!(Instant::now() < deadline, "the page opened no event stream");
        std::thread::sleep(Duration::from_millis(20));
    }
    cluster.kill9("b").await.unwrap();
    let dom = finish(live, Duration::from_secs(60));
    assert_eq!(state(&dom, "b"), Some("down"), "{dom}");
    assert_eq!(state(&dom, "a"), Some("up"), "{dom}");
    assert_eq!(state(&dom, "c"), Some("up"), "{dom}");
    let changes = body_attr(&dom, "changes").unwrap_or_else(|| panic!("no changes recorded:\n{dom}"));
    let up = changes.find("b:up").unwrap_or_else(|| panic!("the open page never saw b up: {changes}"));
    let down = changes.find("b:down").unwrap_or_else(|| panic!("no b:down in {changes}"));
    assert!(up < down, "b went up then down on the open page: {changes}");

    // 3. A screenshot of the page with b down, under target/.
    let target = Path::new(EXE).parent().and_then(Path::parent).unwrap().join("dashboard");
    std::fs::create_dir_all(&target).unwrap();
    let shot = target.join("dashboard.png");
    let _ = std::fs::remove_file(&shot);
    finish(
        browser(
            profile.path(),
            &[
                "--virtual-time-budget=2000",
                "--window-size=1280,900",
                &format!("--screenshot={}", shot.display()),
            ],
            &format!("{base}/?once"),
        ),
        Duration::from_secs(30),
    );
    let png = std::fs::read(&shot).unwrap_or_else(|e| panic!("no screenshot at {}: {e}", shot.display()));
    assert!(png.starts_with(b"\x89PNG"), "not a PNG: {}", shot.display());
    eprintln!("screenshot: {} (browser {})", shot.display(), browser_path.display());
    drop(dash);
}

#[test]
fn a_non_loopback_dashboard_address_is_refused_by_name() {
    let out = Command::new(EXE)
        .args(["dashboard", "--node", "127.0.0.1:1", "--keys", "/nonexistent", "--listen", "0.0.0.0:8080"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--listen") && err.contains("0.0.0.0:8080") && err.contains("loopback"), "{err}");
}

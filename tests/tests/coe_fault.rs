//! The coe topology as separate processes over QUIC: a scheduler node and two executor nodes
//! serve a ci trace; one executor is killed with SIGKILL mid-run. Every request must complete
//! exactly once, with the same output as a fault-free run.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const EXE: &str = env!("CARGO_BIN_EXE_troupe-node");

fn troupe(args: &[&str]) -> String {
    troupe_tests::run_ok(EXE.as_ref(), args).unwrap_or_else(|e| panic!("{e:#}"))
}

/// Kills the children still running when dropped (also on a failed assertion).
struct Nodes(Vec<(String, Child)>);

impl Drop for Nodes {
    fn drop(&mut self) {
        for (_, c) in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn parse_results(text: &str) -> Vec<(u64, String)> {
    troupe_tests::parse_coe_results(text).unwrap_or_else(|e| panic!("{e:#}"))
}

fn topology(app: &Path, out: &Path, arrival_scale: f64) -> String {
    format!(
        r#"name = "coe-fault"
[membership]
heartbeat_ms = 100
timeout_ms = 800

[[nodes]]
name = "scheduler"
job = {{ kind = "coe", timeout_s = 120, params = {{ dir = "{app}", out = "{out}", arrival_scale = {arrival_scale}, call_timeout_s = 20 }} }}

[[nodes]]
name = "gpu-executor"
actors = [{{ kind = "coe-executor", params = {{ dir = "{app}", executor = "gpu0-standin-cpu" }} }}]

[[nodes]]
name = "cpu-executor"
actors = [{{ kind = "coe-executor", params = {{ dir = "{app}", executor = "cpu0" }} }}]
"#,
        app = app.display(),
        out = out.display()
    )
}

#[test]
fn killing_an_executor_mid_run_loses_no_request_and_changes_no_output() {
    let tmp = tempfile::tempdir().unwrap();
    let app = tmp.path().join("app");
    let app_s = app.to_str().unwrap();
    troupe(&["coe", "gen", "--scale", "ci", "--dir", app_s, "--seed", "5"]);
    troupe(&["coe", "profile", "--dir", app_s]);
    let reference = tmp.path().join("reference.txt");
    troupe(&["coe", "run", "--dir", app_s, "--out", reference.to_str().unwrap()]);
    let reference = parse_results(&std::fs::read_to_string(&reference).unwrap());

    // Stretch arrivals so the run lasts a few seconds and the kill lands mid-run.
    let out = tmp.path().join("fault.txt");
    let topo_path = tmp.path().join("coe-fault.toml");
    std::fs::write(&topo_path, topology(&app, &out, 60.0)).unwrap();
    let topo = troupe::up::Topology::load(&topo_path).unwrap();
    let configs = troupe::up::prepare(&topo, &tmp.path().join("up")).unwrap();
    let mut nodes = Nodes(Vec::new());
    let (tx, rx) = mpsc::channel::<String>();
    for (name, cfg) in &configs {
        let mut child = Command::new(EXE)
            .args(["node", "--config", cfg.to_str().unwrap()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        for pipe in [
            child.stdout.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
            child.stderr.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
        ]
        .into_iter()
        .flatten()
        {
            let tx = tx.clone();
            let name = name.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    let _ = tx.send(format!("[{name}] {line}"));
                }
            });
        }
        nodes.0.push((name.clone(), child));
    }
    drop(tx);
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut log = Vec::new();
    let mut killed = false;
    let mut finished = false;
    while Instant::now() < deadline && !finished {
        let Ok(line) = rx.recv_timeout(Duration::from_secs(1)) else {
            if nodes
                .0
                .iter_mut()
                .find(|(n, _)| n == "scheduler")
                .and_then(|(_, c)| c.try_wait().ok().flatten())
                .is_some()
            {
                break;
            }
            continue;
        };
        if !killed && line.starts_with("[scheduler] coe: completed 50 of") {
            let (_, gpu) = nodes.0.iter_mut().find(|(n, _)| n == "gpu-executor").unwrap();
            gpu.kill().unwrap(); // SIGKILL
            gpu.wait().unwrap();
            killed = true;
            log.push("[test] killed gpu-executor with SIGKILL".to_string());
        }
        finished = line.contains("coe: results written to");
        log.push(line);
    }
    let log = log.join("\n");
    assert!(killed, "the run never reached 50 completions:\n{log}");
    assert!(finished, "the scheduler did not finish:\n{log}");
    assert!(log.contains("lost executors [\"gpu0-standin-cpu\"]"), "the loss was not noticed:\n{log}");
    eprintln!("{log}");
    let got = parse_results(&std::fs::read_to_string(&out).unwrap());
    // Exactly once: ids 0..n in order, each once; same outputs as the fault-free run.
    assert_eq!(got.len(), reference.len());
    assert!(got.iter().enumerate().all(|(i, (id, _))| *id == i as u64));
    assert_eq!(got, reference, "outputs differ from the fault-free run");
}

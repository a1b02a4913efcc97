//! Each example run as a user runs it: the program with no arguments, which starts its node
//! processes itself; checked by its exit status and the lines it prints.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Mutex, mpsc};
use std::time::{Duration, Instant};

/// Longest a demo may run before it is killed and the test fails.
const LIMIT: Duration = Duration::from_secs(45);

/// One demo at a time: each starts several node processes, and the failover's membership timeout
/// should not compete with another demo for the CPU.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

struct Run {
    status: ExitStatus,
    stdout: Vec<String>,
    stderr: String,
}

impl Run {
    /// Everything the demo printed, for failure messages.
    fn transcript(&self) -> String {
        format!("exit: {}\nstdout:\n{}\nstderr:\n{}", self.status, self.stdout.join("\n"), self.stderr)
    }

    /// The lines that start with `prefix`.
    fn lines(&self, prefix: &str) -> Vec<&str> {
        self.stdout.iter().filter(|l| l.starts_with(prefix)).map(String::as_str).collect()
    }

    fn has(&self, line: &str) -> bool {
        self.stdout.iter().any(|l| l == line)
    }
}

/// Runs the program `bin` with no arguments, killing it (and failing) past [`LIMIT`].
fn run(bin: &str) -> Run {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut child = Command::new(bin)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {bin}: {e}"));
    enum Out {
        Line(String),
        Stderr(String),
        StdoutClosed,
    }
    let (tx, rx) = mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    let out_tx = tx.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = out_tx.send(Out::Line(line));
        }
        let _ = out_tx.send(Out::StdoutClosed);
    });
    let mut stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        let _ = tx.send(Out::Stderr(s));
    });
    let deadline = Instant::now() + LIMIT;
    let (mut lines, mut err, mut open) = (Vec::new(), None, true);
    while open || err.is_none() {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(Out::Line(l)) => lines.push(l),
            Ok(Out::StdoutClosed) => open = false,
            Ok(Out::Stderr(s)) => err = Some(s),
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{bin} did not finish within {LIMIT:?}; it printed:\n{}", lines.join("\n"));
            }
        }
    }
    let status = child.wait().unwrap();
    Run { status, stdout: lines, stderr: err.unwrap_or_default() }
}

#[test]
fn embed_calls_its_actor_through_a_local_handle() {
    let run = run(env!("CARGO_BIN_EXE_embed"));
    assert!(run.status.success(), "{}", run.transcript());
    let answer = run.lines("my-service at 127.0.0.1:");
    assert_eq!(answer.len(), 1, "{}", run.transcript());
    assert!(answer[0].ends_with(": scaler answered [2.0, 4.0, 6.0]"), "{}", run.transcript());
}

#[test]
fn remote_counter_is_called_by_name_and_a_camera_may_not_add() {
    let run = run(env!("CARGO_BIN_EXE_remote_counter"));
    assert!(run.status.success(), "{}", run.transcript());
    let t = run.transcript();
    // the scheduler adds; each answer is the host's total
    for line in ["[ops] found total on host", "[ops] get -> 0", "[ops] add 2 -> 2", "[ops] add 3 -> 5"] {
        assert!(run.has(line), "no {line:?} in\n{t}");
    }
    // the camera reads the total, its adds are refused naming the role and the message, and
    // they changed nothing
    assert_eq!(run.lines("[cam] get -> "), ["[cam] get -> 5", "[cam] get -> 5"], "{t}");
    let refused = run.lines("[cam] forbidden: ");
    assert_eq!(refused.len(), 2, "{t}");
    for line in refused {
        assert!(line.starts_with("[cam] forbidden: add to total: "), "{t}");
        assert!(line.contains("camera") && line.contains("scheduler"), "{t}");
    }
    assert!(run.lines("[cam] add ").is_empty(), "a camera added:\n{t}");
    assert!(run.has("demo ok"), "{t}");
}

#[test]
#[cfg(feature = "onnx")]
fn own_expert_serves_an_onnx_model_to_another_node() {
    // the model and the ONNX Runtime library come from scripts/setup: without them this fails,
    // saying so
    let cache = troupe::kernels::assets::Assets::locate().unwrap_or_else(|e| {
        panic!("own_expert serves tiny_mlp.onnx from the setup cache, which is missing: {e}")
    });
    cache.path(troupe::kernels::assets::TINY_MLP).unwrap_or_else(|e| panic!("{e}"));
    let run = run(env!("CARGO_BIN_EXE_own_expert"));
    assert!(run.status.success(), "{}", run.transcript());
    let t = run.transcript();
    // tiny_mlp.onnx's formula (scripts/tools/make_tiny.py), worked by hand for these rows
    for line in [
        "[app] [1.0, 2.0, 3.0, 4.0] -> [1.940, -1.690]",
        "[app] [0.5, 1.0, -0.5, 2.0] -> [0.890, -0.640]",
        "[app] refused: each row takes 4 values, not 1",
        "demo ok",
    ] {
        assert!(run.has(line), "no {line:?} in\n{t}");
    }
}

#[test]
fn failover_moves_the_counter_and_the_client_sees_one_peer_lost() {
    let run = run(env!("CARGO_BIN_EXE_failover"));
    assert!(run.status.success(), "{}", run.transcript());
    let t = run.transcript();
    let placed = run.lines("[sup] placed counter on ");
    assert_eq!(placed.len(), 1, "{t}");
    let first = placed[0].trim_start_matches("[sup] placed counter on ");
    let other = match first {
        "w1" => "w2",
        "w2" => "w1",
        _ => panic!("placed on {first}, not on a worker:\n{t}"),
    };
    let killed = run.stdout.iter().position(|l| l.starts_with(&format!("killed {first} "))).expect(&t);
    // answers from the first worker until the kill, then from the other, counting again from
    // the child's arguments
    let answers = |from: &str| -> Vec<(usize, &str)> {
        let tail = format!(" from {from}");
        let answer = |l: &&String| l.starts_with("[sup] answer ") && l.ends_with(&tail);
        run.stdout.iter().enumerate().filter(|(_, l)| answer(l)).map(|(i, l)| (i, l.as_str())).collect()
    };
    let before = answers(first);
    assert!(before.len() >= 3 && before[..3].iter().all(|(i, _)| *i < killed), "{t}");
    let after: Vec<&str> = answers(other).into_iter().map(|(_, l)| l).collect();
    let want: Vec<String> = (1..=3).map(|n| format!("[sup] answer {n} from {other}")).collect();
    assert_eq!(after, want, "{t}");
    // exactly one typed peer-lost in between (a call cut off by the kill may also time out)
    assert_eq!(run.lines("[sup] error peer-lost: ").len(), 1, "{t}");
    let summary = run.lines("[sup] errors: ");
    assert_eq!(summary.len(), 1, "{t}");
    assert!(summary[0].starts_with("[sup] errors: peer-lost=1 "), "{t}");
    let restarted = run.lines("[sup] counters restarted counter: ");
    assert!(restarted.len() == 1 && restarted[0].contains(first), "{t}");
    assert!(run.has("demo ok"), "{t}");
}

#[test]
fn my_node_runs_a_users_kind_beside_the_builtins_from_toml_configs() {
    let run = run(env!("CARGO_BIN_EXE_my_node"));
    assert!(run.status.success(), "{}", run.transcript());
    let t = run.transcript();
    // the host's counter starts from its config's params; the ops node's job finds it by name
    // and calls it through a typed handle
    for line in [
        "[host] counter total starts at 5",
        "[ops] found total on host",
        "[ops] add 2 -> 7",
        "[ops] add 3 -> 10",
        "[ops] troupe-node: job count-up finished: ok",
        "demo ok",
    ] {
        assert!(run.has(line), "no {line:?} in\n{t}");
    }
    assert_eq!(run.lines("[ops] get -> "), ["[ops] get -> 5", "[ops] get -> 10"], "{t}");
}

#[test]
fn my_node_up_runs_a_topology_of_its_own_kinds() {
    let dir = tempfile::tempdir().unwrap();
    let topology = concat!(env!("CARGO_MANIFEST_DIR"), "/my_node.toml");
    let out = Command::new(env!("CARGO_BIN_EXE_my_node"))
        .args(["up", topology, "--workdir"])
        .arg(dir.path())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let t = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{t}");
    // the job on `ops` reached the counter on `host` through the kinds only my_node knows, with
    // the roles those kinds declare (the job's scheduler role lets it send `add`)
    for line in ["counter total starts at 5", "add 3 -> 10", "[up] every job succeeded"] {
        assert!(t.contains(line), "no {line:?} in\n{t}");
    }
    // the configs `up` wrote name the user's kind as a config written by hand would
    let host = std::fs::read_to_string(dir.path().join("host.toml")).unwrap();
    assert!(host.contains("kind = \"my-counter\""), "{host}");
}

#[test]
fn my_node_exits_2_naming_a_bad_param_by_its_path() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("bad.toml");
    let text = "name = \"host\"\nlisten = \"127.0.0.1:7000\"\nkeys = \"keys\"\n\n\
                [[actors]]\nkind = \"my-counter\"\nparams = { start = \"x\" }\n";
    std::fs::write(&config, text).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_my_node"))
        .arg("--config")
        .arg(&config)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    // a config error exits 2, as `troupe node`'s does, before any key is read
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(stderr.contains("bad.toml: actors[0].params.start: "), "{stderr}");
    assert!(stderr.contains("config error"), "{stderr}");
    // an unknown kind names the user's kinds beside the built-in ones
    std::fs::write(&config, text.replace("my-counter", "dragon")).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_my_node")).arg("--config").arg(&config).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(stderr.contains("actors[0].kind") && stderr.contains("\"my-counter\""), "{stderr}");
    assert!(stderr.contains("\"hello-expert\""), "{stderr}");
}

//! The coe and pipeline topologies across network namespaces (`troupe up --netns`) with
//! `[links] rtt_ms = 40, loss_pct = 1` give the results of the same topology on loopback: every
//! request / input answered once, with the same digests (coe) and the same embeddings (pipeline,
//! within the 1e-5 the other pipeline tests allow against the whole model; the stage files are
//! in the workers' caches from the loopback run). Real processes,
//! real QUIC across real namespaces, real ONNX Runtime.
//!
//! Needs root and iproute2 (namespaces) and the MiniLM stages of `scripts/setup` (pipeline);
//! without them the tests fail naming what is missing.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use troupe::kernels::assets::{Assets, MINILM_SPLIT, MINILM_STAGES};

const EXE: &str = env!("CARGO_BIN_EXE_troupe-node");
const LINKS: &str = "[links]\nrtt_ms = 40\nloss_pct = 1\nseed = 3\n";

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

/// Runs `troupe up --netns-clean TOPOLOGY` when dropped, so that a run killed at its time limit
/// does not leave its namespaces (and their nodes) behind.
struct CleanOnDrop(PathBuf);

impl Drop for CleanOnDrop {
    fn drop(&mut self) {
        let _ = std::process::Command::new(EXE).arg("up").arg("--netns-clean").arg(&self.0).output();
    }
}

/// Runs `troupe up [--netns] TOPOLOGY` to its end (at most `limit`), asserting it succeeded;
/// returns its output.
async fn up(topology: &Path, workdir: &Path, netns: bool, limit: Duration) -> String {
    let _clean = netns.then(|| CleanOnDrop(topology.to_path_buf()));
    let mut cmd = tokio::process::Command::new(EXE);
    cmd.arg("up");
    if netns {
        cmd.arg("--netns");
    }
    let child = cmd
        .arg(topology)
        .arg("--workdir")
        .arg(workdir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let out = tokio::time::timeout(limit, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("troupe up {} did not end within {limit:?}", topology.display()))
        .unwrap();
    let text = format!("{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "troupe up (netns {netns}) {}: {}\n{text}", topology.display(), out.status);
    text
}

/// The same topology text under two names: `(loopback, namespaced with [links])`.
fn pair(text: &str, name: &str, tag: &str) -> (String, String) {
    let line = format!("name = \"{name}\"");
    assert!(text.contains(&line), "topology has no {line}");
    let id = std::process::id() % 100_000;
    (
        text.replacen(&line, &format!("name = \"{tag}loop{id}\""), 1),
        text.replacen(&line, &format!("name = \"{tag}ns{id}\"\n\n{LINKS}"), 1),
    )
}

fn require_netns() {
    troupe::netns::preflight().unwrap_or_else(|e| panic!("this test needs network namespaces: {e:#}"));
}

/// Namespaces, bridges and `/run/netns` are machine-wide: the tests here make them one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coe_across_namespaces_gives_the_loopback_digests() {
    require_netns();
    let _serial = SERIAL.lock().await;
    let tmp = tempfile::tempdir().unwrap();
    let app = tmp.path().join("app");
    let a = app.to_str().unwrap();
    troupe_tests::coe_gen(EXE.as_ref(), &app, &["--scale", "ci", "--seed", "5", "--no-single-model"])
        .unwrap();
    troupe_tests::run_ok(EXE.as_ref(), &["coe", "profile", "--dir", a]).unwrap();
    let text = std::fs::read_to_string(examples().join("coe.toml")).unwrap();
    // the example's set-up steps make .cache/coe/ci; this test made its own app instead
    let text =
        text.split("[[prepare]]")
            .enumerate()
            .map(|(i, part)| {
                if i == 0 { part.to_owned() } else { part.split_once("\n\n").map_or("", |x| x.1).to_owned() }
            })
            .collect::<String>();
    let mut results = Vec::new();
    let (looped, namespaced) = pair(&text, "coe", "coe");
    for (i, (topo, netns)) in [(looped, false), (namespaced, true)].into_iter().enumerate() {
        let out = tmp.path().join(format!("results-{i}.txt"));
        let journal = tmp.path().join(format!("journal-{i}"));
        let topo = topo
            .replace(".cache/coe/ci/results-up.txt", out.to_str().unwrap())
            .replace(".cache/coe/ci", a)
            .replace("policy = \"ours\"", &format!("policy = \"ours\", journal = \"{}\"", journal.display()));
        assert!(topo.contains("journal = "), "the example's job line changed:\n{topo}");
        let path = tmp.path().join(format!("coe-{i}.toml"));
        std::fs::write(&path, topo).unwrap();
        let log = up(&path, &tmp.path().join(format!("w{i}")), netns, Duration::from_secs(300)).await;
        let text = std::fs::read_to_string(&out).unwrap_or_else(|e| panic!("{}: {e}\n{log}", out.display()));
        results.push(troupe_tests::parse_coe_results(&text).unwrap());
    }
    assert!(!results[0].is_empty(), "the loopback run answered nothing");
    assert_eq!(results[1].len(), results[0].len(), "every request answered once across namespaces");
    assert_eq!(results[1], results[0], "digests across namespaces (40 ms, 1% loss) equal the loopback run's");
}

/// Reads a pipeline outputs file: per row, its input index and its sentence embedding.
fn read_outputs(out: &Path, log: &str) -> Vec<(u64, Vec<f64>)> {
    let text = std::fs::read_to_string(out).unwrap_or_else(|e| panic!("{}: {e}\n{log}", out.display()));
    text.lines()
        .map(|l| {
            let row: serde_json::Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}"));
            let input = row["input"].as_u64().unwrap_or_else(|| panic!("no input in {l}"));
            let v = row["sentence_embedding"]
                .as_array()
                .unwrap_or_else(|| panic!("no sentence_embedding in row {input}"))
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect();
            (input, v)
        })
        .collect()
}

/// Hard-links the MiniLM stage files of `scripts/setup` into each worker cache under the names a
/// worker gives a pulled stage (`<sha256>.onnx`), so that no run pulls a stage.
fn seed_stage_caches(caches: &[PathBuf]) {
    let assets = Assets::locate().unwrap_or_else(|e| panic!("the setup cache: {e}"));
    let manifest = assets.path(MINILM_SPLIT).unwrap_or_else(|e| panic!("the MiniLM split manifest: {e}"));
    let split: serde_json::Value = serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
    let stages = split["stages"].as_array().unwrap_or_else(|| panic!("no stages in {}", manifest.display()));
    assert_eq!(stages.len(), MINILM_STAGES.len(), "{} lists other stages", manifest.display());
    for cache in caches {
        std::fs::create_dir_all(cache).unwrap();
        for (stage, name) in stages.iter().zip(MINILM_STAGES) {
            assert!(
                name.ends_with(stage["file"].as_str().unwrap_or("?")),
                "{} names {name} otherwise",
                manifest.display()
            );
            let from = assets.path(name).unwrap_or_else(|e| panic!("{name}: {e}"));
            let to = troupe_actors::pipeline::worker::cached_path(cache, stage["sha256"].as_str().unwrap());
            std::fs::hard_link(&from, &to)
                .or_else(|_| std::fs::copy(&from, &to).map(|_| ()))
                .unwrap_or_else(|e| panic!("seeding {}: {e}", to.display()));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipeline_across_namespaces_gives_the_loopback_embeddings() {
    require_netns();
    let _serial = SERIAL.lock().await;
    let tmp = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(examples().join("pipeline.toml")).unwrap();
    let inputs = examples().join("pipeline-sentences.txt").canonicalize().unwrap();
    let (looped, namespaced) = pair(&text, "pipeline", "pipe");
    let caches: Vec<PathBuf> = (1..=5).map(|w| tmp.path().join(format!("cache{w}"))).collect();
    seed_stage_caches(&caches);
    let mut outputs = Vec::new();
    for (i, (topo, netns)) in [(looped, false), (namespaced, true)].into_iter().enumerate() {
        let dir = tmp.path().join(format!("run{i}"));
        let (out, journal) = (dir.join("out.jsonl"), dir.join("foreman.journal"));
        // outputs and journal in this run's folder; each worker's stage cache is seeded with
        // every stage and shared by both runs, so the namespaced run moves activations, not the
        // model's stage files (cold, a 47 MB stage takes ~45 s over a 1%-loss 40 ms link)
        let mut topo = topo.replace(
            "inputs = \"examples/pipeline-sentences.txt\"",
            &format!(
                "inputs = \"{}\", out = \"{}\", journal = \"{}\"",
                inputs.display(),
                out.display(),
                journal.display()
            ),
        );
        for w in 1..=5 {
            topo = topo.replacen(
                "params = { ram_budget_mb",
                &format!("params = {{ cache_dir = \"{}\", ram_budget_mb", caches[w - 1].display()),
                1,
            );
        }
        assert!(
            topo.contains(&format!("out = \"{}\"", out.display())),
            "the example's job line changed:\n{topo}"
        );
        let path = tmp.path().join(format!("pipeline-{i}.toml"));
        std::fs::write(&path, topo).unwrap();
        let log = up(&path, &dir.join("w"), netns, Duration::from_secs(300)).await;
        outputs.push(read_outputs(&out, &log));
    }
    let n = outputs[0].len();
    assert!(n > 0, "the loopback run answered nothing");
    for (run, rows) in outputs.iter().enumerate() {
        let ids: Vec<u64> = rows.iter().map(|(i, _)| *i).collect();
        assert_eq!(ids, (0..n as u64).collect::<Vec<_>>(), "run {run}: one row per input, in order");
    }
    let mut worst = 0.0f64;
    for ((_, a), (_, b)) in outputs[0].iter().zip(&outputs[1]) {
        assert_eq!(a.len(), b.len());
        worst = a.iter().zip(b).fold(worst, |m, (x, y)| m.max((x - y).abs()));
    }
    eprintln!("pipeline across namespaces vs loopback: max abs difference {worst:e}");
    assert!(worst <= 1e-5, "embeddings across namespaces differ from the loopback run's: max abs {worst}");
}

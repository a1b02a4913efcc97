//! Durable acceptance of a pipeline job: the foreman's node is killed with SIGKILL mid-job, a
//! torn record is appended to its journal (a crash in the middle of a write), and the node is
//! started again. The damage is named, the job resumes from the journal with only the
//! unanswered inputs, every input is answered exactly once and the outputs equal the whole
//! model's. Real node processes on loopback QUIC, real MiniLM stages.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::Duration;

use troupe_tests::LineCluster;
use troupe_tests::pipeline::{sentences, whole_model};

const EXE: &str = env!("CARGO_BIN_EXE_troupe-node");
const FINISHED: &str = "[foreman] pipeline: results written to";

fn topology(tmp: &Path, inputs: &Path, out: &Path, journal: &Path) -> String {
    let worker = |name: &str| {
        format!(
            "[[nodes]]\nname = \"{name}\"\nactors = [{{ kind = \"pipeline-worker\", params = {{ cache_dir = \"{}\" }} }}]\n",
            tmp.join("cache").join(name).display()
        )
    };
    format!(
        r#"name = "pipeline-foreman-kill"
[membership]
heartbeat_ms = 100
timeout_ms = 1500

[[nodes]]
name = "foreman"
job = {{ kind = "pipeline", timeout_s = 150, params = {{ inputs = "{}", out = "{}", journal = "{}", workers = 2, telemetry_ms = 200 }} }}

{}
{}"#,
        inputs.display(),
        out.display(),
        journal.display(),
        worker("phone-1"),
        worker("phone-2"),
    )
}

/// Reads the outputs file: per row, its input index and its sentence embedding.
fn read_outputs(out: &Path, log: &str) -> Vec<(u64, Vec<f32>)> {
    let text = std::fs::read_to_string(out).unwrap_or_else(|e| panic!("{}: {e}\n{log}", out.display()));
    text.lines()
        .map(|l| {
            let row: serde_json::Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}"));
            let input = row["input"].as_u64().unwrap_or_else(|| panic!("no input in {l}"));
            let v = row["sentence_embedding"]
                .as_array()
                .unwrap_or_else(|| panic!("no sentence_embedding in row {input}"))
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect();
            (input, v)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreman_node_killed_mid_job_resumes_from_its_journal_and_answers_each_input_once() {
    let tmp = tempfile::tempdir().unwrap();
    let inputs: Vec<String> = (0..20).flat_map(|_| sentences()).collect();
    let inputs_file = tmp.path().join("inputs.txt");
    std::fs::write(&inputs_file, inputs.join("\n")).unwrap();
    let (out, journal) = (tmp.path().join("out.jsonl"), tmp.path().join("journal").join("foreman.journal"));
    let topo = tmp.path().join("topology.toml");
    std::fs::write(&topo, topology(tmp.path(), &inputs_file, &out, &journal)).unwrap();
    let mut c =
        LineCluster::start(Path::new(EXE), &topo, &tmp.path().join("up")).expect("starting the cluster");

    let at20 = c
        .wait_line(Duration::from_secs(120), |l| {
            l.starts_with("[foreman] pipeline: 20 of ") && l.ends_with("inputs answered")
        })
        .await;
    assert!(at20.is_some(), "the job never reached 20 answers:\n{}", c.text());
    c.kill9("foreman").await.unwrap();
    let mut bytes = std::fs::read(&journal).expect("the foreman journaled its answers");
    bytes.extend_from_slice(&[40, 0, 0, 0, 1, 2, 3]);
    std::fs::write(&journal, &bytes).unwrap();
    c.restart("foreman").unwrap();

    let done = c.wait_line(Duration::from_secs(150), |l| l.starts_with(FINISHED)).await;
    let log = c.text();
    assert!(done.is_some(), "the restarted foreman did not finish:\n{log}");
    assert!(
        log.contains("damaged tail at byte") && log.contains("record header cut short"),
        "damage not named:\n{log}"
    );
    let resumed = log
        .lines()
        .find(|l| l.contains("pipeline: resuming from journal"))
        .unwrap_or_else(|| panic!("no resumption:\n{log}"));
    let answered: usize =
        resumed.split(": ").last().and_then(|s| s.split(' ').next()).unwrap().parse().unwrap();
    eprintln!("{resumed}");
    assert!(answered >= 20, "the journal kept the answers given before the kill: {resumed}");
    assert!(answered < inputs.len(), "work was left for the restarted foreman: {resumed}");

    let got = read_outputs(&out, &log);
    assert_eq!(got.len(), inputs.len(), "one row per input");
    assert!(got.iter().enumerate().all(|(i, (id, _))| *id == i as u64), "rows are inputs 0..n, once each");
    let whole = whole_model(&inputs);
    let mut worst = 0.0f32;
    for ((_, v), w) in got.iter().zip(&whole) {
        assert_eq!(v.len(), w.len());
        worst = v.iter().zip(w).fold(worst, |m, (a, b)| m.max((a - b).abs()));
    }
    assert!(worst <= 1e-5, "outputs differ from the whole model: max abs error {worst}");
    assert!(!journal.exists(), "a finished job removes its journal");
}

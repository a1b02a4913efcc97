//! One tree, three workloads: `troupe up examples/campus.toml` runs coe, pipeline and coadapt at
//! the same time on one cluster of seven node processes (edge and executors sharing nodes,
//! phones carrying a pipeline worker and a camera each), and exits 0 once all three jobs have
//! succeeded. Each workload's outputs are checked, not just its exit: every coe request
//! answered once, every pipeline embedding equal to the whole model's, every camera adapted,
//! and each job's summary table agrees with those outputs.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Command;

use troupe_tests::pipeline::whole_model;

const EXE: &str = env!("CARGO_BIN_EXE_troupe-node");

#[test]
fn the_campus_runs_all_three_workloads_on_one_cluster() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    // outputs of an earlier run must not stand in for this one's
    for f in [".cache/up/campus/coe-results.txt", ".cache/up/campus/pipeline-outputs.jsonl"] {
        let _ = std::fs::remove_file(root.join(f));
    }
    let out = Command::new(EXE)
        .current_dir(root)
        .args(["up", "examples/campus.toml", "--workdir"])
        .arg(tmp.path())
        .env("RUST_LOG", "warn")
        .output()
        .expect("running troupe up");
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "troupe up failed ({}):\n{log}", out.status);
    assert!(log.contains("[up] every job succeeded"), "{log}");

    // coe: every request once
    let coe = std::fs::read_to_string(root.join(".cache/up/campus/coe-results.txt")).unwrap();
    let ids: Vec<u64> =
        troupe_tests::parse_coe_results(&coe).unwrap().into_iter().map(|(id, _)| id).collect();
    assert!(
        !ids.is_empty() && ids.iter().enumerate().all(|(i, id)| *id == i as u64),
        "coe ids 0..n once each"
    );

    // pipeline: one row per sentence, equal to the whole model
    let sentences: Vec<String> = std::fs::read_to_string(root.join("examples/pipeline-sentences.txt"))
        .unwrap()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect();
    let rows = std::fs::read_to_string(root.join(".cache/up/campus/pipeline-outputs.jsonl")).unwrap();
    let whole = whole_model(&sentences);
    let rows: Vec<serde_json::Value> = rows.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), sentences.len(), "one row per sentence");
    for (i, (row, w)) in rows.iter().zip(&whole).enumerate() {
        assert_eq!(row["input"].as_u64(), Some(i as u64));
        let v: Vec<f32> = row["sentence_embedding"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        let err = v.iter().zip(w).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(v.len() == w.len() && err <= 1e-5, "input {i}: max abs error {err}");
    }

    // coadapt: each of the three cameras adapted
    for cam in ["phone-1", "phone-2", "phone-3"] {
        assert!(
            log.contains(&format!("coadapt: camera {cam} drift_frame")),
            "camera {cam} not adapted:\n{log}"
        );
    }
    assert!(log.contains("within_budget true"), "{log}");

    // each job ends with its summary table, agreeing with the outputs checked above
    let value = |title: &str, figure: &str| {
        troupe_tests::summary_value(&log, title, figure)
            .unwrap_or_else(|| panic!("no `{figure}` row in a `{title}` table:\n{log}"))
    };
    assert_eq!(value("coe job summary", "requests answered"), ids.len().to_string());
    assert_eq!(value("coe job summary", "executors lost"), "none");
    assert_eq!(value("pipeline job summary", "inputs answered"), format!("{0} of {0}", sentences.len()));
    let adapted =
        log.lines().filter(|l| l.contains("coadapt: camera ") && l.contains(" drift_frame ")).count();
    assert!(
        value("coadapt job summary", "adaptations").starts_with(&format!("{adapted} installed of ")),
        "{log}"
    );
    assert!(value("coadapt job summary", "pool peak").ends_with("(within budget)"), "{log}");
}

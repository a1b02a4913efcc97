//! A malformed stage file or a mismatched chain is refused, by the library and by the CLI,
//! before any task runs.

use std::path::Path;

use troupe::actors::pipeline::StageFile;
use troupe::policy::pipeline::Mode;
use troupe::workloads::pipeline::{load_job, minilm_stages};
use troupe_tests::pipeline::{SENTENCES, sentences, workdir};

fn exe() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_BIN_EXE_troupe-node"))
}

#[test]
fn broken_jobs_are_refused_before_any_task_runs() {
    let stages = minilm_stages().unwrap();
    // Stage 2 after stage 0: it needs stage 1's output (the cut setup's split chose), stage 0 does
    // not produce it.
    let cut1 = StageFile::from_path(&stages[1]).unwrap().signature.outputs[0].name.clone();
    let err =
        load_job(&[stages[0].clone(), stages[2].clone()], &sentences(), Mode::Streaming, false).unwrap_err();
    let text = format!("{err:#}");
    assert!(text.contains(&cut1) && text.contains("chain refused"), "{text}");

    let dir = workdir("malformed");
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("garbage.onnx");
    std::fs::write(&bad, b"this is not an onnx graph").unwrap();
    let err = load_job(&[stages[0].clone(), bad.clone()], &sentences(), Mode::Streaming, false).unwrap_err();
    let text = format!("{err:#}");
    assert!(text.contains("garbage.onnx") && text.contains("not a usable ONNX model"), "{text}");

    // The CLI refuses the same chain and starts nothing (no worker config, log or cache appears).
    let inputs = dir.join("inputs.txt");
    std::fs::write(&inputs, SENTENCES.join("\n")).unwrap();
    let run = dir.join("run");
    let out = std::process::Command::new(exe())
        .args(["pipeline", "submit", "--workers", "2", "--stages"])
        .arg(format!("{},{}", stages[0].display(), stages[2].display()))
        .arg("--inputs")
        .arg(&inputs)
        .arg("--workdir")
        .arg(&run)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&cut1), "{stderr}");
    assert!(!Path::new(&run).exists(), "a refused job must not start workers");
    let _ = std::fs::remove_dir_all(&dir);
}

//! `troupe pipeline split` on the real all-MiniLM-L6-v2 whole model from the setup cache: cut into
//! K = 2, 3, 4 stages balanced by weight bytes (K = 3 is what scripts/setup writes, byte for byte;
//! the named cuts hidden_2, hidden_5 too), the stages chained on ONNX Runtime give the whole
//! model's embeddings (<= 1e-5), and the written files pass the pipeline's chain check
//! (`StageFile::from_path` + `build_job`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use troupe::actors::pipeline::{StageFile, build_job};
use troupe::kernels::assets::{Assets, MINILM_SPLIT, MINILM_STAGES, MINILM_WHOLE};
use troupe::kernels::onnx::split::{CutPlan, Limits};
use troupe::kernels::onnx::{NamedTensor, OnnxSession, SessionConfig};
use troupe::policy::pipeline::Mode;
use troupe::workloads::pipeline::{SplitOutcome, split_to_dir, tokenize};
use troupe_tests::pipeline::{sentences, whole_model, workdir};

fn whole_path() -> PathBuf {
    Assets::locate().expect("setup cache").path(MINILM_WHOLE).expect("whole MiniLM in the setup cache")
}

/// Runs the stage files one after another on each input: every stage gets the graph inputs and
/// whatever the previous stages produced, by name.
fn chain(stages: &[PathBuf], inputs: &[Vec<NamedTensor>]) -> Vec<Vec<f32>> {
    let mut sessions: Vec<OnnxSession> = stages
        .iter()
        .map(|p| OnnxSession::from_file(p, &SessionConfig::default()).expect("stage loads in ONNX Runtime"))
        .collect();
    inputs
        .iter()
        .map(|input| {
            let mut have: HashMap<String, NamedTensor> =
                input.iter().map(|t| (t.name.clone(), t.clone())).collect();
            for s in &mut sessions {
                let feed: Vec<NamedTensor> = s
                    .inputs()
                    .iter()
                    .map(|spec| have.get(&spec.name).cloned().unwrap_or_else(|| panic!("no {}", spec.name)))
                    .collect();
                for t in s.run(&feed).expect("stage runs") {
                    have.insert(t.name.clone(), t);
                }
            }
            have["sentence_embedding"].as_f32().expect("f32 embedding").to_vec()
        })
        .collect()
}

fn max_abs(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut worst = 0f32;
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.len(), y.len());
        for (p, q) in x.iter().zip(y) {
            worst = worst.max((p - q).abs());
        }
    }
    worst
}

fn split_and_check(plan: CutPlan, dir: &Path) -> SplitOutcome {
    let done = split_to_dir(&whole_path(), &plan, dir, &Limits::default()).expect("split succeeds");
    println!("{plan:?}: {}", done.render().trim_end());
    // The existing chain check over the written files, with real inputs.
    let files: Vec<StageFile> =
        done.stages.iter().map(|p| StageFile::from_path(p).expect("stage file reads")).collect();
    build_job(files, tokenize(&sentences()).expect("tokenize"), Mode::Streaming, false)
        .expect("the written stages chain");
    // The manifest names every stage file with its checksum and size.
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&done.manifest).expect("manifest")).expect("manifest is JSON");
    let entries = manifest["stages"].as_array().expect("stages array");
    assert_eq!(entries.len(), done.stages.len());
    for (e, p) in entries.iter().zip(&done.stages) {
        let bytes = std::fs::read(p).expect("stage file");
        assert_eq!(e["file"].as_str(), p.file_name().and_then(|f| f.to_str()));
        assert_eq!(e["bytes"].as_u64(), Some(bytes.len() as u64));
        assert_eq!(e["sha256"].as_str().map(str::len), Some(64));
        assert!(e["inputs"].as_array().is_some_and(|a| !a.is_empty()));
    }
    done
}

#[test]
fn minilm_cut_into_2_3_4_stages_chains_to_the_whole_model() {
    let texts = sentences();
    let whole = whole_model(&texts);
    let inputs = tokenize(&texts).expect("tokenize");
    let total: u64 = {
        let d = workdir("split-k1");
        split_and_check(CutPlan::Balanced { stages: 1 }, &d).weight_bytes[0]
    };
    for k in [2usize, 3, 4] {
        let d = workdir(&format!("split-k{k}"));
        let done = split_and_check(CutPlan::Balanced { stages: k }, &d);
        assert_eq!(done.stages.len(), k);
        assert_eq!(done.cuts.len(), k - 1);
        // No weight is lost, and only the small shared constants (`one`, `half`, the head
        // shapes: a few dozen bytes each) are held by more than one stage.
        let sum: u64 = done.weight_bytes.iter().sum();
        assert!((total..=total + 1024).contains(&sum), "K = {k}: {:?} vs {total}", done.weight_bytes);
        // The largest stage is never below the word-embedding table (30522 x 384 f32), which no
        // cut can divide, and balance keeps every stage at or below it once K >= 2.
        let table = 30522 * 384 * 4;
        assert!(done.weight_bytes.iter().all(|&b| b <= table), "K = {k}: {:?}", done.weight_bytes);
        let err = max_abs(&chain(&done.stages, &inputs), &whole);
        println!("K = {k}: max abs error {err:e}");
        assert!(err <= 1e-5, "K = {k}: max abs error {err}");
    }
}

#[test]
fn setup_stages_are_troupes_own_split_and_named_cuts_still_work() {
    let texts = sentences();
    let inputs = tokenize(&texts).expect("tokenize");
    let assets = Assets::locate().expect("setup cache");
    let setup: Vec<PathBuf> =
        MINILM_STAGES.iter().map(|s| assets.path(s).expect("setup stage file")).collect();
    // scripts/setup cuts with `troupe pipeline split --stages 3`: the same call here writes the same
    // bytes (a stale cache, or stages cut by anything else, fails here).
    let d = workdir("split-setup");
    let done = split_and_check(CutPlan::Balanced { stages: 3 }, &d);
    assert_eq!(done.stages.len(), setup.len());
    for (ours, theirs) in done.stages.iter().zip(&setup) {
        let a = std::fs::read(ours).expect("ours");
        let b = std::fs::read(theirs).expect("setup's");
        assert!(a == b, "{} differs from setup's {}; run scripts/setup", ours.display(), theirs.display());
    }
    let setup_manifest = assets.path(MINILM_SPLIT).expect("setup's split manifest");
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(setup_manifest).expect("manifest")).expect("manifest is JSON");
    let cuts: Vec<&str> =
        manifest["cuts"].as_array().expect("cuts").iter().filter_map(|c| c.as_str()).collect();
    assert_eq!(cuts, done.cuts, "setup's minilm_split.json names other cuts");
    // Cutting at named tensors (the old Python cut's layer outputs) still chains to the whole model.
    let d = workdir("split-at");
    let at = split_and_check(CutPlan::At(vec!["hidden_2".into(), "hidden_5".into()]), &d);
    let err = max_abs(&chain(&at.stages, &inputs), &chain(&setup, &inputs));
    assert!(err <= 1e-5, "hidden_2/hidden_5 stages vs setup's stages: max abs error {err}");
    let err = max_abs(&chain(&setup, &inputs), &whole_model(&texts));
    assert!(err <= 1e-5, "setup's stages vs whole: max abs error {err}");
}

#[test]
fn split_refuses_more_stages_than_minilm_has_cuts_and_unknown_cut_names() {
    let d = workdir("split-refuse");
    let err = split_to_dir(&whole_path(), &CutPlan::Balanced { stages: 200 }, &d, &Limits::default())
        .expect_err("200 stages cannot be cut");
    assert!(err.to_string().contains("no valid cut for 200 stages"), "{err}");
    let err = split_to_dir(&whole_path(), &CutPlan::At(vec!["l3.ffn.in".into()]), &d, &Limits::default())
        .expect_err("a tensor with another activation beside it is no cut");
    assert!(err.to_string().contains("'l3.ffn.in' is not a valid cut"), "{err}");
    // Inside layer 0 the residual stream (the embeddings) depends on input_ids only, so after the
    // attention scores it looks like a side tensor; recomputing it would copy the 47 MB embedding
    // table into the next stage, so that position is no cut.
    let err = split_to_dir(&whole_path(), &CutPlan::At(vec!["l0.probs".into()]), &d, &Limits::default())
        .expect_err("a cut that would recompute the embeddings is refused");
    assert!(err.to_string().contains("'l0.probs' is not a valid cut"), "{err}");
    let limits = Limits { max_model_bytes: 1 << 20, max_external_bytes: 1 << 20 };
    let err = split_to_dir(&whole_path(), &CutPlan::Balanced { stages: 2 }, &d, &limits)
        .expect_err("a 90 MB model is above a 1 MiB cap");
    assert!(err.to_string().contains("above the 1048576-byte cap"), "{err}");
}

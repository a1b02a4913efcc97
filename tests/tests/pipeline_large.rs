//! A model where partitioning matters: all-mpnet-base-v2 (12 layers, hidden 768, ~435 MB of
//! weights, ~4.8x MiniLM), built by `scripts/setup --large` and cut there into 4 stages by
//! `troupe pipeline split --stages 4`. The stages chained on ONNX Runtime from Rust give the whole
//! model's embeddings (<= 1e-4), the whole model gives Python onnxruntime's (which setup checked
//! against a numpy forward pass of the original weights), the written files pass the pipeline's
//! chain check, and no stage holds more than 1.3/4 of the weights.
//!
//! Opt-in: the model is a ~404 MB download and ~1.3 GB on disk, so plain `scripts/setup` (and CI)
//! does not build it. Run: `scripts/setup --large && cargo test -p troupe-tests --test
//! pipeline_large -- --ignored`.

use std::collections::HashMap;
use std::path::PathBuf;

use troupe::actors::pipeline::{StageFile, build_job};
use troupe::kernels::assets::{
    Assets, LARGE_SETUP_HINT, MPNET_CHECK, MPNET_SPLIT, MPNET_STAGES, MPNET_WHOLE,
};
use troupe::kernels::onnx::{NamedTensor, OnnxSession, SessionConfig};
use troupe::policy::pipeline::Mode;

fn large(assets: &Assets, name: &str) -> PathBuf {
    assets.path(name).unwrap_or_else(|e| panic!("{e} (the large model: {LARGE_SETUP_HINT})"))
}

/// The recorded inputs (one batch: ids and mask `[B,S]`) and Python onnxruntime's embeddings.
fn reference(assets: &Assets) -> (Vec<NamedTensor>, Vec<f32>, usize) {
    let path = large(assets, MPNET_CHECK);
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).expect("mpnet_check.json reads")).expect("JSON");
    let rows = |key: &str| -> Vec<Vec<i64>> {
        serde_json::from_value(json[key].clone()).unwrap_or_else(|e| panic!("{}: {key}: {e}", path.display()))
    };
    let (ids, mask) = (rows("ids"), rows("attention_mask"));
    let shape = vec![ids.len(), ids[0].len()];
    let embeddings: Vec<f32> = serde_json::from_value(json["embeddings"].clone()).expect("embeddings");
    let dim = json["embedding_dim"].as_u64().expect("embedding_dim") as usize;
    let inputs = vec![
        NamedTensor::i64("input_ids", shape.clone(), ids.concat()),
        NamedTensor::i64("attention_mask", shape, mask.concat()),
    ];
    (inputs, embeddings, dim)
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
#[ignore = "needs scripts/setup --large: all-mpnet-base-v2 is a ~404 MB download and ~1.3 GB on disk, opt-in"]
fn mpnet_cut_into_4_stages_chains_to_the_whole_model() {
    let assets = Assets::locate().expect("setup cache");
    let (inputs, python, dim) = reference(&assets);
    let cfg = SessionConfig::default();

    let mut whole = OnnxSession::from_file(&large(&assets, MPNET_WHOLE), &cfg).expect("whole model loads");
    let outs = whole.run(&inputs).expect("whole model runs");
    let whole_emb = outs.iter().find(|t| t.name == "sentence_embedding").expect("sentence_embedding");
    assert_eq!(whole_emb.shape, vec![inputs[0].shape[0], dim]);
    let whole_emb = whole_emb.as_f32().expect("f32").to_vec();
    println!("whole: {:?}", whole.memory());
    drop(whole);
    let err = max_abs(&whole_emb, &python);
    println!("whole (Rust) vs Python onnxruntime: max abs error {err:e}");
    assert!(err <= 1e-5, "whole (Rust) vs Python onnxruntime: max abs error {err}");

    // One stage session alive at a time, like a pipeline worker; each stage is fed by its input
    // names from the job's inputs and what the stage before it produced.
    let stages: Vec<PathBuf> = MPNET_STAGES.iter().map(|s| large(&assets, s)).collect();
    let mut have: HashMap<String, NamedTensor> = inputs.iter().map(|t| (t.name.clone(), t.clone())).collect();
    for (k, path) in stages.iter().enumerate() {
        let mut s = OnnxSession::from_file(path, &cfg).expect("stage loads");
        let feed: Vec<NamedTensor> = s
            .inputs()
            .iter()
            .map(|spec| {
                have.get(&spec.name).cloned().unwrap_or_else(|| panic!("stage {k} needs {}", spec.name))
            })
            .collect();
        for t in s.run(&feed).expect("stage runs") {
            have.insert(t.name.clone(), t);
        }
        println!("stage {k}: {:?}", s.memory());
    }
    let chained = have["sentence_embedding"].as_f32().expect("f32 embedding");
    let err = max_abs(chained, &whole_emb);
    println!("chained ({} stages) vs whole: max abs error {err:e}", stages.len());
    assert!(err <= 1e-4, "chained vs whole: max abs error {err}");

    // The pipeline's own chain check accepts the files with the job's inputs.
    let files: Vec<StageFile> = stages.iter().map(|p| StageFile::from_path(p).expect("stage file")).collect();
    build_job(files, vec![inputs], Mode::Streaming, false).expect("the stages chain");

    // Partitioning matters: every stage holds at most 1.3/4 of the weights (the embedding table,
    // 30527 x 768 f32 = 94 MB, is a fifth of them and shares stage 0 with a layer).
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(large(&assets, MPNET_SPLIT)).expect("split manifest"))
            .expect("split manifest is JSON");
    let weights: Vec<u64> = manifest["stages"]
        .as_array()
        .expect("stages")
        .iter()
        .map(|s| s["weight_bytes"].as_u64().expect("weight_bytes"))
        .collect();
    assert_eq!(weights.len(), 4, "{weights:?}");
    let total: u64 = weights.iter().sum();
    let worst = weights.iter().copied().max().unwrap_or(0);
    println!("stage weight bytes {weights:?}, largest / total {:.3}", worst as f64 / total as f64);
    assert!(total > 400_000_000, "all-mpnet-base-v2 has ~435 MB of weights, the stages {total}");
    assert!((worst as f64) <= 1.3 / 4.0 * total as f64, "{weights:?}");
}

//! The 3 MiniLM stage files (cut by `troupe pipeline split` in setup) chained from Rust equal the whole model, and the stage IO fits together.
//! Needs `scripts/setup` (fails with "run scripts/setup" otherwise).
#![cfg(feature = "onnx")]
#![allow(clippy::unwrap_used)] // test helpers: a panic is the failure report

use troupe_kernels::assets::{self, Assets};
use troupe_kernels::onnx::{
    ElementType, IoSpec, NamedTensor, OnnxSession, SessionConfig, check_chain, check_chain_with,
};

fn assets() -> Assets {
    Assets::locate().unwrap_or_else(|e| panic!("{e}"))
}

/// ids, mask, batch, seq and the Python onnxruntime embeddings recorded by setup.
struct Reference {
    ids: Vec<i64>,
    mask: Vec<i64>,
    batch: usize,
    seq: usize,
    embeddings: Vec<f32>,
}

fn reference(a: &Assets) -> Reference {
    let text = std::fs::read_to_string(a.path(assets::MINILM_CHECK).unwrap()).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let rows = |key: &str| -> Vec<Vec<i64>> { serde_json::from_value(json[key].clone()).unwrap() };
    let (ids, mask) = (rows("ids"), rows("attention_mask"));
    let embeddings: Vec<f32> = serde_json::from_value(json["embeddings"].clone()).unwrap();
    Reference { batch: ids.len(), seq: ids[0].len(), ids: ids.concat(), mask: mask.concat(), embeddings }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn output<'a>(outs: &'a [NamedTensor], name: &str) -> &'a NamedTensor {
    outs.iter().find(|t| t.name == name).unwrap()
}

#[test]
fn chained_stages_equal_whole_model() {
    let a = assets();
    let r = reference(&a);
    let cfg = SessionConfig::default();
    let shape = vec![r.batch, r.seq];
    let ids = NamedTensor::i64("input_ids", shape.clone(), r.ids.clone());
    let mask = NamedTensor::i64("attention_mask", shape, r.mask.clone());

    let mut whole = OnnxSession::from_file(&a.path(assets::MINILM_WHOLE).unwrap(), &cfg).unwrap();
    let outs = whole.run(&[ids.clone(), mask.clone()]).unwrap();
    let whole_emb = output(&outs, "sentence_embedding");
    assert_eq!(whole_emb.shape, vec![r.batch, 384]);
    let whole_emb = whole_emb.as_f32().unwrap().to_vec();
    println!("whole: {:?}", whole.memory());
    drop(whole);

    // One stage session alive at a time, like a pipeline worker. Each stage takes, by name, the graph
    // inputs and what earlier stages produced (setup cuts where `troupe pipeline split --stages 3` does).
    let mut have = vec![ids, mask];
    for (k, file) in assets::MINILM_STAGES.iter().enumerate() {
        let mut stage = OnnxSession::from_file(&a.path(file).unwrap(), &cfg).unwrap();
        let feed: Vec<NamedTensor> = stage
            .inputs()
            .iter()
            .map(|spec| have.iter().find(|t| t.name == spec.name).cloned().unwrap())
            .collect();
        let outs = stage.run(&feed).unwrap();
        println!("stage{k}: {:?}", stage.memory());
        have.extend(outs);
    }
    let chained = output(&have, "sentence_embedding").as_f32().unwrap();
    let err = max_abs_diff(chained, &whole_emb);
    println!("chained vs whole max abs err {err:e}");
    assert!(err <= 1e-5, "chained vs whole max abs err {err}");
    let err_py = max_abs_diff(&whole_emb, &r.embeddings);
    println!("whole (Rust) vs Python onnxruntime max abs err {err_py:e}");
    assert!(err_py <= 1e-5, "Rust vs Python max abs err {err_py}");
}

#[test]
fn stage_io_introspection_and_chain_check() {
    let a = assets();
    let cfg = SessionConfig::default();
    let stages: Vec<OnnxSession> = assets::MINILM_STAGES
        .iter()
        .map(|f| OnnxSession::from_file(&a.path(f).unwrap(), &cfg).unwrap())
        .collect();
    let s0 = &stages[0];
    let input_names: Vec<&str> = s0.inputs().iter().map(|s| s.name.as_str()).collect();
    assert!(input_names.contains(&"input_ids"), "{input_names:?}");
    assert!(input_names.iter().all(|n| ["input_ids", "attention_mask"].contains(n)), "{input_names:?}");
    assert!(s0.inputs().iter().all(|s| s.dtype == ElementType::I64 && s.rank() == 2));
    // Stages 0 and 1 each hand on one f32 activation [batch, seq, 384]; the last one the embedding.
    for s in &stages[..2] {
        let out = s.outputs();
        assert_eq!(out.len(), 1, "{out:?}");
        assert_eq!(out[0].dtype, ElementType::F32);
        assert_eq!(out[0].dims, vec![None, None, Some(384)], "{}", out[0].name);
    }
    assert_eq!(stages[2].outputs()[0].name, "sentence_embedding");
    assert_eq!(stages[2].outputs()[0].dims, vec![None, Some(384)]);
    let cut1 = stages[1].outputs()[0].name.clone();

    let all: Vec<&OnnxSession> = stages.iter().collect();
    let job: Vec<IoSpec> = ["input_ids", "attention_mask"]
        .map(|name| IoSpec { name: name.into(), dtype: ElementType::I64, dims: vec![None, None] })
        .into();
    check_chain_with(&all, &job).unwrap();
    // Stage 0 (the embedding table) reads input_ids only, so stage 0's inputs alone are not the
    // job's: attention_mask comes from the job, and the plain check says so.
    if !input_names.contains(&"attention_mask") {
        let err = check_chain(&all).unwrap_err().to_string();
        assert!(err.contains("attention_mask"), "{err}");
    }
    let err = check_chain_with(&[&stages[0], &stages[2]], &job).unwrap_err().to_string();
    assert!(err.contains(&cut1) && err.contains("stage 1"), "{err}");
    let cut0 = &stages[0].outputs()[0].name;
    let err = check_chain_with(&[&stages[1], &stages[0]], &job).unwrap_err().to_string();
    assert!(err.contains(cut0.as_str()) && err.contains("stage 0"), "{err}");
    let err = check_chain_with(&all, &job[1..]).unwrap_err().to_string();
    assert!(err.contains("input_ids") && err.contains("does not provide"), "{err}");
}

/// A pipeline worker's lean sessions (no CPU arena, no memory pattern) give the default
/// sessions' outputs bit for bit, stage by stage.
#[test]
fn lean_sessions_give_the_same_bits() {
    let a = assets();
    let r = reference(&a);
    let shape = vec![r.batch, r.seq];
    let inputs = vec![
        NamedTensor::i64("input_ids", shape.clone(), r.ids.clone()),
        NamedTensor::i64("attention_mask", shape, r.mask.clone()),
    ];
    let chain = |cfg: &SessionConfig| -> Vec<NamedTensor> {
        let mut have = inputs.clone();
        for file in assets::MINILM_STAGES {
            let mut stage = OnnxSession::from_file(&a.path(file).unwrap(), cfg).unwrap();
            let feed: Vec<NamedTensor> = stage
                .inputs()
                .iter()
                .map(|spec| have.iter().find(|t| t.name == spec.name).cloned().unwrap())
                .collect();
            have.extend(stage.run(&feed).unwrap());
        }
        have
    };
    let plain = chain(&SessionConfig::default());
    let lean = chain(&SessionConfig::lean(1));
    assert_eq!(plain.len(), lean.len());
    for (p, l) in plain.iter().zip(&lean) {
        assert_eq!(p, l, "{}: lean session outputs differ", p.name);
    }
}

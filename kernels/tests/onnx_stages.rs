//! The 3 MiniLM stage files chained from Rust equal the whole model, and the stage IO fits together.
//! Needs `scripts/setup` (fails with "run scripts/setup" otherwise).

#![allow(clippy::unwrap_used)] // test helpers: a panic is the failure report

use troupe_kernels::assets::{self, Assets};
use troupe_kernels::onnx::{ElementType, NamedTensor, OnnxSession, SessionConfig, check_chain};

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

    // One stage session alive at a time, like a pipeline worker.
    let mut carried = vec![ids, mask.clone()];
    let cuts = ["hidden_2", "hidden_5", "sentence_embedding"];
    for (k, (file, cut)) in assets::MINILM_STAGES.iter().zip(cuts).enumerate() {
        let mut stage = OnnxSession::from_file(&a.path(file).unwrap(), &cfg).unwrap();
        let outs = stage.run(&carried).unwrap();
        println!("stage{k}: {:?}", stage.memory());
        let next = output(&outs, cut).clone();
        carried = vec![next, mask.clone()];
    }
    let chained = carried[0].as_f32().unwrap();
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
    assert_eq!(input_names, ["input_ids", "attention_mask"]);
    assert!(s0.inputs().iter().all(|s| s.dtype == ElementType::I64 && s.rank() == 2));
    let h2 = &s0.outputs()[0];
    assert_eq!((h2.name.as_str(), &h2.dtype), ("hidden_2", &ElementType::F32));
    assert_eq!(h2.dims, vec![None, None, Some(384)]);
    assert_eq!(stages[1].outputs()[0].name, "hidden_5");
    assert_eq!(stages[2].outputs()[0].dims, vec![None, Some(384)]);

    let all: Vec<&OnnxSession> = stages.iter().collect();
    check_chain(&all).unwrap();
    let err = check_chain(&[&stages[0], &stages[2]]).unwrap_err().to_string();
    assert!(err.contains("hidden_5") && err.contains("stage 1"), "{err}");
    let err = check_chain(&[&stages[1], &stages[0]]).unwrap_err().to_string();
    assert!(err.contains("input_ids"), "{err}");
}

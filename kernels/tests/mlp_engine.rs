//! The MLP engine on the CPU against ONNX Runtime on the same written expert, and its refusals.
//! Needs ONNX Runtime (`scripts/setup`); the GPU side is in `cuda_vs_cpu.rs`.
#![cfg(feature = "onnx")]
#![allow(clippy::unwrap_used)] // test helpers: a panic is the failure report

use troupe_kernels::Device;
use troupe_kernels::mlp_engine::{MlpEngine, MlpEngineError};
use troupe_kernels::onnx::mlp_graph::{MlpGraphError, MlpLimits};
use troupe_kernels::onnx::writer::{DenseLayer, mlp_forward, mlp_model};
use troupe_kernels::onnx::{NamedTensor, OnnxSession, SessionConfig};

/// A dense layer with deterministic, sign-mixed weights.
fn layer(inputs: usize, outputs: usize, seed: u32) -> DenseLayer {
    let val = |i: usize| {
        let h = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed.wrapping_mul(40_503));
        ((h >> 8) % 2001) as f32 / 1000.0 - 1.0
    };
    DenseLayer {
        inputs,
        outputs,
        weights: (0..inputs * outputs).map(|i| val(i) * 0.3).collect(),
        bias: (0..outputs).map(|i| val(i + 7) * 0.1).collect(),
    }
}

fn inputs(batch: usize, width: usize) -> Vec<f32> {
    (0..batch * width).map(|i| ((i * 7919) % 113) as f32 / 56.0 - 1.0).collect()
}

#[test]
fn cpu_engine_matches_onnx_runtime_on_an_expert() {
    // The coe experts' shape: 64 inputs, hidden layers, a softmax over the classes.
    let layers = vec![layer(64, 96, 1), layer(96, 48, 2), layer(48, 10, 3)];
    let bytes = mlp_model(&layers, "x", "probs").unwrap();
    let engine = MlpEngine::from_onnx(&bytes, &MlpLimits::default(), &Device::Cpu).unwrap();
    assert_eq!((engine.inputs(), engine.outputs(), engine.depth()), (64, 10, 3));
    assert_eq!(engine.weight_bytes(), layers.iter().map(DenseLayer::param_bytes).sum::<u64>());
    let mut session = OnnxSession::from_bytes(&bytes, "expert", &SessionConfig::default()).unwrap();
    for batch in [1, 7, 32] {
        let x = inputs(batch, 64);
        let want = session.run(&[NamedTensor::f32("x", vec![batch, 64], x.clone())]).unwrap();
        let want = want[0].as_f32().unwrap();
        let got = engine.run(&x, batch).unwrap();
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= 1e-5, "batch {batch} [{i}]: engine {g} vs onnx runtime {w}");
        }
        // And the plain-Rust reference agrees too; rows differ (the test can tell inputs apart).
        let reference = mlp_forward(&layers, &x, batch);
        assert!(got.iter().zip(&reference).all(|(g, r)| (g - r).abs() <= 1e-5));
        if batch > 1 {
            assert_ne!(&got[..10], &got[10..20]);
        }
    }
}

#[test]
fn engine_refuses_a_foreign_graph_and_a_wrong_batch() {
    let bytes = mlp_model(&[layer(4, 3, 1)], "x", "y").unwrap();
    let engine = MlpEngine::from_onnx(&bytes, &MlpLimits::default(), &Device::Cpu).unwrap();
    let e = engine.run(&[0.0; 7], 2).unwrap_err().to_string();
    assert!(e.contains("7 inputs"), "{e}");
    let capped = MlpLimits { max_model_bytes: 10, ..MlpLimits::default() };
    match MlpEngine::from_onnx(&bytes, &capped, &Device::Cpu) {
        Err(MlpEngineError::Graph(MlpGraphError::TooLarge { cap: 10, .. })) => {}
        other => panic!("expected the size cap, got {other:?}"),
    }
}

#[test]
fn logits_model_without_softmax_matches_onnx_runtime() {
    use prost::Message;
    use troupe_kernels::onnx::proto::ModelProto;
    let layers = vec![layer(16, 12, 4), layer(12, 6, 5)];
    let mut m = ModelProto::decode(mlp_model(&layers, "x", "probs").unwrap().as_slice()).unwrap();
    let g = m.graph.as_mut().unwrap();
    assert_eq!(g.node.pop().and_then(|n| n.op_type).as_deref(), Some("Softmax"));
    g.output[0].name = Some("y1".into());
    let bytes = m.encode_to_vec();
    let engine = MlpEngine::from_onnx(&bytes, &MlpLimits::default(), &Device::Cpu).unwrap();
    let mut session = OnnxSession::from_bytes(&bytes, "logits", &SessionConfig::default()).unwrap();
    let x = inputs(4, 16);
    let want = session.run(&[NamedTensor::f32("x", vec![4, 16], x.clone())]).unwrap();
    let got = engine.run(&x, 4).unwrap();
    let want = want[0].as_f32().unwrap();
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() <= 1e-5, "engine {g} vs onnx runtime {w}");
    }
    // Logits are not distributions: some row does not sum to 1.
    assert!(got.chunks(6).any(|r| (r.iter().sum::<f32>() - 1.0).abs() > 1e-3));
}

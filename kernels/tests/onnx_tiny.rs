//! Tiny models with known weights, the digits MLP on the digits data, sessions from bytes. Needs
//! `scripts/setup`.
#![cfg(feature = "onnx")]
#![allow(clippy::unwrap_used)] // test helpers: a panic is the failure report

use troupe_kernels::assets::{self, Assets};
use troupe_kernels::onnx::{ElementType, NamedTensor, OnnxSession, SessionConfig};

fn assets() -> Assets {
    Assets::locate().unwrap_or_else(|e| panic!("{e}"))
}

/// The tiny MLP's formula (scripts/tools/make_tiny.py), evaluated directly.
fn tiny_mlp_reference(x: &[f32]) -> Vec<f32> {
    let mut y = Vec::new();
    for row in x.chunks(4) {
        let h: Vec<f32> = (0..3)
            .map(|j| {
                let z: f32 = (0..4).map(|i| row[i] * (0.1 * (i as f32 + 1.0) - 0.2 * j as f32)).sum();
                (z + 0.05 * j as f32 - 0.1).max(0.0)
            })
            .collect();
        for (k, b2) in [0.5f32, -0.25].into_iter().enumerate() {
            let sign = if k == 0 { 1.0 } else { -1.0 };
            y.push((0..3).map(|j| h[j] * 0.3 * (j as f32 + 1.0) * sign).sum::<f32>() + b2);
        }
    }
    y
}

#[test]
fn tiny_mlp_matches_its_formula_from_file_and_bytes() {
    let a = assets();
    let path = a.path(assets::TINY_MLP).unwrap();
    let x = vec![1.0, 2.0, 3.0, 4.0, -1.0, 0.5, 2.0, -3.0, 0.25, -0.5, 0.75, 1.0];
    let want = tiny_mlp_reference(&x);
    // hand-checked first row: h = relu([2.9, 0.95, -1.0]) -> y = [0.87+0.57+0.5, -(0.87+0.57)-0.25]
    assert!((want[0] - 1.94).abs() < 1e-5 && (want[1] + 1.69).abs() < 1e-5);
    let input = [NamedTensor::f32("x", vec![3, 4], x)];

    let mut from_file = OnnxSession::from_file(&path, &SessionConfig::default()).unwrap();
    assert_eq!(from_file.inputs()[0].dims, vec![None, Some(4)]);
    assert_eq!(from_file.outputs()[0].dtype, ElementType::F32);
    let y = from_file.run(&input).unwrap();
    assert_eq!((y[0].name.as_str(), &y[0].shape), ("y", &vec![3, 2]));
    let bytes = std::fs::read(&path).unwrap();
    let mut from_bytes = OnnxSession::from_bytes(
        &bytes,
        "tiny_mlp bytes",
        &SessionConfig { intra_threads: 2, ..SessionConfig::default() },
    )
    .unwrap();
    let y2 = from_bytes.run(&input).unwrap();
    for got in [&y[0], &y2[0]] {
        for (g, w) in got.as_f32().unwrap().iter().zip(&want) {
            assert!((g - w).abs() < 1e-5, "{g} vs {w}");
        }
    }
}

#[test]
fn int64_in_and_out() {
    let a = assets();
    let mut s =
        OnnxSession::from_file(&a.path(assets::TINY_INT).unwrap(), &SessionConfig::default()).unwrap();
    let ids = vec![0i64, 1, -7, 1 << 40];
    let out = s.run(&[NamedTensor::i64("ids", vec![4], ids.clone())]).unwrap();
    let want: Vec<i64> = ids.iter().map(|v| 2 * v + 1).collect();
    assert_eq!(out[0].as_i64().unwrap(), &want[..]);
}

#[test]
fn digits_mlp_classifies_the_digits_file() {
    let a = assets();
    let digits = a.digits().unwrap();
    assert_eq!((digits.len(), digits.rows, digits.cols), (1797, 8, 8));
    let mut per_class = [0usize; 10];
    digits.labels.iter().for_each(|&l| per_class[l as usize] += 1);
    assert!(per_class.iter().all(|&n| (170..=185).contains(&n)), "{per_class:?}");
    let x: Vec<f32> = digits.pixels.iter().map(|&p| f32::from(p) / 16.0).collect();
    let mut s =
        OnnxSession::from_file(&a.path(assets::DIGITS_MLP).unwrap(), &SessionConfig::default()).unwrap();
    let probs = s.run(&[NamedTensor::f32("x", vec![digits.len(), 64], x)]).unwrap();
    let probs = probs[0].as_f32().unwrap();
    let correct = probs
        .chunks(10)
        .zip(&digits.labels)
        .filter(|&(p, &l)| {
            let best = p.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i);
            best == Some(l as usize)
        })
        .count();
    let acc = correct as f64 / digits.len() as f64;
    println!("digits MLP accuracy on all 1797 images: {acc:.3}");
    // trained on 70% of these images with test accuracy ~0.98
    assert!(acc > 0.95, "accuracy {acc}");
}

#[test]
fn manifest_checksums_hold() {
    let a = assets();
    assert!(a.files().count() >= 15);
    a.verify_all().unwrap();
}

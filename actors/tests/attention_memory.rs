//! The memory estimator's `T^2` term has something real to measure: the attention temporaries that
//! the co-adaptation pool records in real adaptation steps, over models with 16, 64 and 256 tokens
//! per image, fit `M_tmp = B_p (θ1 T d_k + θ2 T^2) + m_f` with a `θ2` of at least the head count (the
//! `heads * T^2` attention probabilities each image keeps) and a small error.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use rand::SeedableRng;
use rand::rngs::SmallRng;
use troupe_kernels::Tensor;
use troupe_kernels::vmoe::{CoAdaptPool, VMoe, VMoeConfig};
use troupe_policy::adapt::memory::{ExpertShape, MemoryModel, MemorySample};

const IMAGES: usize = 8;

#[test]
fn attention_samples_fit_the_estimator_with_a_real_quadratic_term() {
    let x =
        Tensor::from_f32(&[IMAGES, 64], (0..IMAGES * 64).map(|i| ((i * 29) % 13) as f32 / 12.0).collect())
            .unwrap();
    let labels: Vec<usize> = (0..IMAGES).map(|i| i % 10).collect();
    let mut pool = CoAdaptPool::new("estimator", 64 << 20).unwrap();
    let base = VMoeConfig::tiny();
    // Patches of 4, 2 and 1 pixels of the 16x16 grid: 16, 64 and 256 tokens per image.
    for (seed, patch) in [(1u64, 4usize), (2, 2), (3, 1)] {
        let cfg = VMoeConfig { patch, ..base };
        let model = VMoe::new(cfg, &mut SmallRng::seed_from_u64(seed)).unwrap();
        let id = pool.load(&format!("p{patch}"), &model).unwrap();
        pool.adapt_step(id, &x, &labels, 1e-3).unwrap();
        pool.unload(id).unwrap();
    }
    let samples: Vec<MemorySample> = pool
        .attention_samples()
        .iter()
        .map(|s| MemorySample {
            shape: ExpertShape { tokens: s.tokens as u64, d_k: s.dim as u64 },
            measured_bytes: s.bytes as f64 / s.images as f64,
        })
        .collect();
    assert_eq!(samples.len(), 3 * base.blocks);
    let fit = MemoryModel::fit(4.0, &samples).unwrap();
    let worst = samples
        .iter()
        .map(|s| (fit.temporary_bytes(s.shape) as f64 - s.measured_bytes).abs() / s.measured_bytes)
        .fold(0.0, f64::max);
    println!("attention estimator: {fit:?}, worst relative error {worst:.2e}");
    assert!(
        fit.theta2 >= base.heads as f64,
        "theta2 {} below the {} heads' probabilities",
        fit.theta2,
        base.heads
    );
    assert!(fit.theta1 > 0.0);
    assert!(worst < 0.01, "worst relative error {worst}");
}

//! The reuse-probability predictor `P_reuse` (paper §3.3.2).
//!
//! The paper trains "a lightweight offline-trained neural network" on "pixel-level similarity of
//! multiple image pairs and statistical features of experts' outputs (e.g., mean, variance,
//! maximum, sparsity)" with reuse success as the label. Here it is the smallest such network: a
//! logistic regression over those five features (standardised), trained offline by a pure
//! function — mini-batch gradient descent whose initial weights and shuffling come from a fixed
//! seed, so the same samples always give the same model.

use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// Number of features the predictor reads.
pub const FEATURES: usize = 5;
/// Most training samples [`train_reuse_predictor`] accepts.
pub const MAX_TRAIN_SAMPLES: usize = 1 << 20;

/// The paper's features for one output token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReuseFeatures {
    /// Pixel-level similarity of the image pair that produced the token (0..1).
    pub pixel_similarity: f64,
    /// Mean of the expert's output.
    pub out_mean: f64,
    /// Variance of the expert's output.
    pub out_variance: f64,
    /// Maximum of the expert's output.
    pub out_max: f64,
    /// Sparsity of the expert's output (fraction of near-zero entries).
    pub out_sparsity: f64,
}

impl ReuseFeatures {
    /// The features as a vector, in a fixed order.
    pub fn to_array(&self) -> [f64; FEATURES] {
        [self.pixel_similarity, self.out_mean, self.out_variance, self.out_max, self.out_sparsity]
    }
}

/// One labelled training example: features and whether reuse succeeded.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReuseSample {
    /// Inputs.
    pub features: ReuseFeatures,
    /// Reuse success label.
    pub reused: bool,
}

/// Training hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrainConfig {
    /// Passes over the data.
    pub epochs: u32,
    /// Step size.
    pub learning_rate: f64,
    /// L2 penalty on the weights (not the bias).
    pub l2: f64,
    /// Mini-batch size.
    pub batch: usize,
    /// Seed for the initial weights and the shuffling.
    pub seed: u64,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig { epochs: 200, learning_rate: 0.5, l2: 1e-4, batch: 32, seed: 0x5EED }
    }
}

/// Why training failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TrainError {
    /// No samples at all.
    #[error("no training samples")]
    Empty,
    /// More than [`MAX_TRAIN_SAMPLES`].
    #[error("{0} samples exceed the training cap")]
    TooMany(usize),
    /// A feature is NaN or infinite.
    #[error("sample {0} has a non-finite feature")]
    NonFinite(usize),
}

/// A trained logistic-regression predictor of `P_reuse`.
#[derive(Debug, Clone, PartialEq)]
pub struct ReusePredictor {
    /// Per-feature mean used for standardisation.
    pub mean: [f64; FEATURES],
    /// Per-feature standard deviation used for standardisation (1 where constant).
    pub std: [f64; FEATURES],
    /// Weights over standardised features.
    pub weights: [f64; FEATURES],
    /// Bias term.
    pub bias: f64,
}

impl ReusePredictor {
    /// `P_reuse` in (0, 1) for one token's features.
    pub fn predict(&self, f: &ReuseFeatures) -> f64 {
        sigmoid(self.logit(&f.to_array()))
    }

    fn logit(&self, x: &[f64; FEATURES]) -> f64 {
        self.bias + (0..FEATURES).map(|k| self.weights[k] * (x[k] - self.mean[k]) / self.std[k]).sum::<f64>()
    }
}

/// Trains the predictor offline on caller-provided samples (pure and deterministic).
pub fn train_reuse_predictor(
    samples: &[ReuseSample],
    cfg: &TrainConfig,
) -> Result<ReusePredictor, TrainError> {
    if samples.is_empty() {
        return Err(TrainError::Empty);
    }
    if samples.len() > MAX_TRAIN_SAMPLES {
        return Err(TrainError::TooMany(samples.len()));
    }
    let xs: Vec<[f64; FEATURES]> = samples.iter().map(|s| s.features.to_array()).collect();
    if let Some(i) = xs.iter().position(|x| x.iter().any(|v| !v.is_finite())) {
        return Err(TrainError::NonFinite(i));
    }
    let n = xs.len() as f64;
    let mut mean = [0.0; FEATURES];
    let mut std = [0.0; FEATURES];
    for k in 0..FEATURES {
        mean[k] = xs.iter().map(|x| x[k]).sum::<f64>() / n;
        let var = xs.iter().map(|x| (x[k] - mean[k]).powi(2)).sum::<f64>() / n;
        std[k] = if var > 1e-24 { var.sqrt() } else { 1.0 };
    }
    let mut rng = SmallRng::seed_from_u64(cfg.seed);
    let mut model = ReusePredictor { mean, std, weights: [0.0; FEATURES], bias: 0.0 };
    for w in &mut model.weights {
        *w = rng.random_range(-0.01..0.01);
    }
    let mut order: Vec<usize> = (0..xs.len()).collect();
    let batch = cfg.batch.max(1);
    for _ in 0..cfg.epochs {
        order.shuffle(&mut rng);
        for chunk in order.chunks(batch) {
            let mut gw = [0.0; FEATURES];
            let mut gb = 0.0;
            for &i in chunk {
                let y = if samples[i].reused { 1.0 } else { 0.0 };
                let err = sigmoid(model.logit(&xs[i])) - y;
                for (k, g) in gw.iter_mut().enumerate() {
                    *g += err * (xs[i][k] - mean[k]) / std[k];
                }
                gb += err;
            }
            let m = chunk.len() as f64;
            for (w, g) in model.weights.iter_mut().zip(gw) {
                *w -= cfg.learning_rate * (g / m + cfg.l2 * *w);
            }
            model.bias -= cfg.learning_rate * gb / m;
        }
    }
    Ok(model)
}

fn sigmoid(z: f64) -> f64 {
    1.0 / (1.0 + (-z).exp())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A synthetic labelled set: reuse succeeds when the images are similar and the output is
    /// sparse (a seeded noisy rule, so the learned model has something real to find).
    pub(crate) fn synthetic_samples(n: usize, seed: u64) -> Vec<ReuseSample> {
        let mut rng = SmallRng::seed_from_u64(seed);
        (0..n)
            .map(|_| {
                let f = ReuseFeatures {
                    pixel_similarity: rng.random_range(0.0..1.0),
                    out_mean: rng.random_range(-1.0..1.0),
                    out_variance: rng.random_range(0.0..2.0),
                    out_max: rng.random_range(0.0..5.0),
                    out_sparsity: rng.random_range(0.0..1.0),
                };
                let score = 4.0 * (f.pixel_similarity - 0.5)
                    + 1.5 * (f.out_sparsity - 0.5)
                    + rng.random_range(-0.3..0.3);
                ReuseSample { features: f, reused: score > 0.0 }
            })
            .collect()
    }

    #[test]
    fn learns_the_rule_and_generalises() {
        let train = synthetic_samples(2000, 1);
        let test = synthetic_samples(500, 2);
        let cfg = TrainConfig { epochs: 60, ..TrainConfig::default() };
        let model = train_reuse_predictor(&train, &cfg).unwrap();
        let correct = test.iter().filter(|s| (model.predict(&s.features) > 0.5) == s.reused).count();
        assert!(correct as f64 / test.len() as f64 > 0.9, "{correct}/500");
        // Similarity is the dominant feature, and its weight is positive.
        assert!(model.weights[0] > model.weights[4] && model.weights[4] > 0.0, "{model:?}");
        // Deterministic: the same seed gives the same model.
        assert_eq!(model, train_reuse_predictor(&train, &cfg).unwrap());
    }

    #[test]
    fn rejects_bad_training_sets() {
        assert_eq!(train_reuse_predictor(&[], &TrainConfig::default()), Err(TrainError::Empty));
        let mut s = synthetic_samples(3, 1);
        s[2].features.out_max = f64::NAN;
        assert_eq!(train_reuse_predictor(&s, &TrainConfig::default()), Err(TrainError::NonFinite(2)));
    }
}

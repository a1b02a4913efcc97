//! Training of the dense-ReLU MLPs that [`crate::onnx::writer::mlp_model`] writes: Glorot
//! initialisation, minibatch AdamW on softmax cross-entropy, backward by hand through the
//! kernels' GEMM. Deterministic from the seed (shuffles and initial weights come from it), so a
//! generator that trains its experts writes the same files every run.

use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use crate::error::{KernelError, Result};
use crate::onnx::writer::DenseLayer;
use crate::ops::{AdamW, Gemm, cross_entropy};
use crate::tensor::Tensor;

/// How to train: passes, minibatch size, AdamW learning rate, seed of the shuffles.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TrainConfig {
    /// Passes over the training rows.
    pub epochs: usize,
    /// Rows per step.
    pub batch: usize,
    /// AdamW learning rate.
    pub lr: f32,
    /// Seed of the per-epoch shuffles.
    pub seed: u64,
}

/// Glorot-uniform weights and zero biases for an MLP of `widths` (input first), from `rng`.
pub fn glorot_layers(widths: &[usize], rng: &mut SmallRng) -> Vec<DenseLayer> {
    widths
        .windows(2)
        .map(|w| {
            let (i, o) = (w[0], w[1]);
            let a = (6.0 / (i + o) as f32).sqrt();
            let weights = (0..i * o).map(|_| (rng.random::<f32>() * 2.0 - 1.0) * a).collect();
            DenseLayer { inputs: i, outputs: o, weights, bias: vec![0.0; o] }
        })
        .collect()
}

/// Forward pass keeping every layer's output: `acts[0]` is the input, `acts[l + 1]` layer `l`'s
/// output after ReLU (the last one is the logits, no ReLU).
fn forward(layers: &[DenseLayer], x: &[f32], rows: usize) -> Result<Vec<Vec<f32>>> {
    let mut acts = vec![x.to_vec()];
    for (l, layer) in layers.iter().enumerate() {
        let mut z = vec![0f32; rows * layer.outputs];
        for row in z.chunks_mut(layer.outputs) {
            row.copy_from_slice(&layer.bias);
        }
        Gemm::new(rows, layer.inputs, layer.outputs).accumulate().run_cpu(
            &acts[l],
            &layer.weights,
            &mut z,
        )?;
        if l + 1 < layers.len() {
            z.iter_mut().for_each(|v| *v = v.max(0.0));
        }
        acts.push(z);
    }
    Ok(acts)
}

/// One layer's gradients: `(d weights, d bias)`.
type LayerGrads = (Vec<f32>, Vec<f32>);

/// Gradients of the mean cross-entropy of `layers` on `x` (`rows` rows) against `targets`:
/// `(loss, per layer (d weights, d bias))`.
fn gradients(
    layers: &[DenseLayer],
    x: &[f32],
    targets: &[usize],
    rows: usize,
) -> Result<(f32, Vec<LayerGrads>)> {
    let acts = forward(layers, x, rows)?;
    let classes = layers.last().map_or(0, |l| l.outputs);
    let logits = acts.last().cloned().unwrap_or_default();
    let (loss, dlogits) = cross_entropy(&Tensor::from_f32(&[rows, classes], logits)?, targets)?;
    let mut dz = dlogits.to_vec_f32();
    let mut grads = Vec::with_capacity(layers.len());
    for (l, layer) in layers.iter().enumerate().rev() {
        let (i, o) = (layer.inputs, layer.outputs);
        let mut dw = vec![0f32; i * o];
        Gemm::new(i, rows, o).transposed(true, false).run_cpu(&acts[l], &dz, &mut dw)?;
        let mut db = vec![0f32; o];
        for row in dz.chunks(o) {
            db.iter_mut().zip(row).for_each(|(b, g)| *b += g);
        }
        if l > 0 {
            let mut da = vec![0f32; rows * i];
            Gemm::new(rows, o, i).transposed(false, true).run_cpu(&dz, &layer.weights, &mut da)?;
            // ReLU backward: the saved activation is positive exactly where the unit was on.
            da.iter_mut().zip(&acts[l]).for_each(|(g, &a)| *g = if a > 0.0 { *g } else { 0.0 });
            dz = da;
        }
        grads.push((dw, db));
    }
    grads.reverse();
    Ok((loss, grads))
}

/// Train `layers` in place on `x` (`targets.len()` rows of the first layer's width) against
/// class indices `targets`; returns the mean loss of the last epoch.
pub fn train(layers: &mut [DenseLayer], x: &[f32], targets: &[usize], cfg: &TrainConfig) -> Result<f32> {
    let width = layers.first().map_or(0, |l| l.inputs);
    let rows = targets.len();
    if layers.is_empty() || x.len() != rows * width {
        return Err(KernelError::shape(
            "mlp_train",
            format!("{} inputs for {rows} rows of width {width} ({} layers)", x.len(), layers.len()),
        ));
    }
    if rows == 0 || cfg.batch == 0 {
        return Err(KernelError::invalid("mlp_train", "no training rows or a zero batch"));
    }
    let mut opts: Vec<(AdamW, AdamW)> =
        layers.iter().map(|_| (AdamW::new(cfg.lr), AdamW::new(cfg.lr))).collect();
    let mut rng = SmallRng::seed_from_u64(cfg.seed);
    let mut order: Vec<usize> = (0..rows).collect();
    let mut last = f32::NAN;
    for _ in 0..cfg.epochs {
        order.shuffle(&mut rng);
        let (mut sum, mut steps) = (0f64, 0usize);
        for chunk in order.chunks(cfg.batch) {
            let mut bx = Vec::with_capacity(chunk.len() * width);
            for &r in chunk {
                bx.extend_from_slice(&x[r * width..(r + 1) * width]);
            }
            let bt: Vec<usize> = chunk.iter().map(|&r| targets[r]).collect();
            let (loss, grads) = gradients(layers, &bx, &bt, chunk.len())?;
            for ((layer, (dw, db)), (ow, ob)) in layers.iter_mut().zip(&grads).zip(&mut opts) {
                ow.step(&mut layer.weights, dw)?;
                ob.step(&mut layer.bias, db)?;
            }
            sum += f64::from(loss);
            steps += 1;
        }
        last = (sum / steps.max(1) as f64) as f32;
    }
    Ok(last)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::gradcheck::{check_grad, random_vec};

    fn net(widths: &[usize], seed: u64) -> Vec<DenseLayer> {
        glorot_layers(widths, &mut SmallRng::seed_from_u64(seed))
    }

    #[test]
    fn gradients_match_finite_differences() {
        let mut layers = net(&[3, 5, 4], 1);
        for l in &mut layers {
            l.bias = random_vec(2, l.outputs, 0.3);
        }
        let x = random_vec(3, 6 * 3, 1.0);
        let targets = [0, 3, 1, 2, 2, 0];
        let (_, grads) = gradients(&layers, &x, &targets, 6).unwrap();
        let loss = |ls: &[DenseLayer]| {
            let logits = forward(ls, &x, 6).unwrap().pop().unwrap();
            f64::from(cross_entropy(&Tensor::from_f32(&[6, 4], logits).unwrap(), &targets).unwrap().0)
        };
        for l in 0..layers.len() {
            check_grad("dw", &layers[l].weights.clone(), &grads[l].0, |w| {
                let mut ls = layers.clone();
                ls[l].weights = w.to_vec();
                loss(&ls)
            });
            check_grad("db", &layers[l].bias.clone(), &grads[l].1, |b| {
                let mut ls = layers.clone();
                ls[l].bias = b.to_vec();
                loss(&ls)
            });
        }
    }

    #[test]
    fn training_fits_a_separable_set_and_is_deterministic() {
        // Two classes split by the sign of the first coordinate.
        let x = random_vec(4, 64 * 2, 1.0);
        let targets: Vec<usize> = x.chunks(2).map(|r| usize::from(r[0] > 0.0)).collect();
        let cfg = TrainConfig { epochs: 60, batch: 16, lr: 0.01, seed: 5 };
        let mut a = net(&[2, 16, 2], 9);
        let before = gradients(&a, &x, &targets, 64).unwrap().0;
        let after = train(&mut a, &x, &targets, &cfg).unwrap();
        assert!(after < 0.25 * before, "loss {before} -> {after}");
        let mut b = net(&[2, 16, 2], 9);
        train(&mut b, &x, &targets, &cfg).unwrap();
        assert_eq!(a, b, "same seed, same weights");
        assert!(train(&mut b, &x[1..], &targets, &cfg).is_err());
    }
}

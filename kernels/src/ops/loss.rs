//! Cross-entropy with logits (mean over rows), loss and gradient in one pass.

use super::{Op, rows_cols};
use crate::cuda::CudaDevice;
use crate::error::{KernelError, Result};
use crate::tensor::Tensor;

/// Mean cross-entropy of `logits` (`rows x classes`) against class indices; returns
/// `(loss, d loss / d logits)`. The gradient is `(softmax(logits) - onehot) / rows`.
#[derive(Clone, Copy, Debug, Default)]
pub struct CrossEntropy;

impl Op for CrossEntropy {
    type Args<'a> = (&'a Tensor, &'a [usize]);
    type Output = (f32, Tensor);
    const NAME: &'static str = "cross_entropy";

    fn cpu(&self, (logits, targets): Self::Args<'_>) -> Result<Self::Output> {
        let (rows, cols) = checked_dims(logits, targets)?;
        let x = logits.f32_cow();
        let mut grad = vec![0.0; rows * cols];
        let mut total = 0f64;
        let inv_rows = 1.0 / rows.max(1) as f64;
        for (r, &target) in targets.iter().enumerate() {
            let row = &x[r * cols..(r + 1) * cols];
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f64 = row.iter().map(|&v| f64::from(v - max).exp()).sum();
            let lse = f64::from(max) + sum.ln();
            total += lse - f64::from(row[target]);
            for (c, (&v, g)) in row.iter().zip(&mut grad[r * cols..(r + 1) * cols]).enumerate() {
                let p = (f64::from(v) - lse).exp();
                let onehot = if c == target { 1.0 } else { 0.0 };
                *g = ((p - onehot) * inv_rows) as f32;
            }
        }
        Ok(((total * inv_rows) as f32, Tensor::from_f32(&[rows, cols], grad)?))
    }

    fn cuda(&self, dev: &CudaDevice, (logits, targets): Self::Args<'_>) -> Result<Self::Output> {
        crate::cuda::cross_entropy(dev, logits, targets)
    }
}

/// `(rows, classes)` of `logits` once `targets` has one class index per row, each a class.
pub(crate) fn checked_dims(logits: &Tensor, targets: &[usize]) -> Result<(usize, usize)> {
    let (rows, cols) = rows_cols("cross_entropy", logits)?;
    if targets.len() != rows {
        return Err(KernelError::shape(
            "cross_entropy",
            format!("{} targets for {rows} rows", targets.len()),
        ));
    }
    if let Some((i, &t)) = targets.iter().enumerate().find(|&(_, &t)| t >= cols) {
        return Err(KernelError::invalid(
            "cross_entropy",
            format!("target {t} of row {i} is not a class (0..{cols})"),
        ));
    }
    Ok((rows, cols))
}

/// Cross-entropy on the CPU: `(mean loss, d loss / d logits)`.
pub fn cross_entropy(logits: &Tensor, targets: &[usize]) -> Result<(f32, Tensor)> {
    CrossEntropy.cpu((logits, targets))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::gradcheck::{check_grad, random_vec};

    #[test]
    fn uniform_logits_give_ln_classes() {
        let logits = Tensor::zeros(&[2, 4]).unwrap();
        let (loss, grad) = cross_entropy(&logits, &[0, 3]).unwrap();
        assert!((loss - 4f32.ln()).abs() < 1e-6);
        // Row 0: (1/4 - 1)/2 at the target, (1/4)/2 elsewhere.
        let g = grad.to_vec_f32();
        assert!((g[0] + 0.375).abs() < 1e-7 && (g[1] - 0.125).abs() < 1e-7);
        assert!(cross_entropy(&logits, &[0, 4]).is_err());
        assert!(cross_entropy(&logits, &[0]).is_err());
    }

    #[test]
    fn gradient_matches_finite_differences() {
        let (rows, cols) = (4, 5);
        let x = random_vec(9, rows * cols, 3.0);
        let targets = [1, 0, 4, 2];
        let t = |v: &[f32]| Tensor::from_f32(&[rows, cols], v.to_vec()).unwrap();
        let (_, grad) = cross_entropy(&t(&x), &targets).unwrap();
        check_grad("cross_entropy", &x, &grad.to_vec_f32(), |x| {
            f64::from(cross_entropy(&t(x), &targets).unwrap().0)
        });
    }
}

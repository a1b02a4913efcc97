//! Row-wise softmax (CPU and CUDA) and its backward pass.

use super::{Op, rows_cols};
use crate::cuda::CudaDevice;
use crate::error::{KernelError, Result};
use crate::tensor::Tensor;

/// Softmax of each row of a matrix (max-subtracted; sums in f64).
pub fn softmax(x: &Tensor) -> Result<Tensor> {
    Softmax.cpu(x)
}

/// Softmax of one row into `out`.
pub(crate) fn softmax_row(row: &[f32], out: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f64;
    for (o, &v) in out.iter_mut().zip(row) {
        let e = f64::from(v - max).exp();
        *o = e as f32;
        sum += e;
    }
    for o in out.iter_mut() {
        *o = (f64::from(*o) / sum) as f32;
    }
}

/// Gradient of softmax: given `y = softmax(x)` and `dy`, `dx = y * (dy - sum(dy * y))` per row.
pub fn softmax_backward(y: &Tensor, dy: &Tensor) -> Result<Tensor> {
    let (rows, cols) = rows_cols("softmax_backward", y)?;
    if dy.shape() != y.shape() {
        return Err(KernelError::shape(
            "softmax_backward",
            format!("y {:?} vs dy {:?}", y.shape(), dy.shape()),
        ));
    }
    let (y, dy) = (y.f32_cow(), dy.f32_cow());
    let mut dx = vec![0.0; rows * cols];
    for r in 0..rows {
        let s = r * cols..(r + 1) * cols;
        let dot: f64 =
            y[s.clone()].iter().zip(&dy[s.clone()]).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum();
        for ((o, &yv), &g) in dx[s.clone()].iter_mut().zip(&y[s.clone()]).zip(&dy[s]) {
            *o = (f64::from(yv) * (f64::from(g) - dot)) as f32;
        }
    }
    Tensor::from_f32(&[rows, cols], dx)
}

/// Row-wise softmax.
#[derive(Clone, Copy, Debug, Default)]
pub struct Softmax;

impl Op for Softmax {
    type Args<'a> = &'a Tensor;
    type Output = Tensor;
    const NAME: &'static str = "softmax";

    fn cpu(&self, x: &Tensor) -> Result<Tensor> {
        let (rows, cols) = rows_cols("softmax", x)?;
        let xv = x.f32_cow();
        let mut out = vec![0.0; rows * cols];
        for r in 0..rows {
            softmax_row(&xv[r * cols..(r + 1) * cols], &mut out[r * cols..(r + 1) * cols]);
        }
        Tensor::from_f32(&[rows, cols], out)
    }

    fn cuda(&self, dev: &CudaDevice, x: &Tensor) -> Result<Tensor> {
        crate::cuda::softmax(dev, x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::gradcheck::{check_grad, random_vec};

    #[test]
    fn softmax_by_hand() {
        // softmax(0, ln 3) = (1/4, 3/4); large values do not overflow.
        let x = Tensor::from_f32(&[2, 2], vec![0.0, 3f32.ln(), 1000.0, 1000.0]).unwrap();
        let y = softmax(&x).unwrap().to_vec_f32();
        assert!((y[0] - 0.25).abs() < 1e-6 && (y[1] - 0.75).abs() < 1e-6);
        assert_eq!(&y[2..], &[0.5, 0.5]);
    }

    #[test]
    fn softmax_gradient_matches_finite_differences() {
        let (rows, cols) = (3, 5);
        let x = random_vec(3, rows * cols, 2.0);
        let r = random_vec(4, rows * cols, 1.0);
        let y = softmax(&Tensor::from_f32(&[rows, cols], x.clone()).unwrap()).unwrap();
        let dx =
            softmax_backward(&y, &Tensor::from_f32(&[rows, cols], r.clone()).unwrap()).unwrap().to_vec_f32();
        check_grad("softmax", &x, &dx, |x| {
            let y = softmax(&Tensor::from_f32(&[rows, cols], x.to_vec()).unwrap()).unwrap();
            y.to_vec_f32().iter().zip(&r).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum()
        });
    }
}

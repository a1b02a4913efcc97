//! Layer normalisation over the last dimension, forward and backward.

use super::{Op, rows_cols};
use crate::cuda::CudaDevice;
use crate::error::{KernelError, Result};
use crate::tensor::Tensor;

/// What the backward pass needs from the forward pass.
#[derive(Clone, Debug)]
pub struct LayerNormCache {
    /// Normalised input `(x - mean) * rstd`, `rows x cols`.
    pub x_hat: Vec<f32>,
    /// `1 / sqrt(var + eps)` per row.
    pub rstd: Vec<f32>,
    /// Rows, columns.
    pub dims: (usize, usize),
}

/// Gradients of layer norm.
#[derive(Clone, Debug)]
pub struct LayerNormGrads {
    /// d loss / d x.
    pub dx: Tensor,
    /// d loss / d gamma.
    pub dgamma: Tensor,
    /// d loss / d beta.
    pub dbeta: Tensor,
}

/// Layer norm with learnt scale and shift: `y = (x - mean) / sqrt(var + eps) * gamma + beta` per row.
#[derive(Clone, Copy, Debug)]
pub struct LayerNorm {
    /// Added to the variance (e.g. 1e-5).
    pub eps: f32,
}

impl Op for LayerNorm {
    type Args<'a> = (&'a Tensor, &'a Tensor, &'a Tensor);
    type Output = (Tensor, LayerNormCache);
    const NAME: &'static str = "layer_norm";

    fn cpu(&self, (x, gamma, beta): Self::Args<'_>) -> Result<Self::Output> {
        let (rows, cols) = checked_dims(x, gamma, beta)?;
        let (xv, g, b) = (x.f32_cow(), gamma.f32_cow(), beta.f32_cow());
        let mut y = vec![0.0; rows * cols];
        let mut x_hat = vec![0.0; rows * cols];
        let mut rstd = vec![0.0; rows];
        for r in 0..rows {
            let row = &xv[r * cols..(r + 1) * cols];
            let mean = row.iter().map(|&v| f64::from(v)).sum::<f64>() / cols as f64;
            let var = row.iter().map(|&v| (f64::from(v) - mean).powi(2)).sum::<f64>() / cols as f64;
            let rs = 1.0 / (var + f64::from(self.eps)).sqrt();
            rstd[r] = rs as f32;
            for c in 0..cols {
                let h = ((f64::from(row[c]) - mean) * rs) as f32;
                x_hat[r * cols + c] = h;
                y[r * cols + c] = h * g[c] + b[c];
            }
        }
        Ok((Tensor::from_f32(&[rows, cols], y)?, LayerNormCache { x_hat, rstd, dims: (rows, cols) }))
    }

    fn cuda(&self, dev: &CudaDevice, (x, gamma, beta): Self::Args<'_>) -> Result<Self::Output> {
        crate::cuda::layer_norm(dev, x, gamma, beta, self.eps)
    }
}

/// `(rows, cols)` of `x` once `gamma` and `beta` have one value per (at least one) column.
pub(crate) fn checked_dims(x: &Tensor, gamma: &Tensor, beta: &Tensor) -> Result<(usize, usize)> {
    let (rows, cols) = rows_cols("layer_norm", x)?;
    if gamma.numel() != cols || beta.numel() != cols || cols == 0 {
        return Err(KernelError::shape(
            "layer_norm",
            format!("gamma {:?} / beta {:?} for {cols} columns", gamma.shape(), beta.shape()),
        ));
    }
    Ok((rows, cols))
}

/// Layer norm backward as an op: `(dy, gamma, cache)` to the three gradients.
#[derive(Clone, Copy, Debug, Default)]
pub struct LayerNormBackward;

impl Op for LayerNormBackward {
    type Args<'a> = (&'a Tensor, &'a Tensor, &'a LayerNormCache);
    type Output = LayerNormGrads;
    const NAME: &'static str = "layer_norm_backward";

    fn cpu(&self, (dy, gamma, cache): Self::Args<'_>) -> Result<LayerNormGrads> {
        layer_norm_backward(dy, gamma, cache)
    }

    fn cuda(&self, dev: &CudaDevice, (dy, gamma, cache): Self::Args<'_>) -> Result<LayerNormGrads> {
        crate::cuda::layer_norm_backward(dev, dy, gamma, cache)
    }
}

/// Layer norm forward on the CPU.
pub fn layer_norm(x: &Tensor, gamma: &Tensor, beta: &Tensor, eps: f32) -> Result<(Tensor, LayerNormCache)> {
    LayerNorm { eps }.cpu((x, gamma, beta))
}

/// Layer norm backward: `dx = rstd/N (N dxh - sum dxh - x_hat sum(dxh x_hat))` with `dxh = dy gamma`.
pub fn layer_norm_backward(dy: &Tensor, gamma: &Tensor, cache: &LayerNormCache) -> Result<LayerNormGrads> {
    let (rows, cols) = cache.dims;
    if dy.shape() != [rows, cols] || gamma.numel() != cols {
        return Err(KernelError::shape(
            "layer_norm_backward",
            format!("dy {:?}, gamma {:?} for {rows}x{cols}", dy.shape(), gamma.shape()),
        ));
    }
    let (dyv, g) = (dy.f32_cow(), gamma.f32_cow());
    let mut dx = vec![0.0; rows * cols];
    let mut dgamma = vec![0f64; cols];
    let mut dbeta = vec![0f64; cols];
    let n = cols as f64;
    for r in 0..rows {
        let s = r * cols..(r + 1) * cols;
        let (mut sum_dxh, mut sum_dxh_xh) = (0f64, 0f64);
        for c in 0..cols {
            let (d, h) = (f64::from(dyv[s.start + c]), f64::from(cache.x_hat[s.start + c]));
            dgamma[c] += d * h;
            dbeta[c] += d;
            let dxh = d * f64::from(g[c]);
            sum_dxh += dxh;
            sum_dxh_xh += dxh * h;
        }
        let rs = f64::from(cache.rstd[r]);
        for c in 0..cols {
            let (d, h) = (f64::from(dyv[s.start + c]), f64::from(cache.x_hat[s.start + c]));
            let dxh = d * f64::from(g[c]);
            dx[s.start + c] = (rs / n * (n * dxh - sum_dxh - h * sum_dxh_xh)) as f32;
        }
    }
    Ok(LayerNormGrads {
        dx: Tensor::from_f32(&[rows, cols], dx)?,
        dgamma: Tensor::from_f32(&[cols], dgamma.into_iter().map(|v| v as f32).collect())?,
        dbeta: Tensor::from_f32(&[cols], dbeta.into_iter().map(|v| v as f32).collect())?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::gradcheck::{check_grad, random_vec};

    #[test]
    fn normalises_by_hand() {
        // Row (1, 3): mean 2, var 1 -> x_hat (-1, 1) (eps tiny); gamma 2, beta 1 -> (-1, 3).
        let x = Tensor::from_f32(&[1, 2], vec![1.0, 3.0]).unwrap();
        let g = Tensor::full(&[2], 2.0).unwrap();
        let b = Tensor::full(&[2], 1.0).unwrap();
        let (y, _) = layer_norm(&x, &g, &b, 1e-12).unwrap();
        let y = y.to_vec_f32();
        assert!((y[0] + 1.0).abs() < 1e-5 && (y[1] - 3.0).abs() < 1e-5, "{y:?}");
    }

    #[test]
    fn gradients_match_finite_differences() {
        let (rows, cols) = (3, 6);
        let x = random_vec(5, rows * cols, 1.5);
        let gamma = random_vec(6, cols, 1.0);
        let beta = random_vec(7, cols, 0.5);
        let r = random_vec(8, rows * cols, 1.0);
        let t = |v: &[f32], s: &[usize]| Tensor::from_f32(s, v.to_vec()).unwrap();
        let loss = |x: &[f32], g: &[f32], b: &[f32]| -> f64 {
            let (y, _) = layer_norm(&t(x, &[rows, cols]), &t(g, &[cols]), &t(b, &[cols]), 1e-5).unwrap();
            y.to_vec_f32().iter().zip(&r).map(|(&a, &w)| f64::from(a) * f64::from(w)).sum()
        };
        let (_, cache) =
            layer_norm(&t(&x, &[rows, cols]), &t(&gamma, &[cols]), &t(&beta, &[cols]), 1e-5).unwrap();
        let grads = layer_norm_backward(&t(&r, &[rows, cols]), &t(&gamma, &[cols]), &cache).unwrap();
        check_grad("layer_norm dx", &x, &grads.dx.to_vec_f32(), |x| loss(x, &gamma, &beta));
        check_grad("layer_norm dgamma", &gamma, &grads.dgamma.to_vec_f32(), |g| loss(&x, g, &beta));
        check_grad("layer_norm dbeta", &beta, &grads.dbeta.to_vec_f32(), |b| loss(&x, &gamma, b));
    }
}

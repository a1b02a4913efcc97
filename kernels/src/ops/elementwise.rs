//! Elementwise ops: row-wise bias add (and its gradient), GELU in the exact erf form (and its
//! gradient), ReLU. Bias add and ReLU also run on CUDA.

use super::{Op, rows_cols};
use crate::cuda::CudaDevice;
use crate::error::{KernelError, Result};
use crate::tensor::Tensor;

/// The error function, |error| < 1.2e-7 (Chebyshev fit of erfc, Numerical Recipes `erfcc`).
/// std has no stable `erf`; this is accurate well beyond f32 GELU's needs.
pub fn erf(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let erfc = t * poly.exp();
    if x >= 0.0 { 1.0 - erfc } else { erfc - 1.0 }
}

/// [`erf`] in f32 arithmetic (one `expf`): the GELU hot path. |error| < 5e-7 against [`erf`].
fn erf_f32(x: f32) -> f32 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_2
        + t * (1.000_023_7
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_204
                                + t * (1.488_515_9 + t * (-0.822_152_2 + t * 0.170_872_77))))))));
    let erfc = t * poly.exp();
    if x >= 0.0 { 1.0 - erfc } else { erfc - 1.0 }
}

const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;

/// GELU(x) = x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2)).
pub fn gelu_scalar(x: f32) -> f32 {
    0.5 * x * (1.0 + erf_f32(x * std::f32::consts::FRAC_1_SQRT_2))
}

/// d GELU / dx = Phi(x) + x phi(x).
pub fn gelu_grad_scalar(x: f32) -> f32 {
    let cdf = 0.5 * (1.0 + erf_f32(x * std::f32::consts::FRAC_1_SQRT_2));
    let pdf = FRAC_1_SQRT_2PI * (-0.5 * x * x).exp();
    cdf + x * pdf
}

/// GELU of every element.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    Gelu.cpu(x)
}

/// `dy * GELU'(x)` elementwise (`x` is the forward input).
pub fn gelu_backward(x: &Tensor, dy: &Tensor) -> Result<Tensor> {
    if x.shape() != dy.shape() {
        return Err(KernelError::shape("gelu_backward", format!("x {:?} vs dy {:?}", x.shape(), dy.shape())));
    }
    let out = x.f32_cow().iter().zip(dy.f32_cow().iter()).map(|(&x, &g)| g * gelu_grad_scalar(x)).collect();
    Tensor::from_f32(x.shape(), out)
}

/// The GELU op (erf form).
#[derive(Clone, Copy, Debug, Default)]
pub struct Gelu;

impl Op for Gelu {
    type Args<'a> = &'a Tensor;
    type Output = Tensor;
    const NAME: &'static str = "gelu";

    fn cpu(&self, x: &Tensor) -> Result<Tensor> {
        Tensor::from_f32(x.shape(), x.f32_cow().iter().map(|&v| gelu_scalar(v)).collect())
    }

    fn cuda(&self, dev: &CudaDevice, x: &Tensor) -> Result<Tensor> {
        crate::cuda::gelu(dev, x)
    }
}

/// GELU backward as an op: `(x, dy)` to `dy * GELU'(x)`.
#[derive(Clone, Copy, Debug, Default)]
pub struct GeluBackward;

impl Op for GeluBackward {
    type Args<'a> = (&'a Tensor, &'a Tensor);
    type Output = Tensor;
    const NAME: &'static str = "gelu_backward";

    fn cpu(&self, (x, dy): Self::Args<'_>) -> Result<Tensor> {
        gelu_backward(x, dy)
    }

    fn cuda(&self, dev: &CudaDevice, (x, dy): Self::Args<'_>) -> Result<Tensor> {
        crate::cuda::gelu_backward(dev, x, dy)
    }
}

/// The bias gradient as an op (column sums).
#[derive(Clone, Copy, Debug, Default)]
pub struct BiasGrad;

impl Op for BiasGrad {
    type Args<'a> = &'a Tensor;
    type Output = Tensor;
    const NAME: &'static str = "bias_grad";

    fn cpu(&self, dy: &Tensor) -> Result<Tensor> {
        bias_grad(dy)
    }

    fn cuda(&self, dev: &CudaDevice, dy: &Tensor) -> Result<Tensor> {
        crate::cuda::bias_grad(dev, dy)
    }
}

/// `x + bias` with `bias` (length `cols`) added to every row of the `rows x cols` matrix `x`.
pub fn bias_add(x: &Tensor, bias: &Tensor) -> Result<Tensor> {
    BiasAdd.cpu((x, bias))
}

/// The bias gradient: column sums of `dy` (`rows x cols` -> `cols`), accumulated in f64.
pub fn bias_grad(dy: &Tensor) -> Result<Tensor> {
    let (rows, cols) = rows_cols("bias_grad", dy)?;
    let d = dy.f32_cow();
    let mut acc = vec![0f64; cols];
    for r in 0..rows {
        for (a, &v) in acc.iter_mut().zip(&d[r * cols..(r + 1) * cols]) {
            *a += f64::from(v);
        }
    }
    Tensor::from_f32(&[cols], acc.into_iter().map(|v| v as f32).collect())
}

/// Row-wise bias add.
#[derive(Clone, Copy, Debug, Default)]
pub struct BiasAdd;

impl Op for BiasAdd {
    type Args<'a> = (&'a Tensor, &'a Tensor);
    type Output = Tensor;
    const NAME: &'static str = "bias_add";

    fn cpu(&self, (x, bias): Self::Args<'_>) -> Result<Tensor> {
        let (rows, cols) = rows_cols("bias_add", x)?;
        if bias.numel() != cols {
            return Err(KernelError::shape(
                "bias_add",
                format!("bias of {} elements for {cols} columns", bias.numel()),
            ));
        }
        let b = bias.f32_cow();
        let mut out = x.to_vec_f32();
        for r in 0..rows {
            for (o, &bv) in out[r * cols..(r + 1) * cols].iter_mut().zip(b.iter()) {
                *o += bv;
            }
        }
        Tensor::from_f32(x.shape(), out)
    }

    fn cuda(&self, dev: &CudaDevice, (x, bias): Self::Args<'_>) -> Result<Tensor> {
        crate::cuda::bias_add(dev, x, bias)
    }
}

/// ReLU of every element on the CPU.
pub fn relu(x: &Tensor) -> Result<Tensor> {
    Relu.cpu(x)
}

/// ReLU, `max(x, 0)` elementwise (the MLP experts' activation).
#[derive(Clone, Copy, Debug, Default)]
pub struct Relu;

impl Op for Relu {
    type Args<'a> = &'a Tensor;
    type Output = Tensor;
    const NAME: &'static str = "relu";

    fn cpu(&self, x: &Tensor) -> Result<Tensor> {
        Tensor::from_f32(x.shape(), x.f32_cow().iter().map(|&v| v.max(0.0)).collect())
    }

    fn cuda(&self, dev: &CudaDevice, x: &Tensor) -> Result<Tensor> {
        crate::cuda::relu(dev, x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::gradcheck::{check_grad, random_vec};

    #[test]
    fn erf_known_values() {
        // Reference values of erf (Abramowitz & Stegun table 7.1).
        for (x, want) in [
            (0.0, 0.0),
            (0.5, 0.520_499_877_8),
            (1.0, 0.842_700_792_9),
            (2.0, 0.995_322_265_0),
            (-1.0, -0.842_700_792_9),
        ] {
            assert!((erf(x) - want).abs() < 2e-7, "erf({x}) = {} vs {want}", erf(x));
        }
    }

    #[test]
    fn f32_erf_tracks_the_f64_one() {
        for i in -600..=600 {
            let x = i as f32 * 0.01;
            let d = (f64::from(erf_f32(x)) - erf(f64::from(x))).abs();
            assert!(d < 5e-7, "erf_f32({x}) off by {d}");
        }
    }

    #[test]
    fn gelu_by_hand() {
        // GELU(1) = Phi(1) = 0.841344746; GELU(-1) = -(1 - Phi(1)); GELU(0) = 0.
        assert!((gelu_scalar(1.0) - 0.841_344_8).abs() < 1e-6);
        assert!((gelu_scalar(-1.0) + 0.158_655_25).abs() < 1e-6);
        assert_eq!(gelu_scalar(0.0), 0.0);
        assert!((gelu_grad_scalar(0.0) - 0.5).abs() < 1e-7);
    }

    #[test]
    fn gelu_gradient_matches_finite_differences() {
        let x = random_vec(1, 24, 2.0);
        let r = random_vec(2, 24, 1.0);
        let xt = Tensor::from_f32(&[4, 6], x.clone()).unwrap();
        let analytic =
            gelu_backward(&xt, &Tensor::from_f32(&[4, 6], r.clone()).unwrap()).unwrap().to_vec_f32();
        check_grad("gelu", &x, &analytic, |x| {
            x.iter().zip(&r).map(|(&v, &w)| f64::from(gelu_scalar(v)) * f64::from(w)).sum()
        });
    }

    #[test]
    fn bias_gradient_matches_finite_differences() {
        let (rows, cols) = (3, 4);
        let x = Tensor::from_f32(&[rows, cols], random_vec(11, rows * cols, 1.0)).unwrap();
        let b = random_vec(12, cols, 1.0);
        let r = random_vec(13, rows * cols, 1.0);
        let analytic = bias_grad(&Tensor::from_f32(&[rows, cols], r.clone()).unwrap()).unwrap().to_vec_f32();
        check_grad("bias_add", &b, &analytic, |b| {
            let y = bias_add(&x, &Tensor::from_f32(&[cols], b.to_vec()).unwrap()).unwrap();
            y.to_vec_f32().iter().zip(&r).map(|(&a, &w)| f64::from(a) * f64::from(w)).sum()
        });
    }

    #[test]
    fn bias_add_and_grad() {
        let x = Tensor::from_f32(&[2, 3], vec![1., 2., 3., 4., 5., 6.]).unwrap();
        let b = Tensor::from_f32(&[3], vec![10., 20., 30.]).unwrap();
        assert_eq!(bias_add(&x, &b).unwrap().to_vec_f32(), vec![11., 22., 33., 14., 25., 36.]);
        assert_eq!(bias_grad(&x).unwrap().to_vec_f32(), vec![5., 7., 9.]);
        assert!(bias_add(&x, &x).is_err());
    }

    #[test]
    fn relu_by_hand() {
        let x = Tensor::from_f32(&[2, 2], vec![-1.5, 0.0, 2.0, -0.0]).unwrap();
        assert_eq!(relu(&x).unwrap().to_vec_f32(), vec![0.0, 0.0, 2.0, 0.0]);
    }
}

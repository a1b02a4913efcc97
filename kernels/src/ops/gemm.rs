//! GEMM on the CPU through `matrixmultiply::sgemm` (strided, so transposes cost nothing).

use super::Op;
use crate::cuda::CudaDevice;
use crate::error::{KernelError, Result};
use crate::tensor::Tensor;

/// A row-major GEMM: `C = alpha * op(A) * op(B) + beta * C`, `op(A)` is `m x k`, `op(B)` is `k x n`.
///
/// `A` is stored `m x k` (or `k x m` when `trans_a`); `B` is stored `k x n` (or `n x k` when `trans_b`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gemm {
    /// Rows of `op(A)` and `C`.
    pub m: usize,
    /// Inner dimension.
    pub k: usize,
    /// Columns of `op(B)` and `C`.
    pub n: usize,
    /// Use `A` transposed.
    pub trans_a: bool,
    /// Use `B` transposed.
    pub trans_b: bool,
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of the existing `C` (0 overwrites; 1 accumulates).
    pub beta: f32,
}

impl Gemm {
    /// `C = A * B` with `A: m x k`, `B: k x n`.
    pub fn new(m: usize, k: usize, n: usize) -> Self {
        Self { m, k, n, trans_a: false, trans_b: false, alpha: 1.0, beta: 0.0 }
    }

    /// Set the transposes.
    pub fn transposed(mut self, trans_a: bool, trans_b: bool) -> Self {
        self.trans_a = trans_a;
        self.trans_b = trans_b;
        self
    }

    /// Accumulate into `C` (`beta = 1`).
    pub fn accumulate(mut self) -> Self {
        self.beta = 1.0;
        self
    }

    /// Check the buffer lengths against the dimensions.
    pub fn check(&self, a: usize, b: usize, c: usize) -> Result<()> {
        let (mk, kn, mn) =
            (self.m.checked_mul(self.k), self.k.checked_mul(self.n), self.m.checked_mul(self.n));
        if mk != Some(a) || kn != Some(b) || mn != Some(c) {
            return Err(KernelError::shape(
                "gemm",
                format!(
                    "m={} k={} n={} needs A {:?}, B {:?}, C {:?} elements; got {a}, {b}, {c}",
                    self.m, self.k, self.n, mk, kn, mn
                ),
            ));
        }
        Ok(())
    }

    /// Run on the CPU over row-major slices.
    pub fn run_cpu(&self, a: &[f32], b: &[f32], c: &mut [f32]) -> Result<()> {
        self.check(a.len(), b.len(), c.len())?;
        if self.m == 0 || self.n == 0 {
            return Ok(());
        }
        let (m, k, n) = (self.m, self.k, self.n);
        let (rsa, csa) = if self.trans_a { (1, m) } else { (k, 1) };
        let (rsb, csb) = if self.trans_b { (1, k) } else { (n, 1) };
        // SAFETY: `check` proved A has m*k, B k*n and C m*n elements; with these strides every
        // index touched, (i*rs + p*cs), is below that count. `c` is borrowed mutably, so it does
        // not alias `a` or `b`.
        unsafe {
            matrixmultiply::sgemm(
                m,
                k,
                n,
                self.alpha,
                a.as_ptr(),
                rsa as isize,
                csa as isize,
                b.as_ptr(),
                rsb as isize,
                csb as isize,
                self.beta,
                c.as_mut_ptr(),
                n as isize,
                1,
            );
        }
        Ok(())
    }
}

/// The matrix product `op(a) * op(b)` of two f32 (or bf16, converted) matrices.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Matmul {
    /// Use `a` transposed.
    pub trans_a: bool,
    /// Use `b` transposed.
    pub trans_b: bool,
}

impl Matmul {
    /// The [`Gemm`] this product needs, checking the shapes.
    pub fn plan(&self, a: &Tensor, b: &Tensor) -> Result<Gemm> {
        let (ar, ac) = super::rows_cols("matmul", a)?;
        let (br, bc) = super::rows_cols("matmul", b)?;
        let (m, k) = if self.trans_a { (ac, ar) } else { (ar, ac) };
        let (k2, n) = if self.trans_b { (bc, br) } else { (br, bc) };
        if k != k2 {
            return Err(KernelError::shape(
                "matmul",
                format!(
                    "inner dimensions differ: {:?}{} x {:?}{}",
                    a.shape(),
                    if self.trans_a { "^T" } else { "" },
                    b.shape(),
                    if self.trans_b { "^T" } else { "" }
                ),
            ));
        }
        Ok(Gemm::new(m, k, n).transposed(self.trans_a, self.trans_b))
    }
}

impl Op for Matmul {
    type Args<'a> = (&'a Tensor, &'a Tensor);
    type Output = Tensor;
    const NAME: &'static str = "matmul";

    fn cpu(&self, (a, b): Self::Args<'_>) -> Result<Tensor> {
        let g = self.plan(a, b)?;
        let mut c = vec![0.0; g.m * g.n];
        g.run_cpu(&a.f32_cow(), &b.f32_cow(), &mut c)?;
        Tensor::from_f32(&[g.m, g.n], c)
    }

    fn cuda(&self, dev: &CudaDevice, (a, b): Self::Args<'_>) -> Result<Tensor> {
        crate::cuda::matmul(dev, a, b, self.trans_a, self.trans_b)
    }
}

/// `op(a) * op(b)` on the CPU.
pub fn matmul(a: &Tensor, b: &Tensor, trans_a: bool, trans_b: bool) -> Result<Tensor> {
    Matmul { trans_a, trans_b }.cpu((a, b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
            }
        }
        c
    }

    fn transpose(x: &[f32], r: usize, c: usize) -> Vec<f32> {
        let mut t = vec![0.0; r * c];
        for i in 0..r {
            for j in 0..c {
                t[j * r + i] = x[i * c + j];
            }
        }
        t
    }

    #[test]
    fn small_product_by_hand() {
        let a = Tensor::from_f32(&[2, 3], vec![1., 2., 3., 4., 5., 6.]).unwrap();
        let b = Tensor::from_f32(&[3, 2], vec![7., 8., 9., 10., 11., 12.]).unwrap();
        let c = matmul(&a, &b, false, false).unwrap();
        assert_eq!(c.shape(), &[2, 2]);
        assert_eq!(c.to_vec_f32(), vec![58., 64., 139., 154.]);
    }

    #[test]
    fn transposes_match_naive() {
        let (m, k, n) = (5, 7, 3);
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).cos()).collect();
        let want = naive(&a, &b, m, k, n);
        let at = Tensor::from_f32(&[k, m], transpose(&a, m, k)).unwrap();
        let bt = Tensor::from_f32(&[n, k], transpose(&b, k, n)).unwrap();
        let a = Tensor::from_f32(&[m, k], a).unwrap();
        let b = Tensor::from_f32(&[k, n], b).unwrap();
        for (x, y, ta, tb) in
            [(&a, &b, false, false), (&at, &b, true, false), (&a, &bt, false, true), (&at, &bt, true, true)]
        {
            let got = matmul(x, y, ta, tb).unwrap().to_vec_f32();
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() < 1e-5, "ta={ta} tb={tb}: {g} vs {w}");
            }
        }
        assert!(matmul(&a, &a, false, false).is_err());
    }

    #[test]
    fn accumulate_adds_to_c() {
        let g = Gemm::new(1, 1, 1).accumulate();
        let mut c = [1.0];
        g.run_cpu(&[2.0], &[3.0], &mut c).unwrap();
        assert_eq!(c, [7.0]);
        assert!(g.run_cpu(&[2.0, 1.0], &[3.0], &mut c).is_err());
    }
}

//! GEMM on the GPU through cuBLAS. Row-major `C = op(A) op(B)` is computed as the column-major
//! `C^T = op(B)^T op(A)^T`, which is cuBLAS's own layout: no copies, no explicit transposes.

use cudarc::cublas::Gemm as _;
use cudarc::cublas::GemmConfig;
use cudarc::cublas::sys::cublasOperation_t;
use cudarc::driver::{DevicePtr, DevicePtrMut};

use super::CudaDevice;
use crate::error::{KernelError, Result};
use crate::ops::{Gemm, Matmul};
use crate::tensor::Tensor;

fn as_i32(what: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| KernelError::invalid("cuBLAS gemm", format!("{what} = {v} exceeds i32")))
}

/// The cuBLAS (column-major) call that computes the row-major `g`: operands swapped, so cuBLAS's
/// A is our B's memory and its B is our A's memory.
///
/// Column-major view: B's memory is `op(B)^T` when `!trans_b` (ld n) and `op(B)` when `trans_b`
/// (ld k); likewise for A. cuBLAS computes `C^T` (n x m, ld n) `= op'(B mem) * op'(A mem)`.
pub(crate) fn cublas_config(g: &Gemm) -> Result<GemmConfig<f32>> {
    let op = |t: bool| {
        if t { cublasOperation_t::CUBLAS_OP_T } else { cublasOperation_t::CUBLAS_OP_N }
    };
    Ok(GemmConfig {
        transa: op(g.trans_b),
        transb: op(g.trans_a),
        m: as_i32("n", g.n)?,
        n: as_i32("m", g.m)?,
        k: as_i32("k", g.k)?,
        alpha: g.alpha,
        lda: as_i32("ldb", if g.trans_b { g.k } else { g.n }.max(1))?,
        ldb: as_i32("lda", if g.trans_a { g.m } else { g.k }.max(1))?,
        beta: g.beta,
        ldc: as_i32("ldc", g.n.max(1))?,
    })
}

/// Run `g` on device buffers or views of them (same row-major conventions as
/// [`Gemm::run_cpu`]).
pub fn gemm_device<A: DevicePtr<f32>, B: DevicePtr<f32>, C: DevicePtrMut<f32>>(
    dev: &CudaDevice,
    g: &Gemm,
    a: &A,
    b: &B,
    c: &mut C,
) -> Result<()> {
    g.check(a.len(), b.len(), c.len())?;
    if g.m == 0 || g.n == 0 {
        return Ok(());
    }
    let cfg = cublas_config(g)?;
    let blas = dev.blas()?;
    dev.bind()?;
    // SAFETY: `check` proved the buffers hold exactly the elements the dimensions and leading
    // dimensions above address; all three live on this device's stream.
    unsafe { blas.gemm(cfg, b, a, c) }.map_err(|e| KernelError::cuda("cublasSgemm", e))
}

/// `op(a) * op(b)` on the GPU (host tensors in and out).
pub fn matmul(dev: &CudaDevice, a: &Tensor, b: &Tensor, trans_a: bool, trans_b: bool) -> Result<Tensor> {
    let g = Matmul { trans_a, trans_b }.plan(a, b)?;
    let da = dev.upload(&a.f32_cow())?;
    let db = dev.upload(&b.f32_cow())?;
    let mut dc = dev.zeros(g.m * g.n)?;
    gemm_device(dev, &g, &da, &db, &mut dc)?;
    Tensor::from_f32(&[g.m, g.n], dev.download(&dc)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reference column-major SGEMM, written from the BLAS definition:
    /// `C = alpha op(A) op(B) + beta C`, `op(A)` m x k, element (i, j) of a matrix X at `X[i + j*ldx]`.
    fn blas_sgemm(cfg: &GemmConfig<f32>, a: &[f32], b: &[f32], c: &mut [f32]) {
        let (m, n, k) = (cfg.m as usize, cfg.n as usize, cfg.k as usize);
        let (lda, ldb, ldc) = (cfg.lda as usize, cfg.ldb as usize, cfg.ldc as usize);
        let ta = cfg.transa == cublasOperation_t::CUBLAS_OP_T;
        let tb = cfg.transb == cublasOperation_t::CUBLAS_OP_T;
        // Leading dimensions must be at least the stored rows (cuBLAS rejects smaller ones).
        assert!(lda >= if ta { k } else { m }.max(1));
        assert!(ldb >= if tb { n } else { k }.max(1));
        assert!(ldc >= m.max(1));
        let op_a = |i: usize, p: usize| if ta { a[p + i * lda] } else { a[i + p * lda] };
        let op_b = |p: usize, j: usize| if tb { b[j + p * ldb] } else { b[p + j * ldb] };
        for i in 0..m {
            for j in 0..n {
                let dot: f32 = (0..k).map(|p| op_a(i, p) * op_b(p, j)).sum();
                c[i + j * ldc] = cfg.alpha * dot + cfg.beta * c[i + j * ldc];
            }
        }
    }

    #[test]
    fn cublas_mapping_computes_the_row_major_product() {
        let (m, k, n) = (4, 3, 5);
        let a: Vec<f32> = (0..m * k).map(|i| i as f32 * 0.5 - 2.0).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i as f32).sin()).collect();
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let g = Gemm::new(m, k, n).transposed(ta, tb);
            let mut want = vec![0.0; m * n];
            g.run_cpu(&a, &b, &mut want).unwrap();
            let cfg = cublas_config(&g).unwrap();
            let mut got = vec![0.0; m * n];
            // Operands swapped, exactly as gemm_device passes them.
            blas_sgemm(&cfg, &b, &a, &mut got);
            for (x, y) in got.iter().zip(&want) {
                assert!((x - y).abs() < 1e-5, "ta={ta} tb={tb}: {got:?} vs {want:?}");
            }
        }
    }
}

//! GEMM on the GPU through cuBLAS. Row-major `C = op(A) op(B)` is computed as the column-major
//! `C^T = op(B)^T op(A)^T`, which is cuBLAS's own layout: no copies, no explicit transposes.

use cudarc::cublas::Gemm as _;
use cudarc::cublas::GemmConfig;
use cudarc::cublas::sys::cublasOperation_t;
use cudarc::driver::CudaSlice;

use super::CudaDevice;
use crate::error::{KernelError, Result};
use crate::ops::{Gemm, Matmul};
use crate::tensor::Tensor;

fn as_i32(what: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v)
        .map_err(|_| KernelError::invalid("cuBLAS gemm", format!("{what} = {v} exceeds i32")))
}

/// Run `g` on device buffers (same row-major conventions as [`Gemm::run_cpu`]).
pub fn gemm_device(
    dev: &CudaDevice,
    g: &Gemm,
    a: &CudaSlice<f32>,
    b: &CudaSlice<f32>,
    c: &mut CudaSlice<f32>,
) -> Result<()> {
    g.check(a.len(), b.len(), c.len())?;
    if g.m == 0 || g.n == 0 {
        return Ok(());
    }
    let op = |t: bool| {
        if t {
            cublasOperation_t::CUBLAS_OP_T
        } else {
            cublasOperation_t::CUBLAS_OP_N
        }
    };
    // Column-major view: B's memory is op(B)^T when !trans_b (ld n) and op(B) when trans_b (ld k);
    // likewise for A. cuBLAS computes C^T (n x m, ld n) = op'(B mem) * op'(A mem).
    let cfg = GemmConfig {
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
    };
    let blas = dev.blas()?;
    dev.bind()?;
    // SAFETY: `check` proved the buffers hold exactly the elements the dimensions and leading
    // dimensions above address; all three live on this device's stream.
    unsafe { blas.gemm(cfg, b, a, c) }.map_err(|e| KernelError::cuda("cublasSgemm", e))
}

/// `op(a) * op(b)` on the GPU (host tensors in and out).
pub fn matmul(
    dev: &CudaDevice,
    a: &Tensor,
    b: &Tensor,
    trans_a: bool,
    trans_b: bool,
) -> Result<Tensor> {
    let g = Matmul { trans_a, trans_b }.plan(a, b)?;
    let da = dev.upload(&a.f32_cow())?;
    let db = dev.upload(&b.f32_cow())?;
    let mut dc = dev.zeros(g.m * g.n)?;
    gemm_device(dev, &g, &da, &db, &mut dc)?;
    Tensor::from_f32(&[g.m, g.n], dev.download(&dc)?)
}

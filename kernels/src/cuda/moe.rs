//! The MoE expert FFN on the GPU: cuBLAS GEMMs plus NVRTC elementwise kernels (bias + GELU forward
//! and backward). Gather, gating and scatter are shared with the CPU path (`ops::moe`); weights are
//! uploaded per call (the weight store's device tier is where resident weights will come from).

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::CudaDevice;
use super::gemm::gemm_device;
use super::kernels::{MODULE, SRC};
use crate::error::{KernelError, Result};
use crate::ops::moe::{ExpertKernels, backward_with, forward_with};
use crate::ops::{ExpertCache, ExpertGrads, ExpertParams, Gemm, MoeCache, MoeGrads, Routing};
use crate::tensor::Tensor;

struct CudaExpert<'a> {
    dev: &'a CudaDevice,
}

fn dims_i32(total: usize, cols: usize) -> Result<(i32, i32, LaunchConfig)> {
    let t = i32::try_from(total)
        .map_err(|_| KernelError::invalid("moe cuda", format!("{total} elements exceed i32")))?;
    let c = i32::try_from(cols)
        .map_err(|_| KernelError::invalid("moe cuda", format!("{cols} columns exceed i32")))?;
    Ok((t, c, LaunchConfig::for_num_elems(t as u32)))
}

impl CudaExpert<'_> {
    fn gemm(&self, g: Gemm, a: &CudaSlice<f32>, b: &CudaSlice<f32>) -> Result<CudaSlice<f32>> {
        let mut c = self.dev.zeros(g.m * g.n)?;
        gemm_device(self.dev, &g, a, b, &mut c)?;
        Ok(c)
    }
}

impl ExpertKernels for CudaExpert<'_> {
    fn forward(&self, p: &ExpertParams, x: &[f32], n: usize) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let (d, hd) = p.dims()?;
        let dev = self.dev;
        let xd = dev.upload(x)?;
        let w1 = dev.upload(&p.w1.f32_cow())?;
        let b1 = dev.upload(&p.b1.f32_cow())?;
        let w2 = dev.upload(&p.w2.f32_cow())?;
        let b2 = dev.upload(&p.b2.f32_cow())?;

        let mut h = self.gemm(Gemm::new(n, d, hd), &xd, &w1)?;
        let mut a = dev.zeros(n * hd)?;
        let f = dev.function(MODULE, SRC, "bias_gelu_fwd")?;
        let (total, cols, cfg) = dims_i32(n * hd, hd)?;
        // SAFETY: h and a hold `total` f32s, b1 holds `cols`; the kernel bounds-checks `i < total`.
        unsafe {
            dev.stream()
                .launch_builder(&f)
                .arg(&mut h)
                .arg(&b1)
                .arg(&mut a)
                .arg(&total)
                .arg(&cols)
                .launch(cfg)
        }
        .map_err(|e| KernelError::cuda("launch bias_gelu_fwd", e))?;

        let mut o = self.gemm(Gemm::new(n, hd, d), &a, &w2)?;
        let f = dev.function(MODULE, SRC, "bias_add_rows")?;
        let (total, cols, cfg) = dims_i32(n * d, d)?;
        // SAFETY: o holds `total` f32s, b2 holds `cols`; bounds-checked in the kernel.
        unsafe { dev.stream().launch_builder(&f).arg(&mut o).arg(&b2).arg(&total).arg(&cols).launch(cfg) }
            .map_err(|e| KernelError::cuda("launch bias_add_rows", e))?;
        Ok((dev.download(&h)?, dev.download(&a)?, dev.download(&o)?))
    }

    fn backward(&self, p: &ExpertParams, c: &ExpertCache, d_o: &[f32]) -> Result<(ExpertGrads, Vec<f32>)> {
        let (d, hd) = p.dims()?;
        let n = c.tokens.len();
        let dev = self.dev;
        let d_o = dev.upload(d_o)?;
        let a = dev.upload(&c.a)?;
        let h = dev.upload(&c.h)?;
        let x = dev.upload(&c.x)?;
        let w1 = dev.upload(&p.w1.f32_cow())?;
        let w2 = dev.upload(&p.w2.f32_cow())?;
        let ones = dev.upload(&vec![1.0f32; n])?;

        let dw2 = self.gemm(Gemm::new(hd, n, d).transposed(true, false), &a, &d_o)?;
        let db2 = self.gemm(Gemm::new(1, n, d), &ones, &d_o)?;
        let mut dh = self.gemm(Gemm::new(n, d, hd).transposed(false, true), &d_o, &w2)?;
        let f = dev.function(MODULE, SRC, "gelu_bwd_inplace")?;
        let (total, _, cfg) = dims_i32(n * hd, hd)?;
        // SAFETY: dh and h hold `total` f32s; bounds-checked in the kernel.
        unsafe { dev.stream().launch_builder(&f).arg(&mut dh).arg(&h).arg(&total).launch(cfg) }
            .map_err(|e| KernelError::cuda("launch gelu_bwd_inplace", e))?;
        let dw1 = self.gemm(Gemm::new(d, n, hd).transposed(true, false), &x, &dh)?;
        let db1 = self.gemm(Gemm::new(1, n, hd), &ones, &dh)?;
        let dx = self.gemm(Gemm::new(n, hd, d).transposed(false, true), &dh, &w1)?;
        Ok((
            ExpertGrads {
                w1: Tensor::from_f32(&[d, hd], dev.download(&dw1)?)?,
                b1: Tensor::from_f32(&[hd], dev.download(&db1)?)?,
                w2: Tensor::from_f32(&[hd, d], dev.download(&dw2)?)?,
                b2: Tensor::from_f32(&[d], dev.download(&db2)?)?,
            },
            dev.download(&dx)?,
        ))
    }
}

/// MoE FFN forward on the GPU (same semantics and cache as [`crate::ops::moe_ffn_forward`]).
pub fn moe_ffn_forward(
    dev: &CudaDevice,
    x: &Tensor,
    routing: &Routing,
    experts: &[ExpertParams],
) -> Result<(Tensor, MoeCache)> {
    forward_with(&CudaExpert { dev }, x, routing, experts)
}

/// MoE FFN backward on the GPU (same semantics as [`crate::ops::moe_ffn_backward`]).
pub fn moe_ffn_backward(
    dev: &CudaDevice,
    dy: &Tensor,
    cache: &MoeCache,
    experts: &[ExpertParams],
) -> Result<MoeGrads> {
    backward_with(&CudaExpert { dev }, dy, cache, experts)
}

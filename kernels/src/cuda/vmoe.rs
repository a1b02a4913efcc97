//! The V-MoE's ops on the GPU (host tensors in and out, like the other `cuda` ops): layer norm,
//! GELU, bias gradients, cross-entropy, multi-head attention (cuBLAS projections, NVRTC per-head
//! products) and an AdamW whose moments stay on the device. Shapes are checked by the same CPU
//! references' rules before anything is uploaded.

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};

use super::CudaDevice;
use super::gemm::gemm_device;
use super::vmoe_src::{MODULE, SRC};
use crate::error::{KernelError, Result};
use crate::ops::{
    AttentionCache, AttentionGrads, AttentionParams, Gemm, LayerNormCache, LayerNormGrads, attention_dims,
    attention_from_heads, attention_to_heads, rows_cols,
};
use crate::tensor::Tensor;

/// `v` as the `int` the kernels take, or an error naming `what`.
fn as_i32(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| KernelError::invalid("cuda vmoe", format!("{what} = {v} exceeds i32")))
}

/// One thread per item, at least one block.
fn launch_for(items: i32) -> LaunchConfig {
    LaunchConfig::for_num_elems(items.max(1) as u32)
}

fn kernel(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    dev.bind()?;
    dev.function(MODULE, SRC, name)
}

/// Layer norm forward on the GPU; the cache is the CPU reference's (host) cache.
pub fn layer_norm(
    dev: &CudaDevice,
    x: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    eps: f32,
) -> Result<(Tensor, LayerNormCache)> {
    let (rows, cols) = crate::ops::layer_norm_dims(x, gamma, beta)?;
    let (r, c) = (as_i32("rows", rows)?, as_i32("columns", cols)?);
    let (xd, gd, bd) =
        (dev.upload(&x.f32_cow())?, dev.upload(&gamma.f32_cow())?, dev.upload(&beta.f32_cow())?);
    let (mut y, mut xhat, mut rstd) = (dev.zeros(rows * cols)?, dev.zeros(rows * cols)?, dev.zeros(rows)?);
    if r > 0 {
        let f = kernel(dev, "ln_fwd")?;
        // SAFETY: x, y, xhat hold rows*cols f32s, gamma/beta cols, rstd rows; one thread per row,
        // bounds-checked against `rows`.
        unsafe {
            dev.stream()
                .launch_builder(&f)
                .arg(&xd)
                .arg(&gd)
                .arg(&bd)
                .arg(&mut y)
                .arg(&mut xhat)
                .arg(&mut rstd)
                .arg(&r)
                .arg(&c)
                .arg(&eps)
                .launch(launch_for(r))
        }
        .map_err(|e| KernelError::cuda("launch ln_fwd", e))?;
    }
    let cache =
        LayerNormCache { x_hat: dev.download(&xhat)?, rstd: dev.download(&rstd)?, dims: (rows, cols) };
    Ok((Tensor::from_f32(&[rows, cols], dev.download(&y)?)?, cache))
}

/// Column sums of a device matrix (`rows x cols` -> `cols`), or of its product with `other`.
fn col_reduce(
    dev: &CudaDevice,
    a: &CudaSlice<f32>,
    other: Option<&CudaSlice<f32>>,
    rows: usize,
    cols: usize,
) -> Result<CudaSlice<f32>> {
    let (r, c) = (as_i32("rows", rows)?, as_i32("columns", cols)?);
    let mut out = dev.zeros(cols)?;
    if c == 0 {
        return Ok(out);
    }
    let name = if other.is_some() { "col_dot" } else { "col_sum" };
    let f = kernel(dev, name)?;
    let mut b = dev.stream().launch_builder(&f);
    b.arg(a);
    if let Some(o) = other {
        b.arg(o);
    }
    b.arg(&mut out).arg(&r).arg(&c);
    // SAFETY: a (and other) hold rows*cols f32s, out cols; one thread per column, bounds-checked.
    unsafe { b.launch(launch_for(c)) }.map_err(|e| KernelError::cuda("launch column reduction", e))?;
    Ok(out)
}

/// Layer norm backward on the GPU.
pub fn layer_norm_backward(
    dev: &CudaDevice,
    dy: &Tensor,
    gamma: &Tensor,
    cache: &LayerNormCache,
) -> Result<LayerNormGrads> {
    let (rows, cols) = cache.dims;
    if dy.shape() != [rows, cols]
        || gamma.numel() != cols
        || cache.x_hat.len() != rows * cols
        || cache.rstd.len() != rows
    {
        return Err(KernelError::shape(
            "layer_norm_backward",
            format!("dy {:?}, gamma {:?} for {rows}x{cols}", dy.shape(), gamma.shape()),
        ));
    }
    let (r, c) = (as_i32("rows", rows)?, as_i32("columns", cols)?);
    let dyd = dev.upload(&dy.f32_cow())?;
    let gd = dev.upload(&gamma.f32_cow())?;
    let xhat = dev.upload(&cache.x_hat)?;
    let rstd = dev.upload(&cache.rstd)?;
    let mut dx = dev.zeros(rows * cols)?;
    if r > 0 {
        let f = kernel(dev, "ln_bwd_dx")?;
        // SAFETY: dy, xhat, dx hold rows*cols f32s, gamma cols, rstd rows; one thread per row.
        unsafe {
            dev.stream()
                .launch_builder(&f)
                .arg(&dyd)
                .arg(&gd)
                .arg(&xhat)
                .arg(&rstd)
                .arg(&mut dx)
                .arg(&r)
                .arg(&c)
                .launch(launch_for(r))
        }
        .map_err(|e| KernelError::cuda("launch ln_bwd_dx", e))?;
    }
    let dgamma = col_reduce(dev, &dyd, Some(&xhat), rows, cols)?;
    let dbeta = col_reduce(dev, &dyd, None, rows, cols)?;
    Ok(LayerNormGrads {
        dx: Tensor::from_f32(&[rows, cols], dev.download(&dx)?)?,
        dgamma: Tensor::from_f32(&[cols], dev.download(&dgamma)?)?,
        dbeta: Tensor::from_f32(&[cols], dev.download(&dbeta)?)?,
    })
}

/// The bias gradient (column sums) on the GPU.
pub fn bias_grad(dev: &CudaDevice, dy: &Tensor) -> Result<Tensor> {
    let (rows, cols) = rows_cols("bias_grad", dy)?;
    let d = dev.upload(&dy.f32_cow())?;
    Tensor::from_f32(&[cols], dev.download(&col_reduce(dev, &d, None, rows, cols)?)?)
}

/// GELU (erf form) of every element on the GPU.
pub fn gelu(dev: &CudaDevice, x: &Tensor) -> Result<Tensor> {
    let n = as_i32("elements", x.numel())?;
    let xd = dev.upload(&x.f32_cow())?;
    let mut y = dev.zeros(x.numel())?;
    if n > 0 {
        let f = kernel(dev, "gelu_fwd")?;
        // SAFETY: x and y hold n f32s; bounds-checked.
        unsafe { dev.stream().launch_builder(&f).arg(&xd).arg(&mut y).arg(&n).launch(launch_for(n)) }
            .map_err(|e| KernelError::cuda("launch gelu_fwd", e))?;
    }
    Tensor::from_f32(x.shape(), dev.download(&y)?)
}

/// `dy * GELU'(x)` on the GPU.
pub fn gelu_backward(dev: &CudaDevice, x: &Tensor, dy: &Tensor) -> Result<Tensor> {
    if x.shape() != dy.shape() {
        return Err(KernelError::shape("gelu_backward", format!("x {:?} vs dy {:?}", x.shape(), dy.shape())));
    }
    let n = as_i32("elements", x.numel())?;
    let (xd, dyd) = (dev.upload(&x.f32_cow())?, dev.upload(&dy.f32_cow())?);
    let mut dx = dev.zeros(x.numel())?;
    if n > 0 {
        let f = kernel(dev, "gelu_bwd")?;
        // SAFETY: x, dy and dx hold n f32s; bounds-checked.
        unsafe {
            dev.stream().launch_builder(&f).arg(&xd).arg(&dyd).arg(&mut dx).arg(&n).launch(launch_for(n))
        }
        .map_err(|e| KernelError::cuda("launch gelu_bwd", e))?;
    }
    Tensor::from_f32(x.shape(), dev.download(&dx)?)
}

/// Mean cross-entropy with logits on the GPU: `(loss, d loss / d logits)`.
pub fn cross_entropy(dev: &CudaDevice, logits: &Tensor, targets: &[usize]) -> Result<(f32, Tensor)> {
    let (rows, cols) = crate::ops::cross_entropy_dims(logits, targets)?;
    let (r, c) = (as_i32("rows", rows)?, as_i32("columns", cols)?);
    let t32 = targets.iter().map(|&t| as_i32("target", t)).collect::<Result<Vec<i32>>>()?;
    let xd = dev.upload(&logits.f32_cow())?;
    let td = dev.stream().clone_htod(&t32).map_err(|e| KernelError::cuda("host-to-device copy", e))?;
    let mut grad = dev.zeros(rows * cols)?;
    let mut loss =
        dev.stream().alloc_zeros::<f64>(rows.max(1)).map_err(|e| KernelError::cuda("device alloc", e))?;
    if r > 0 {
        let f = kernel(dev, "xent_rows")?;
        // SAFETY: logits and grad hold rows*cols f32s, targets rows ints (< cols, checked above),
        // loss rows doubles; one thread per row, bounds-checked.
        unsafe {
            dev.stream()
                .launch_builder(&f)
                .arg(&xd)
                .arg(&td)
                .arg(&mut grad)
                .arg(&mut loss)
                .arg(&r)
                .arg(&c)
                .launch(launch_for(r))
        }
        .map_err(|e| KernelError::cuda("launch xent_rows", e))?;
    }
    let per_row = dev.stream().clone_dtoh(&loss).map_err(|e| KernelError::cuda("device-to-host copy", e))?;
    let total: f64 = per_row.iter().take(rows).sum();
    let mean = (total / rows.max(1) as f64) as f32;
    Ok((mean, Tensor::from_f32(&[rows, cols], dev.download(&grad)?)?))
}

/// Launch one of the per-head attention kernels over `seqs * heads * seq_len` threads.
struct HeadShape {
    seqs: i32,
    heads: i32,
    seq_len: i32,
    dh: i32,
    scale: f32,
    threads: i32,
}

impl HeadShape {
    fn new(seqs: usize, heads: usize, seq_len: usize, dh: usize) -> Result<Self> {
        let threads = seqs
            .checked_mul(heads)
            .and_then(|v| v.checked_mul(seq_len))
            .ok_or_else(|| KernelError::invalid("cuda attention", "seqs * heads * seq_len overflows"))?;
        Ok(Self {
            seqs: as_i32("seqs", seqs)?,
            heads: as_i32("heads", heads)?,
            seq_len: as_i32("seq_len", seq_len)?,
            dh: as_i32("head width", dh)?,
            scale: 1.0 / (dh as f32).sqrt(),
            threads: as_i32("attention threads", threads)?,
        })
    }
}

/// `C = op(A) op(B)` into a new device buffer.
fn gemm_new(dev: &CudaDevice, g: Gemm, a: &CudaSlice<f32>, b: &CudaSlice<f32>) -> Result<CudaSlice<f32>> {
    let mut c = dev.zeros(g.m * g.n)?;
    gemm_device(dev, &g, a, b, &mut c)?;
    Ok(c)
}

/// Multi-head self-attention forward on the GPU; the cache is the CPU reference's layout.
pub fn attention_forward(
    dev: &CudaDevice,
    x: &Tensor,
    p: &AttentionParams,
    seq_len: usize,
    heads: usize,
) -> Result<(Tensor, AttentionCache)> {
    let (rows, dim, seqs, dh) = attention_dims(x, p, seq_len, heads)?;
    let hs = HeadShape::new(seqs, heads, seq_len, dh)?;
    let xd = dev.upload(&x.f32_cow())?;
    let proj = Gemm::new(rows, dim, dim);
    let q = gemm_new(dev, proj, &xd, &dev.upload(&p.wq.f32_cow())?)?;
    let k = gemm_new(dev, proj, &xd, &dev.upload(&p.wk.f32_cow())?)?;
    let v = gemm_new(dev, proj, &xd, &dev.upload(&p.wv.f32_cow())?)?;
    let mut probs = dev.zeros(seqs * heads * seq_len * seq_len)?;
    let mut ctx = dev.zeros(rows * dim)?;
    if hs.threads > 0 {
        let f = kernel(dev, "attn_fwd")?;
        // SAFETY: q, k, v, ctx hold rows*dim f32s (rows = seqs*seq_len, dim = heads*dh), probs
        // seqs*heads*seq_len^2; one thread per (seq, head, query), bounds-checked.
        unsafe {
            dev.stream()
                .launch_builder(&f)
                .arg(&q)
                .arg(&k)
                .arg(&v)
                .arg(&mut probs)
                .arg(&mut ctx)
                .arg(&hs.seqs)
                .arg(&hs.heads)
                .arg(&hs.seq_len)
                .arg(&hs.dh)
                .arg(&hs.scale)
                .launch(launch_for(hs.threads))
        }
        .map_err(|e| KernelError::cuda("launch attn_fwd", e))?;
    }
    let y = gemm_new(dev, proj, &ctx, &dev.upload(&p.wo.f32_cow())?)?;
    let heads_of = |buf: &CudaSlice<f32>| -> Result<Vec<f32>> {
        Ok(attention_to_heads(&dev.download(buf)?, seq_len, heads, dh))
    };
    let cache = AttentionCache {
        x: x.clone(),
        q: heads_of(&q)?,
        k: heads_of(&k)?,
        v: heads_of(&v)?,
        probs: dev.download(&probs)?,
        ctx: Tensor::from_f32(&[rows, dim], dev.download(&ctx)?)?,
        seq_len,
        heads,
    };
    Ok((Tensor::from_f32(&[rows, dim], dev.download(&y)?)?, cache))
}

/// Gradients of [`attention_forward`] on the GPU.
pub fn attention_backward(
    dev: &CudaDevice,
    dy: &Tensor,
    p: &AttentionParams,
    cache: &AttentionCache,
) -> Result<AttentionGrads> {
    let (seq_len, heads) = (cache.seq_len, cache.heads);
    let (rows, dim, seqs, dh) = attention_dims(&cache.x, p, seq_len, heads)?;
    let saved = rows * dim;
    if dy.shape() != [rows, dim]
        || cache.q.len() != saved
        || cache.k.len() != saved
        || cache.v.len() != saved
        || cache.probs.len() != seqs * heads * seq_len * seq_len
        || cache.ctx.numel() != saved
    {
        return Err(KernelError::shape(
            "attention_backward",
            format!("dy {:?} or the cache does not match [{rows}, {dim}] with {heads} heads", dy.shape()),
        ));
    }
    let hs = HeadShape::new(seqs, heads, seq_len, dh)?;
    let rows_of = |m: &[f32]| dev.upload(&attention_from_heads(m, seq_len, heads, dh));
    let (q, k, v) = (rows_of(&cache.q)?, rows_of(&cache.k)?, rows_of(&cache.v)?);
    let probs = dev.upload(&cache.probs)?;
    let (xd, ctx, dyd) =
        (dev.upload(&cache.x.f32_cow())?, dev.upload(&cache.ctx.f32_cow())?, dev.upload(&dy.f32_cow())?);
    let (wq, wk, wv, wo) = (
        dev.upload(&p.wq.f32_cow())?,
        dev.upload(&p.wk.f32_cow())?,
        dev.upload(&p.wv.f32_cow())?,
        dev.upload(&p.wo.f32_cow())?,
    );
    // dWo = ctx^T dy; d ctx = dy Wo^T.
    let dwo = gemm_new(dev, Gemm::new(dim, rows, dim).transposed(true, false), &ctx, &dyd)?;
    let dctx = gemm_new(dev, Gemm::new(rows, dim, dim).transposed(false, true), &dyd, &wo)?;
    let mut ds = dev.zeros(seqs * heads * seq_len * seq_len)?;
    let (mut dq, mut dk, mut dv) = (dev.zeros(saved)?, dev.zeros(saved)?, dev.zeros(saved)?);
    if hs.threads > 0 {
        let fq = kernel(dev, "attn_bwd_q")?;
        // SAFETY: k, v, dctx, dq hold rows*dim f32s, probs and ds seqs*heads*seq_len^2; one thread
        // per (seq, head, query), bounds-checked.
        unsafe {
            dev.stream()
                .launch_builder(&fq)
                .arg(&k)
                .arg(&v)
                .arg(&probs)
                .arg(&dctx)
                .arg(&mut ds)
                .arg(&mut dq)
                .arg(&hs.seqs)
                .arg(&hs.heads)
                .arg(&hs.seq_len)
                .arg(&hs.dh)
                .arg(&hs.scale)
                .launch(launch_for(hs.threads))
        }
        .map_err(|e| KernelError::cuda("launch attn_bwd_q", e))?;
        let fkv = kernel(dev, "attn_bwd_kv")?;
        // SAFETY: as above; one thread per (seq, head, key).
        unsafe {
            dev.stream()
                .launch_builder(&fkv)
                .arg(&q)
                .arg(&probs)
                .arg(&ds)
                .arg(&dctx)
                .arg(&mut dk)
                .arg(&mut dv)
                .arg(&hs.seqs)
                .arg(&hs.heads)
                .arg(&hs.seq_len)
                .arg(&hs.dh)
                .launch(launch_for(hs.threads))
        }
        .map_err(|e| KernelError::cuda("launch attn_bwd_kv", e))?;
    }
    // dW = x^T dQ (and K, V); dx = dQ Wq^T + dK Wk^T + dV Wv^T.
    let wgrad = Gemm::new(dim, rows, dim).transposed(true, false);
    let (gq, gk, gv) =
        (gemm_new(dev, wgrad, &xd, &dq)?, gemm_new(dev, wgrad, &xd, &dk)?, gemm_new(dev, wgrad, &xd, &dv)?);
    let back = Gemm::new(rows, dim, dim).transposed(false, true);
    let mut dx = gemm_new(dev, back, &dq, &wq)?;
    gemm_device(dev, &back.accumulate(), &dk, &wk, &mut dx)?;
    gemm_device(dev, &back.accumulate(), &dv, &wv, &mut dx)?;
    let mat =
        |b: &CudaSlice<f32>, r: usize| -> Result<Tensor> { Tensor::from_f32(&[r, dim], dev.download(b)?) };
    Ok(AttentionGrads {
        dx: mat(&dx, rows)?,
        params: AttentionParams {
            wq: mat(&gq, dim)?,
            wk: mat(&gk, dim)?,
            wv: mat(&gv, dim)?,
            wo: mat(&dwo, dim)?,
        },
    })
}

/// AdamW with its moments resident on the device (the CPU [`crate::ops::AdamW`]'s rule): parameters
/// and gradients cross the bus, the optimizer state never does. One instance per parameter buffer.
/// Cloning copies the moments on the device.
#[derive(Clone)]
pub struct CudaAdamW {
    /// Learning rate, moment decays, denominator guard and decoupled weight decay.
    pub hyper: crate::ops::AdamW,
    m: CudaSlice<f32>,
    v: CudaSlice<f32>,
    t: i32,
}

impl std::fmt::Debug for CudaAdamW {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaAdamW")
            .field("hyper", &self.hyper)
            .field("len", &self.m.len())
            .field("t", &self.t)
            .finish()
    }
}

impl CudaAdamW {
    /// Moments for a buffer of `len` parameters, allocated (zeroed) on the device now: at load,
    /// not inside a step.
    pub fn new(dev: &CudaDevice, hyper: crate::ops::AdamW, len: usize) -> Result<Self> {
        Ok(Self { hyper, m: dev.zeros(len)?, v: dev.zeros(len)?, t: 0 })
    }

    /// Bytes the moments hold on the device.
    pub fn state_bytes(&self) -> u64 {
        ((self.m.len() + self.v.len()) * 4) as u64
    }

    /// One step of `params` (on the device) with `grads` (on the device).
    pub fn step_device(
        &mut self,
        dev: &CudaDevice,
        params: &mut CudaSlice<f32>,
        grads: &CudaSlice<f32>,
    ) -> Result<()> {
        if params.len() != self.m.len() || grads.len() != self.m.len() {
            return Err(KernelError::shape(
                "adamw",
                format!("{} params, {} grads for a state of {}", params.len(), grads.len(), self.m.len()),
            ));
        }
        let n = as_i32("parameters", params.len())?;
        self.t = self.t.saturating_add(1);
        let h = &self.hyper;
        let bc1 = 1.0 - h.beta1.powi(self.t);
        let bc2 = 1.0 - h.beta2.powi(self.t);
        if n == 0 {
            return Ok(());
        }
        let f = kernel(dev, "adamw_step")?;
        // SAFETY: params, grads, m and v hold n f32s (checked above); bounds-checked.
        unsafe {
            dev.stream()
                .launch_builder(&f)
                .arg(params)
                .arg(grads)
                .arg(&mut self.m)
                .arg(&mut self.v)
                .arg(&n)
                .arg(&h.lr)
                .arg(&h.beta1)
                .arg(&h.beta2)
                .arg(&h.eps)
                .arg(&h.weight_decay)
                .arg(&bc1)
                .arg(&bc2)
                .launch(launch_for(n))
        }
        .map_err(|e| KernelError::cuda("launch adamw_step", e))?;
        Ok(())
    }

    /// One step of host `params` with host `grads` (both uploaded, `params` copied back).
    pub fn step(&mut self, dev: &CudaDevice, params: &mut [f32], grads: &[f32]) -> Result<()> {
        let mut p = dev.upload(params)?;
        let g = dev.upload(grads)?;
        self.step_device(dev, &mut p, &g)?;
        let back = dev.download(&p)?;
        params.copy_from_slice(&back);
        Ok(())
    }
}

/// The PTX of the V-MoE kernels, compiled now (checks the CUDA C without a GPU).
pub fn vmoe_kernels_ptx() -> Result<String> {
    Ok(super::device::compile(SRC)?.to_src())
}

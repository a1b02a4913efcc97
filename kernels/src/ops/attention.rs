//! Multi-head self-attention over fixed-length sequences (one sequence per image), forward with a
//! cache and backward (input gradient and the Q/K/V/O projection gradients).
//!
//! `x` is `(seqs * seq_len) x dim`, sequence `s` occupying rows `s * seq_len ..`. Per head `h` of
//! width `dh = dim / heads`: `P = softmax(Q_h K_h^T / sqrt(dh))`, `C_h = P V_h`; the heads' contexts
//! are concatenated and projected: `y = C W_o`. Projections have no bias (the pre-norm's shift plays
//! that part). Projections run through [`matmul`]; the per-head products are direct loops over
//! head-major copies (each head contiguous, inner loops over `dh`): at these sizes (`seq_len` 64,
//! `dh` 8-16) a GEMM spent most of its time packing (measured: 37% of a training run).
//!
//! The cache holds the attention probabilities, `seqs * heads * seq_len^2` floats: the temporary that
//! grows with the square of the sequence length ([`AttentionCache::bytes`] measures it).

use super::{Op, matmul, rows_cols};
use crate::cuda::CudaDevice;
use crate::error::{KernelError, Result};
use crate::tensor::Tensor;

/// The four projections of one attention layer, each `dim x dim`.
#[derive(Clone, Debug)]
pub struct AttentionParams {
    /// Query projection.
    pub wq: Tensor,
    /// Key projection.
    pub wk: Tensor,
    /// Value projection.
    pub wv: Tensor,
    /// Output projection.
    pub wo: Tensor,
}

/// Everything the backward pass needs from the forward pass.
#[derive(Clone, Debug)]
pub struct AttentionCache {
    /// The input, `(seqs * seq_len) x dim`.
    pub x: Tensor,
    /// Queries, keys and values, head-major: `[seq][head][pos][dh]`.
    pub q: Vec<f32>,
    /// See `q`.
    pub k: Vec<f32>,
    /// See `q`.
    pub v: Vec<f32>,
    /// Attention probabilities `[seq][head][query][key]`.
    pub probs: Vec<f32>,
    /// Concatenated head contexts, `(seqs * seq_len) x dim` (the output projection's input).
    pub ctx: Tensor,
    /// Sequence length.
    pub seq_len: usize,
    /// Heads.
    pub heads: usize,
}

impl AttentionCache {
    /// Bytes of the saved activations (input, Q, K, V, probabilities, context).
    pub fn bytes(&self) -> u64 {
        let floats =
            self.x.numel() + self.q.len() + self.k.len() + self.v.len() + self.probs.len() + self.ctx.numel();
        (floats * 4) as u64
    }
}

/// Gradients of one attention layer.
#[derive(Clone, Debug)]
pub struct AttentionGrads {
    /// d loss / d x.
    pub dx: Tensor,
    /// d loss / d each projection.
    pub params: AttentionParams,
}

/// Shapes of an attention call: `(rows, dim, seqs, dh)`.
pub(crate) fn dims(
    x: &Tensor,
    p: &AttentionParams,
    seq_len: usize,
    heads: usize,
) -> Result<(usize, usize, usize, usize)> {
    let (rows, dim) = rows_cols("attention", x)?;
    if seq_len == 0 || !rows.is_multiple_of(seq_len) {
        return Err(KernelError::shape(
            "attention",
            format!("{rows} rows are not whole sequences of {seq_len}"),
        ));
    }
    if heads == 0 || !dim.is_multiple_of(heads) {
        return Err(KernelError::shape("attention", format!("dim {dim} does not split into {heads} heads")));
    }
    for (name, w) in [("wq", &p.wq), ("wk", &p.wk), ("wv", &p.wv), ("wo", &p.wo)] {
        if w.shape() != [dim, dim] {
            return Err(KernelError::shape(
                "attention",
                format!("{name} is {:?}, expected [{dim}, {dim}]", w.shape()),
            ));
        }
    }
    Ok((rows, dim, rows / seq_len, dim / heads))
}

#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(&x, &y)| x * y).sum()
}

/// `y += a x`.
#[inline(always)]
fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    y.iter_mut().zip(x).for_each(|(o, &v)| *o += a * v);
}

/// Max-subtracted softmax of one row, in place (f32: a row is a few hundred scores at most).
fn softmax_in_place(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    row.iter_mut().for_each(|v| *v *= inv);
}

/// `[row][head * dh + j]` (row-major `rows x dim`) to head-major `[seq][head][pos][j]`.
pub(crate) fn to_heads(m: &[f32], seq_len: usize, heads: usize, dh: usize) -> Vec<f32> {
    let dim = heads * dh;
    let mut out = vec![0.0; m.len()];
    for (r, row) in m.chunks_exact(dim).enumerate() {
        let (s, t) = (r / seq_len, r % seq_len);
        for h in 0..heads {
            let at = ((s * heads + h) * seq_len + t) * dh;
            out[at..at + dh].copy_from_slice(&row[h * dh..(h + 1) * dh]);
        }
    }
    out
}

/// The inverse of [`to_heads`].
pub(crate) fn from_heads(m: &[f32], seq_len: usize, heads: usize, dh: usize) -> Vec<f32> {
    let dim = heads * dh;
    let mut out = vec![0.0; m.len()];
    for (r, row) in out.chunks_exact_mut(dim).enumerate() {
        let (s, t) = (r / seq_len, r % seq_len);
        for h in 0..heads {
            let at = ((s * heads + h) * seq_len + t) * dh;
            row[h * dh..(h + 1) * dh].copy_from_slice(&m[at..at + dh]);
        }
    }
    out
}

/// One head of one sequence, forward: `probs = softmax(Q K^T * scale)` row by row, `ctx = probs V`.
/// `dh` is the head width; inlined into call sites that pass it as a literal.
#[inline(always)]
fn head_forward(
    dh: usize,
    scale: f32,
    (qs, ks, vs): (&[f32], &[f32], &[f32]),
    pr: &mut [f32],
    cs: &mut [f32],
) {
    let t = qs.len() / dh;
    for ((qi, prow), ci) in qs.chunks_exact(dh).zip(pr.chunks_exact_mut(t)).zip(cs.chunks_exact_mut(dh)) {
        // Scores of query i against every key, then a max-subtracted softmax in place.
        for (p, kj) in prow.iter_mut().zip(ks.chunks_exact(dh)) {
            *p = scale * dot(qi, kj);
        }
        softmax_in_place(prow);
        // Context: the probability-weighted sum of the values.
        for (&p, vj) in prow.iter().zip(vs.chunks_exact(dh)) {
            axpy(p, vj, ci);
        }
    }
}

/// One head of one sequence, backward: accumulates dQ, dK, dV from d context; `ds` is a scratch row.
#[inline(always)]
fn head_backward(
    dh: usize,
    scale: f32,
    (qs, ks, vs): (&[f32], &[f32], &[f32]),
    pr: &[f32],
    dc: &[f32],
    (dqs, dks, dvs): (&mut [f32], &mut [f32], &mut [f32]),
    ds: &mut [f32],
) {
    let t = qs.len() / dh;
    for (i, (prow, dci)) in pr.chunks_exact(t).zip(dc.chunks_exact(dh)).enumerate() {
        // dP_ij = dC_i . V_j; dV_j += P_ij dC_i.
        for (j, (d, vj)) in ds.iter_mut().zip(vs.chunks_exact(dh)).enumerate() {
            *d = dot(dci, vj);
            axpy(prow[j], dci, &mut dvs[j * dh..(j + 1) * dh]);
        }
        // Softmax backward, with the score scale folded in: dS = P (dP - P . dP) / sqrt(dh).
        let pd = dot(prow, ds);
        ds.iter_mut().zip(prow).for_each(|(g, &y)| *g = y * (*g - pd) * scale);
        // dQ_i = sum_j dS_ij K_j; dK_j += dS_ij Q_i.
        let qi = &qs[i * dh..(i + 1) * dh];
        let dqi = &mut dqs[i * dh..(i + 1) * dh];
        for (j, (&g, kj)) in ds.iter().zip(ks.chunks_exact(dh)).enumerate() {
            axpy(g, kj, dqi);
            axpy(g, qi, &mut dks[j * dh..(j + 1) * dh]);
        }
    }
}

/// Self-attention of `x` (`(seqs * seq_len) x dim`) with `heads` heads; returns `y` (same shape) and
/// the cache for [`attention_backward`].
pub fn attention_forward(
    x: &Tensor,
    p: &AttentionParams,
    seq_len: usize,
    heads: usize,
) -> Result<(Tensor, AttentionCache)> {
    let (rows, dim, seqs, dh) = dims(x, p, seq_len, heads)?;
    let q = to_heads(&matmul(x, &p.wq, false, false)?.f32_cow(), seq_len, heads, dh);
    let k = to_heads(&matmul(x, &p.wk, false, false)?.f32_cow(), seq_len, heads, dh);
    let v = to_heads(&matmul(x, &p.wv, false, false)?.f32_cow(), seq_len, heads, dh);
    let (tt, hd) = (seq_len * seq_len, seq_len * dh);
    let mut probs = vec![0.0f32; seqs * heads * tt];
    let mut ctx_h = vec![0.0f32; rows * dim];
    let scale = 1.0 / (dh as f32).sqrt();
    for sh in 0..seqs * heads {
        let span = sh * hd..(sh + 1) * hd;
        let pr = &mut probs[sh * tt..(sh + 1) * tt];
        let args = (&q[span.clone()], &k[span.clone()], &v[span.clone()]);
        let cs = &mut ctx_h[span];
        // A literal `dh` per arm lets the inlined loops unroll for the common head widths.
        match dh {
            8 => head_forward(8, scale, args, pr, cs),
            12 => head_forward(12, scale, args, pr, cs),
            16 => head_forward(16, scale, args, pr, cs),
            _ => head_forward(dh, scale, args, pr, cs),
        }
    }
    let ctx = Tensor::from_f32(&[rows, dim], from_heads(&ctx_h, seq_len, heads, dh))?;
    let y = matmul(&ctx, &p.wo, false, false)?;
    Ok((y, AttentionCache { x: x.clone(), q, k, v, probs, ctx, seq_len, heads }))
}

/// Gradients of [`attention_forward`] given `dy` (same shape as its output).
pub fn attention_backward(
    dy: &Tensor,
    p: &AttentionParams,
    cache: &AttentionCache,
) -> Result<AttentionGrads> {
    let (seq_len, heads) = (cache.seq_len, cache.heads);
    let (rows, dim, seqs, dh) = dims(&cache.x, p, seq_len, heads)?;
    if dy.shape() != [rows, dim] {
        return Err(KernelError::shape(
            "attention_backward",
            format!("dy {:?} for [{rows}, {dim}]", dy.shape()),
        ));
    }
    let wo = matmul(&cache.ctx, dy, true, false)?;
    let dctx = to_heads(&matmul(dy, &p.wo, false, true)?.f32_cow(), seq_len, heads, dh);
    let (t, tt, hd) = (seq_len, seq_len * seq_len, seq_len * dh);
    let scale = 1.0 / (dh as f32).sqrt();
    let (mut dq, mut dk, mut dv) =
        (vec![0.0f32; rows * dim], vec![0.0f32; rows * dim], vec![0.0f32; rows * dim]);
    let mut ds = vec![0.0f32; t];
    for sh in 0..seqs * heads {
        let span = sh * hd..(sh + 1) * hd;
        let pr = &cache.probs[sh * tt..(sh + 1) * tt];
        let saved = (&cache.q[span.clone()], &cache.k[span.clone()], &cache.v[span.clone()]);
        let dc = &dctx[span.clone()];
        let grads = (&mut dq[span.clone()], &mut dk[span.clone()], &mut dv[span]);
        match dh {
            8 => head_backward(8, scale, saved, pr, dc, grads, &mut ds),
            12 => head_backward(12, scale, saved, pr, dc, grads, &mut ds),
            16 => head_backward(16, scale, saved, pr, dc, grads, &mut ds),
            _ => head_backward(dh, scale, saved, pr, dc, grads, &mut ds),
        }
    }
    let mat = |m: &[f32]| Tensor::from_f32(&[rows, dim], from_heads(m, seq_len, heads, dh));
    let (dq, dk, dv) = (mat(&dq)?, mat(&dk)?, mat(&dv)?);
    let wq = matmul(&cache.x, &dq, true, false)?;
    let wk = matmul(&cache.x, &dk, true, false)?;
    let wv = matmul(&cache.x, &dv, true, false)?;
    let mut dx = matmul(&dq, &p.wq, false, true)?.to_vec_f32();
    for (g, w) in [(&dk, &p.wk), (&dv, &p.wv)] {
        let part = matmul(g, w, false, true)?;
        dx.iter_mut().zip(part.f32_cow().iter()).for_each(|(a, &b)| *a += b);
    }
    Ok(AttentionGrads { dx: Tensor::from_f32(&[rows, dim], dx)?, params: AttentionParams { wq, wk, wv, wo } })
}

/// Self-attention forward as an op: `(x, params)` to `(y, cache)`.
#[derive(Clone, Copy, Debug)]
pub struct Attention {
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Heads.
    pub heads: usize,
}

impl Op for Attention {
    type Args<'a> = (&'a Tensor, &'a AttentionParams);
    type Output = (Tensor, AttentionCache);
    const NAME: &'static str = "attention";

    fn cpu(&self, (x, p): Self::Args<'_>) -> Result<Self::Output> {
        attention_forward(x, p, self.seq_len, self.heads)
    }

    fn cuda(&self, dev: &CudaDevice, (x, p): Self::Args<'_>) -> Result<Self::Output> {
        crate::cuda::attention_forward(dev, x, p, self.seq_len, self.heads)
    }
}

/// Self-attention backward as an op: `(dy, params, cache)` to the gradients.
#[derive(Clone, Copy, Debug, Default)]
pub struct AttentionBackward;

impl Op for AttentionBackward {
    type Args<'a> = (&'a Tensor, &'a AttentionParams, &'a AttentionCache);
    type Output = AttentionGrads;
    const NAME: &'static str = "attention_backward";

    fn cpu(&self, (dy, p, cache): Self::Args<'_>) -> Result<AttentionGrads> {
        attention_backward(dy, p, cache)
    }

    fn cuda(&self, dev: &CudaDevice, (dy, p, cache): Self::Args<'_>) -> Result<AttentionGrads> {
        crate::cuda::attention_backward(dev, dy, p, cache)
    }
}

/// Bytes the forward pass keeps for `seqs` sequences of `seq_len` tokens of width `dim` with `heads`
/// heads: input, Q, K, V, context (`5 * seqs * seq_len * dim` floats) and the probabilities
/// (`seqs * heads * seq_len^2` floats, the term quadratic in the sequence length). Equals
/// [`AttentionCache::bytes`] of such a call.
pub fn attention_saved_bytes(seqs: usize, seq_len: usize, dim: usize, heads: usize) -> u64 {
    ((5 * seqs * seq_len * dim + seqs * heads * seq_len * seq_len) * 4) as u64
}

/// Bytes the backward pass allocates: the head-major d context, dQ, dK, dV and the summed input
/// gradient (`5 * seqs * seq_len * dim` floats), one head's score gradient (`seq_len^2`), and the four
/// projection gradients (`4 * dim^2`).
pub fn attention_backward_bytes(seqs: usize, seq_len: usize, dim: usize) -> u64 {
    ((5 * seqs * seq_len * dim + seq_len * seq_len + 4 * dim * dim) * 4) as u64
}

/// Everything one attention layer needs in a training step: [`attention_saved_bytes`] plus
/// [`attention_backward_bytes`].
pub fn attention_tmp_bytes(seqs: usize, seq_len: usize, dim: usize, heads: usize) -> u64 {
    attention_saved_bytes(seqs, seq_len, dim, heads) + attention_backward_bytes(seqs, seq_len, dim)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::gradcheck::{check_grad, random_vec};

    fn t(v: &[f32], s: &[usize]) -> Tensor {
        Tensor::from_f32(s, v.to_vec()).unwrap()
    }

    #[test]
    fn one_key_attends_fully_and_uniform_keys_average() {
        // seq_len 1: softmax of one score is 1, so ctx = V and y = x Wv Wo. Identity weights: y = x.
        let eye: Vec<f32> = (0..4).map(|i| if i % 3 == 0 { 1.0 } else { 0.0 }).collect();
        let id = AttentionParams {
            wq: t(&eye, &[2, 2]),
            wk: t(&eye, &[2, 2]),
            wv: t(&eye, &[2, 2]),
            wo: t(&eye, &[2, 2]),
        };
        let x = t(&[0.5, -1.0, 2.0, 3.0], &[2, 2]);
        let (y, _) = attention_forward(&x, &id, 1, 1).unwrap();
        assert_eq!(y.to_vec_f32(), x.to_vec_f32());
        // Zero queries: every score is 0, probabilities uniform, each output the mean of the values.
        let zero = t(&[0.0; 4], &[2, 2]);
        let p = AttentionParams { wq: zero, ..id };
        let (y, c) = attention_forward(&x, &p, 2, 2).unwrap();
        assert!(c.probs.iter().all(|&v| (v - 0.5).abs() < 1e-6), "{:?}", c.probs);
        assert_eq!(y.to_vec_f32(), vec![1.25, 1.0, 1.25, 1.0]);
        assert!(attention_forward(&x, &p, 3, 1).is_err());
        assert!(attention_forward(&x, &p, 2, 3).is_err());
    }

    #[test]
    fn gradients_match_finite_differences() {
        // Head width 2 takes the generic loops, 8 the unrolled ones.
        for (dim, heads) in [(4, 2), (16, 2)] {
            gradients_match_for(2, 3, dim, heads);
        }
    }

    fn gradients_match_for(seqs: usize, seq_len: usize, dim: usize, heads: usize) {
        let rows = seqs * seq_len;
        let x = random_vec(11, rows * dim, 1.0);
        let w: Vec<Vec<f32>> = (0..4).map(|i| random_vec(20 + i, dim * dim, 0.8)).collect();
        let r = random_vec(30, rows * dim, 1.0);
        let params = |w: &[Vec<f32>]| AttentionParams {
            wq: t(&w[0], &[dim, dim]),
            wk: t(&w[1], &[dim, dim]),
            wv: t(&w[2], &[dim, dim]),
            wo: t(&w[3], &[dim, dim]),
        };
        let loss = |x: &[f32], w: &[Vec<f32>]| -> f64 {
            let (y, _) = attention_forward(&t(x, &[rows, dim]), &params(w), seq_len, heads).unwrap();
            y.to_vec_f32().iter().zip(&r).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum()
        };
        let p = params(&w);
        let (_, cache) = attention_forward(&t(&x, &[rows, dim]), &p, seq_len, heads).unwrap();
        let g = attention_backward(&t(&r, &[rows, dim]), &p, &cache).unwrap();
        check_grad("attention dx", &x, &g.dx.to_vec_f32(), |x| loss(x, &w));
        let grads = [&g.params.wq, &g.params.wk, &g.params.wv, &g.params.wo];
        for (i, (name, grad)) in ["dwq", "dwk", "dwv", "dwo"].iter().zip(grads).enumerate() {
            check_grad(name, &w[i], &grad.to_vec_f32(), |v| {
                let mut w2 = w.clone();
                w2[i] = v.to_vec();
                loss(&x, &w2)
            });
        }
    }

    #[test]
    fn cache_bytes_grow_with_the_square_of_the_sequence() {
        let p = |d: usize| AttentionParams {
            wq: Tensor::zeros(&[d, d]).unwrap(),
            wk: Tensor::zeros(&[d, d]).unwrap(),
            wv: Tensor::zeros(&[d, d]).unwrap(),
            wo: Tensor::zeros(&[d, d]).unwrap(),
        };
        let bytes = |seq_len: usize| {
            let x = Tensor::zeros(&[seq_len, 4]).unwrap();
            attention_forward(&x, &p(4), seq_len, 2).unwrap().1.bytes()
        };
        // One sequence, dim 4, 2 heads: 5 * T * 4 linear floats plus 2 * T^2 probabilities.
        assert_eq!(bytes(8), ((5 * 8 * 4 + 2 * 64) * 4) as u64);
        assert_eq!(bytes(16), ((5 * 16 * 4 + 2 * 256) * 4) as u64);
        // The plan's forward share is exactly what the forward keeps.
        assert_eq!(attention_saved_bytes(1, 16, 4, 2), bytes(16));
        assert!(attention_tmp_bytes(1, 16, 4, 2) > bytes(16));
    }
}

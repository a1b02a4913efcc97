//! The MoE expert FFN, forward and backward: per expert `GELU(x W1 + b1) W2 + b2`, tokens gathered
//! by the routing, outputs weighted by their gate and scattered back (`y[t] = sum_e g_te FFN_e(x_t)`).
//!
//! The gather / weight / scatter logic is shared by the CPU and CUDA paths; only the per-expert
//! dense work ([`ExpertKernels`]) differs.
//!
//! On the CPU the experts of a block can run concurrently, each on the number of threads a planner
//! gives it ([`with_expert_threads`]: the co-adaptation executor installs fill-clamp-refill there);
//! an expert on `k` threads splits its rows into `k` contiguous chunks. Without a planner every
//! expert runs in turn on the caller's thread, as before.

use std::cell::RefCell;
use std::rc::Rc;

use super::elementwise::{gelu_grad_scalar, gelu_scalar};
use super::gemm::Gemm;
use super::routing::Routing;
use super::{Op, rows_cols};
use crate::cuda::CudaDevice;
use crate::error::{KernelError, Result};
use crate::tensor::Tensor;

/// One expert's weights: `w1: d x h`, `b1: h`, `w2: h x d`, `b2: d`.
#[derive(Clone, Debug)]
pub struct ExpertParams {
    /// Up projection, `d_model x d_hidden`.
    pub w1: Tensor,
    /// Up bias, `d_hidden`.
    pub b1: Tensor,
    /// Down projection, `d_hidden x d_model`.
    pub w2: Tensor,
    /// Down bias, `d_model`.
    pub b2: Tensor,
}

impl ExpertParams {
    /// `(d_model, d_hidden)`, checking that the four tensors agree.
    pub fn dims(&self) -> Result<(usize, usize)> {
        let (d, h) = rows_cols("moe expert w1", &self.w1)?;
        let (h2, d2) = rows_cols("moe expert w2", &self.w2)?;
        if h2 != h || d2 != d || self.b1.numel() != h || self.b2.numel() != d {
            return Err(KernelError::shape(
                "moe expert",
                format!(
                    "w1 {:?}, b1 {:?}, w2 {:?}, b2 {:?} do not form a d x h FFN",
                    self.w1.shape(),
                    self.b1.shape(),
                    self.w2.shape(),
                    self.b2.shape()
                ),
            ));
        }
        Ok((d, h))
    }
}

/// Gradients of one expert's weights.
#[derive(Clone, Debug)]
pub struct ExpertGrads {
    /// d loss / d w1.
    pub w1: Tensor,
    /// d loss / d b1.
    pub b1: Tensor,
    /// d loss / d w2.
    pub w2: Tensor,
    /// d loss / d b2.
    pub b2: Tensor,
}

impl ExpertGrads {
    /// The gradients of a `d -> hd -> d` expert from their row-major values.
    fn from_parts(
        d: usize,
        hd: usize,
        w1: Vec<f32>,
        b1: Vec<f32>,
        w2: Vec<f32>,
        b2: Vec<f32>,
    ) -> Result<Self> {
        Ok(Self {
            w1: Tensor::from_f32(&[d, hd], w1)?,
            b1: Tensor::from_f32(&[hd], b1)?,
            w2: Tensor::from_f32(&[hd, d], w2)?,
            b2: Tensor::from_f32(&[d], b2)?,
        })
    }
}

/// What one expert's forward pass keeps for the backward pass (row-major, one row per assignment).
#[derive(Clone, Debug, Default)]
pub struct ExpertCache {
    /// Token index of each row.
    pub tokens: Vec<usize>,
    /// Gate of each row.
    pub gates: Vec<f32>,
    /// Gathered inputs, `n x d`.
    pub x: Vec<f32>,
    /// Pre-activations `x W1 + b1`, `n x h`.
    pub h: Vec<f32>,
    /// Activations `GELU(h)`, `n x h`.
    pub a: Vec<f32>,
    /// Expert outputs before gating `a W2 + b2`, `n x d`.
    pub o: Vec<f32>,
}

/// The forward pass's saved state.
#[derive(Clone, Debug)]
pub struct MoeCache {
    /// Per expert.
    pub experts: Vec<ExpertCache>,
    /// Tokens in the batch.
    pub num_tokens: usize,
    /// Model width.
    pub d_model: usize,
}

/// Everything the backward pass produces.
#[derive(Clone, Debug)]
pub struct MoeGrads {
    /// Per-expert weight gradients.
    pub experts: Vec<ExpertGrads>,
    /// Per expert, d loss / d gate for each assignment (same order as the routing).
    pub dgates: Vec<Vec<f32>>,
    /// d loss / d x, `tokens x d`.
    pub dx: Tensor,
}

/// The per-expert dense work; the CPU and CUDA backends implement it.
pub(crate) trait ExpertKernels {
    /// From gathered `x` (`n x d`): `(h, a, o)` as in [`ExpertCache`].
    fn forward(&self, p: &ExpertParams, x: &[f32], n: usize) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)>;
    /// From `d o` (`n x d`, already gate-weighted): the weight grads and `d x` (`n x d`).
    fn backward(&self, p: &ExpertParams, c: &ExpertCache, d_o: &[f32]) -> Result<(ExpertGrads, Vec<f32>)>;
    /// Whether [`with_expert_threads`]' planner applies (the CPU backend).
    fn threaded(&self) -> bool {
        false
    }
}

/// The CPU reference of the per-expert work.
pub(crate) struct CpuExpert;

fn col_sums(x: &[f32], cols: usize) -> Vec<f32> {
    let mut acc = vec![0f64; cols];
    for row in x.chunks_exact(cols.max(1)) {
        for (a, &v) in acc.iter_mut().zip(row) {
            *a += f64::from(v);
        }
    }
    acc.into_iter().map(|v| v as f32).collect()
}

impl ExpertKernels for CpuExpert {
    fn threaded(&self) -> bool {
        true
    }

    fn forward(&self, p: &ExpertParams, x: &[f32], n: usize) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let (d, hd) = p.dims()?;
        let (b1, b2) = (p.b1.f32_cow(), p.b2.f32_cow());
        let mut h = vec![0.0; n * hd];
        Gemm::new(n, d, hd).run_cpu(x, &p.w1.f32_cow(), &mut h)?;
        for row in h.chunks_exact_mut(hd.max(1)) {
            row.iter_mut().zip(b1.iter()).for_each(|(v, &b)| *v += b);
        }
        let a: Vec<f32> = h.iter().map(|&v| gelu_scalar(v)).collect();
        let mut o = vec![0.0; n * d];
        Gemm::new(n, hd, d).run_cpu(&a, &p.w2.f32_cow(), &mut o)?;
        for row in o.chunks_exact_mut(d.max(1)) {
            row.iter_mut().zip(b2.iter()).for_each(|(v, &b)| *v += b);
        }
        Ok((h, a, o))
    }

    fn backward(&self, p: &ExpertParams, c: &ExpertCache, d_o: &[f32]) -> Result<(ExpertGrads, Vec<f32>)> {
        let (d, hd) = p.dims()?;
        let n = c.tokens.len();
        let mut dw2 = vec![0.0; hd * d];
        Gemm::new(hd, n, d).transposed(true, false).run_cpu(&c.a, d_o, &mut dw2)?;
        let db2 = col_sums(d_o, d);
        let mut da = vec![0.0; n * hd];
        Gemm::new(n, d, hd).transposed(false, true).run_cpu(d_o, &p.w2.f32_cow(), &mut da)?;
        let dh: Vec<f32> = da.iter().zip(&c.h).map(|(&g, &h)| g * gelu_grad_scalar(h)).collect();
        let mut dw1 = vec![0.0; d * hd];
        Gemm::new(d, n, hd).transposed(true, false).run_cpu(&c.x, &dh, &mut dw1)?;
        let db1 = col_sums(&dh, hd);
        let mut dx = vec![0.0; n * d];
        Gemm::new(n, hd, d).transposed(false, true).run_cpu(&dh, &p.w1.f32_cow(), &mut dx)?;
        Ok((ExpertGrads::from_parts(d, hd, dw1, db1, dw2, db2)?, dx))
    }
}

/// Forward with the gather / gate / scatter shared by all backends.
pub(crate) fn forward_with(
    k: &impl ExpertKernels,
    x: &Tensor,
    routing: &Routing,
    experts: &[ExpertParams],
) -> Result<(Tensor, MoeCache)> {
    let (tokens, d) = rows_cols("moe_ffn_forward", x)?;
    if tokens != routing.num_tokens || experts.len() != routing.num_experts {
        return Err(KernelError::shape(
            "moe_ffn_forward",
            format!(
                "{tokens} tokens and {} experts, routing is for {} and {}",
                experts.len(),
                routing.num_tokens,
                routing.num_experts
            ),
        ));
    }
    let xv = x.f32_cow();
    let mut y = vec![0.0; tokens * d];
    let mut caches = Vec::with_capacity(experts.len());
    let mut gathered = Vec::with_capacity(experts.len());
    for (p, assigned) in experts.iter().zip(&routing.experts) {
        let (pd, _) = p.dims()?;
        if pd != d {
            return Err(KernelError::shape(
                "moe_ffn_forward",
                format!("expert d_model {pd} vs input width {d}"),
            ));
        }
        let mut xe = Vec::with_capacity(assigned.len() * d);
        for a in assigned {
            xe.extend_from_slice(&xv[a.token * d..(a.token + 1) * d]);
        }
        gathered.push(xe);
    }
    let rows: Vec<usize> = routing.experts.iter().map(Vec::len).collect();
    let plan = if k.threaded() { planned_threads(&rows)? } else { None };
    let outputs = match plan {
        Some(threads) => experts_forward_threaded(experts, &gathered, &rows, &threads, d)?,
        None => experts
            .iter()
            .zip(&gathered)
            .zip(&rows)
            .map(|((p, xe), &n)| if n == 0 { Ok(Default::default()) } else { k.forward(p, xe, n) })
            .collect::<Result<_>>()?,
    };
    for ((assigned, xe), (h, act, o)) in routing.experts.iter().zip(gathered).zip(outputs) {
        for (a, orow) in assigned.iter().zip(o.chunks_exact(d.max(1))) {
            for (yv, &ov) in y[a.token * d..(a.token + 1) * d].iter_mut().zip(orow) {
                *yv += a.gate * ov;
            }
        }
        caches.push(ExpertCache {
            tokens: assigned.iter().map(|a| a.token).collect(),
            gates: assigned.iter().map(|a| a.gate).collect(),
            x: xe,
            h,
            a: act,
            o,
        });
    }
    Ok((Tensor::from_f32(&[tokens, d], y)?, MoeCache { experts: caches, num_tokens: tokens, d_model: d }))
}

/// Backward with the gather / gate / scatter shared by all backends.
pub(crate) fn backward_with(
    k: &impl ExpertKernels,
    dy: &Tensor,
    cache: &MoeCache,
    experts: &[ExpertParams],
) -> Result<MoeGrads> {
    let d = cache.d_model;
    if dy.shape() != [cache.num_tokens, d] || experts.len() != cache.experts.len() {
        return Err(KernelError::shape(
            "moe_ffn_backward",
            format!(
                "dy {:?} and {} experts for a forward of {}x{d} with {} experts",
                dy.shape(),
                experts.len(),
                cache.num_tokens,
                cache.experts.len()
            ),
        ));
    }
    let dyv = dy.f32_cow();
    let mut dx = vec![0.0; cache.num_tokens * d];
    let mut grads = Vec::with_capacity(experts.len());
    let mut dgates = Vec::with_capacity(experts.len());
    let mut d_os = Vec::with_capacity(experts.len());
    for (p, c) in experts.iter().zip(&cache.experts) {
        let (pd, _) = p.dims()?;
        if pd != d {
            return Err(KernelError::shape("moe_ffn_backward", "expert width changed since forward"));
        }
        let n = c.tokens.len();
        let mut d_o = Vec::with_capacity(n * d);
        let mut dg = Vec::with_capacity(n);
        for (i, (&t, &g)) in c.tokens.iter().zip(&c.gates).enumerate() {
            let dyr = &dyv[t * d..(t + 1) * d];
            let orow = &c.o[i * d..(i + 1) * d];
            dg.push(dyr.iter().zip(orow).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum::<f64>() as f32);
            d_o.extend(dyr.iter().map(|&v| g * v));
        }
        dgates.push(dg);
        d_os.push(d_o);
    }
    let rows: Vec<usize> = cache.experts.iter().map(|c| c.tokens.len()).collect();
    let plan = if k.threaded() { planned_threads(&rows)? } else { None };
    let mut threaded = match plan {
        Some(threads) => {
            Some(experts_backward_threaded(experts, &cache.experts, &d_os, &threads, d)?.into_iter())
        }
        None => None,
    };
    for ((p, c), d_o) in experts.iter().zip(&cache.experts).zip(&d_os) {
        let (_, hd) = p.dims()?;
        let n = c.tokens.len();
        let (eg, dxe) = if let Some(done) = threaded.as_mut() {
            done.next().ok_or_else(|| KernelError::shape("moe_ffn_backward", "threaded result missing"))?
        } else if n == 0 {
            (
                ExpertGrads {
                    w1: Tensor::zeros(&[d, hd])?,
                    b1: Tensor::zeros(&[hd])?,
                    w2: Tensor::zeros(&[hd, d])?,
                    b2: Tensor::zeros(&[d])?,
                },
                Vec::new(),
            )
        } else {
            k.backward(p, c, d_o)?
        };
        for (&t, row) in c.tokens.iter().zip(dxe.chunks_exact(d.max(1))) {
            for (o, &v) in dx[t * d..(t + 1) * d].iter_mut().zip(row) {
                *o += v;
            }
        }
        grads.push(eg);
    }
    Ok(MoeGrads { experts: grads, dgates, dx: Tensor::from_f32(&[cache.num_tokens, d], dx)? })
}

/// Decides how many threads each expert of a block gets from the rows (routed tokens) of each;
/// `0` for an expert with no rows. Called once per block in the forward and once in the backward.
/// An empty plan runs the block's experts in turn on the caller's thread (as without a planner:
/// the planner judged the work too small to pay for threads).
pub type ExpertThreadPlanner = dyn Fn(&[usize]) -> Vec<u32>;

thread_local! {
    static PLANNER: RefCell<Option<Rc<ExpertThreadPlanner>>> = const { RefCell::new(None) };
}

/// Runs `f` with `planner` deciding the expert threads of every CPU MoE forward and backward that
/// `f` runs on this thread (restored afterwards, also on panic).
pub fn with_expert_threads<R>(planner: Rc<ExpertThreadPlanner>, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Rc<ExpertThreadPlanner>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let prev = self.0.take();
            PLANNER.with(|p| *p.borrow_mut() = prev);
        }
    }
    let _restore = Restore(PLANNER.with(|p| p.borrow_mut().replace(planner)));
    f()
}

/// The installed planner's threads for these rows, checked (one entry per expert, at least one
/// thread for an expert with rows, at most one per row); `None` without a planner or when it
/// planned none (an empty plan: run serially).
fn planned_threads(rows: &[usize]) -> Result<Option<Vec<usize>>> {
    let Some(planner) = PLANNER.with(|p| p.borrow().clone()) else { return Ok(None) };
    let plan = planner(rows);
    if plan.is_empty() {
        return Ok(None);
    }
    if plan.len() != rows.len() {
        return Err(KernelError::shape(
            "moe expert threads",
            format!("{} entries for {} experts", plan.len(), rows.len()),
        ));
    }
    Ok(Some(rows.iter().zip(plan).map(|(&n, t)| if n == 0 { 0 } else { (t as usize).clamp(1, n) }).collect()))
}

/// `n` rows in `k` contiguous chunks as `(start, len)`, the first `n % k` one row longer.
fn chunks(n: usize, k: usize) -> Vec<(usize, usize)> {
    let k = k.max(1);
    let (base, extra) = (n / k, n % k);
    let mut out = Vec::with_capacity(k);
    let mut start = 0;
    for i in 0..k {
        let len = base + usize::from(i < extra);
        out.push((start, len));
        start += len;
    }
    out
}

/// One expert's forward outputs `(h, a, o)`, as in [`ExpertCache`].
type ExpertOutputs = (Vec<f32>, Vec<f32>, Vec<f32>);

/// The process's expert threads: one pool sized to the machine's cores, built on first use, whose
/// idle workers park. Spawning threads per block instead costs a clone, a fresh stack and its page
/// faults every call, which dominated small experts' work. `None` when the pool cannot be built:
/// the experts then run in turn on the caller's thread.
fn expert_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        let n = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .thread_name(|i| format!("troupe-expert-{i}"))
            .build()
            .map_err(|e| tracing::warn!("expert thread pool not built ({e}); experts run in turn"))
            .ok()
    })
    .as_ref()
}

/// Runs every job (one per chunk of an expert's rows) at once on the expert pool, or in turn
/// without one; a job that panics is reported as an error, as the ops report their own failures.
fn run_chunks<T: Send>(jobs: Vec<Box<dyn FnOnce() -> Result<T> + Send + '_>>) -> Result<Vec<T>> {
    let run = |job: Box<dyn FnOnce() -> Result<T> + Send + '_>| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(job))
            .unwrap_or_else(|_| Err(KernelError::shape("moe expert", "an expert thread panicked")))
    };
    let Some(pool) = expert_pool() else { return jobs.into_iter().map(run).collect() };
    let mut out: Vec<Option<Result<T>>> = jobs.iter().map(|_| None).collect();
    pool.scope(|scope| {
        for (job, slot) in jobs.into_iter().zip(out.iter_mut()) {
            scope.spawn(move |_| *slot = Some(run(job)));
        }
    });
    out.into_iter()
        .map(|r| r.unwrap_or_else(|| Err(KernelError::shape("moe expert", "a chunk did not run"))))
        .collect()
}

/// The CPU expert forward of every expert, each on its planned threads: `(h, a, o)` per expert.
fn experts_forward_threaded(
    experts: &[ExpertParams],
    gathered: &[Vec<f32>],
    rows: &[usize],
    threads: &[usize],
    d: usize,
) -> Result<Vec<ExpertOutputs>> {
    type Job<'a> = Box<dyn FnOnce() -> Result<ExpertOutputs> + Send + 'a>;
    let hd: Vec<usize> = experts.iter().map(|p| p.dims().map(|(_, h)| h)).collect::<Result<_>>()?;
    let mut owner = Vec::new();
    let mut jobs: Vec<Job<'_>> = Vec::new();
    for (e, p) in experts.iter().enumerate() {
        for (start, len) in chunks(rows[e], threads[e]).into_iter().filter(|(_, len)| *len > 0) {
            let x = &gathered[e][start * d..(start + len) * d];
            owner.push(e);
            jobs.push(Box::new(move || CpuExpert.forward(p, x, len)));
        }
    }
    let mut out: Vec<ExpertOutputs> = experts.iter().map(|_| Default::default()).collect();
    // Chunks come back in order, so each expert's rows are concatenated as they were split.
    for (e, (ph, pa, po)) in owner.into_iter().zip(run_chunks(jobs)?) {
        let (h, a, o) = &mut out[e];
        h.extend(ph);
        a.extend(pa);
        o.extend(po);
    }
    debug_assert!(out.iter().enumerate().all(|(e, (h, _, _))| h.len() == rows[e] * hd[e]));
    Ok(out)
}

/// The CPU expert backward of every expert, each on its planned threads: per expert the weight
/// gradients (chunk partials summed in chunk order) and `d x` of its rows.
fn experts_backward_threaded(
    experts: &[ExpertParams],
    caches: &[ExpertCache],
    d_os: &[Vec<f32>],
    threads: &[usize],
    d: usize,
) -> Result<Vec<(ExpertGrads, Vec<f32>)>> {
    type Job<'a> = Box<dyn FnOnce() -> Result<(ExpertGrads, Vec<f32>)> + Send + 'a>;
    let mut owner = Vec::new();
    let mut jobs: Vec<Job<'_>> = Vec::new();
    let mut hds = Vec::with_capacity(experts.len());
    for (e, p) in experts.iter().enumerate() {
        let c = &caches[e];
        let (_, hd) = p.dims()?;
        hds.push(hd);
        for (s, len) in chunks(c.tokens.len(), threads[e]).into_iter().filter(|(_, len)| *len > 0) {
            let sub = ExpertCache {
                tokens: c.tokens[s..s + len].to_vec(),
                gates: c.gates[s..s + len].to_vec(),
                x: c.x[s * d..(s + len) * d].to_vec(),
                h: c.h[s * hd..(s + len) * hd].to_vec(),
                a: c.a[s * hd..(s + len) * hd].to_vec(),
                o: c.o[s * d..(s + len) * d].to_vec(),
            };
            let d_o = &d_os[e][s * d..(s + len) * d];
            owner.push(e);
            jobs.push(Box::new(move || CpuExpert.backward(p, &sub, d_o)));
        }
    }
    let mut sums: Vec<_> = hds
        .iter()
        .map(|&hd| (vec![0f32; d * hd], vec![0f32; hd], vec![0f32; hd * d], vec![0f32; d], Vec::new()))
        .collect();
    // Chunks come back in order: partial gradients are summed, and d x concatenated, in chunk order.
    for (e, (g, pdx)) in owner.into_iter().zip(run_chunks(jobs)?) {
        let (w1, b1, w2, b2, dx) = &mut sums[e];
        for (acc, t) in [(w1, &g.w1), (b1, &g.b1), (w2, &g.w2), (b2, &g.b2)] {
            acc.iter_mut().zip(t.f32_cow().iter()).for_each(|(a, &v)| *a += v);
        }
        dx.extend(pdx);
    }
    sums.into_iter()
        .zip(hds)
        .map(|((w1, b1, w2, b2, dx), hd)| Ok((ExpertGrads::from_parts(d, hd, w1, b1, w2, b2)?, dx)))
        .collect()
}

/// The MoE expert FFN forward: `(y, cache)`.
#[derive(Clone, Copy, Debug, Default)]
pub struct MoeFfn;

impl Op for MoeFfn {
    type Args<'a> = (&'a Tensor, &'a Routing, &'a [ExpertParams]);
    type Output = (Tensor, MoeCache);
    const NAME: &'static str = "moe_ffn_forward";

    fn cpu(&self, (x, r, e): Self::Args<'_>) -> Result<Self::Output> {
        forward_with(&CpuExpert, x, r, e)
    }

    fn cuda(&self, dev: &CudaDevice, (x, r, e): Self::Args<'_>) -> Result<Self::Output> {
        crate::cuda::moe_ffn_forward(dev, x, r, e)
    }
}

/// The MoE expert FFN backward.
#[derive(Clone, Copy, Debug, Default)]
pub struct MoeFfnBackward;

impl Op for MoeFfnBackward {
    type Args<'a> = (&'a Tensor, &'a MoeCache, &'a [ExpertParams]);
    type Output = MoeGrads;
    const NAME: &'static str = "moe_ffn_backward";

    fn cpu(&self, (dy, c, e): Self::Args<'_>) -> Result<MoeGrads> {
        backward_with(&CpuExpert, dy, c, e)
    }

    fn cuda(&self, dev: &CudaDevice, (dy, c, e): Self::Args<'_>) -> Result<MoeGrads> {
        crate::cuda::moe_ffn_backward(dev, dy, c, e)
    }
}

/// MoE FFN forward on the CPU.
pub fn moe_ffn_forward(
    x: &Tensor,
    routing: &Routing,
    experts: &[ExpertParams],
) -> Result<(Tensor, MoeCache)> {
    MoeFfn.cpu((x, routing, experts))
}

/// MoE FFN backward on the CPU.
pub fn moe_ffn_backward(dy: &Tensor, cache: &MoeCache, experts: &[ExpertParams]) -> Result<MoeGrads> {
    MoeFfnBackward.cpu((dy, cache, experts))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::gradcheck::{check_grad, random_vec};
    use crate::ops::routing::top_k_route;

    const T: usize = 6;

    #[test]
    fn chunks_run_on_the_persistent_pool_in_order_and_a_panic_is_an_error() {
        let names = || -> Vec<String> {
            let jobs: Vec<Box<dyn FnOnce() -> Result<String> + Send>> = (0..3)
                .map(|i| -> Box<dyn FnOnce() -> Result<String> + Send> {
                    Box::new(move || Ok(format!("{i}:{}", std::thread::current().name().unwrap_or(""))))
                })
                .collect();
            run_chunks(jobs).unwrap()
        };
        let first = names();
        assert!(expert_pool().is_some(), "the pool builds here");
        for (i, n) in first.iter().enumerate() {
            assert!(n.starts_with(&format!("{i}:troupe-expert-")), "{first:?}");
        }
        // A second call reuses the same workers: no thread outside the pool's names appears.
        let pool_size = expert_pool().map_or(0, rayon::ThreadPool::current_num_threads);
        for n in names() {
            let idx: usize = n.rsplit('-').next().unwrap().parse().unwrap();
            assert!(idx < pool_size, "{n}");
        }
        let bad: Vec<Box<dyn FnOnce() -> Result<u8> + Send>> =
            vec![Box::new(|| Ok(1)), Box::new(|| panic!("boom"))];
        assert!(run_chunks(bad).is_err());
    }
    const D: usize = 4;
    const H: usize = 5;
    const E: usize = 3;

    fn t(v: &[f32], s: &[usize]) -> Tensor {
        Tensor::from_f32(s, v.to_vec()).unwrap()
    }

    fn expert(seed: u64) -> ExpertParams {
        ExpertParams {
            w1: t(&random_vec(seed, D * H, 0.8), &[D, H]),
            b1: t(&random_vec(seed + 1, H, 0.3), &[H]),
            w2: t(&random_vec(seed + 2, H * D, 0.8), &[H, D]),
            b2: t(&random_vec(seed + 3, D, 0.3), &[D]),
        }
    }

    /// loss = sum(y * r) through routing (k = 2, capacity 3 so some choices drop) and the experts.
    fn loss(x: &[f32], logits: &[f32], experts: &[ExpertParams], r: &[f32]) -> f64 {
        let routing = top_k_route(&t(logits, &[T, E]), 2, 3).unwrap();
        let (y, _) = moe_ffn_forward(&t(x, &[T, D]), &routing, experts).unwrap();
        y.to_vec_f32().iter().zip(r).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum()
    }

    #[test]
    fn single_token_single_expert_by_hand() {
        // d = h = 1: w1 = 2, b1 = 0, w2 = 3, b2 = 1, x = 1, gate from one expert = 1.
        // y = 1 * (3 * GELU(2) + 1) = 3 * 1.9544997 + 1.
        let e = ExpertParams {
            w1: t(&[2.0], &[1, 1]),
            b1: t(&[0.0], &[1]),
            w2: t(&[3.0], &[1, 1]),
            b2: t(&[1.0], &[1]),
        };
        let routing = top_k_route(&t(&[0.0], &[1, 1]), 1, 1).unwrap();
        let (y, _) = moe_ffn_forward(&t(&[1.0], &[1, 1]), &routing, std::slice::from_ref(&e)).unwrap();
        assert!((y.to_vec_f32()[0] - (3.0 * 1.954_499_7 + 1.0)).abs() < 1e-5);
    }

    #[test]
    fn gradients_match_finite_differences() {
        let x = random_vec(20, T * D, 1.0);
        let logits = random_vec(21, T * E, 2.0);
        let r = random_vec(22, T * D, 1.0);
        let experts: Vec<ExpertParams> = (0..E as u64).map(|i| expert(100 + 10 * i)).collect();

        let routing = top_k_route(&t(&logits, &[T, E]), 2, 3).unwrap();
        assert!(!routing.dropped.is_empty(), "the test should exercise dropped choices");
        let (_, cache) = moe_ffn_forward(&t(&x, &[T, D]), &routing, &experts).unwrap();
        let g = moe_ffn_backward(&t(&r, &[T, D]), &cache, &experts).unwrap();

        check_grad("moe dx", &x, &g.dx.to_vec_f32(), |x| loss(x, &logits, &experts, &r));
        let dlogits = routing.logits_grad(&g.dgates).unwrap();
        check_grad("moe gate (via logits)", &logits, &dlogits.to_vec_f32(), |l| loss(&x, l, &experts, &r));
        for e in 0..E {
            let with = |f: &dyn Fn(&mut ExpertParams, &[f32]), v: &[f32]| {
                let mut ex = experts.clone();
                f(&mut ex[e], v);
                loss(&x, &logits, &ex, &r)
            };
            let gr = &g.experts[e];
            check_grad("moe dw1", &experts[e].w1.to_vec_f32(), &gr.w1.to_vec_f32(), |v| {
                with(&|p, v| p.w1 = t(v, &[D, H]), v)
            });
            check_grad("moe db1", &experts[e].b1.to_vec_f32(), &gr.b1.to_vec_f32(), |v| {
                with(&|p, v| p.b1 = t(v, &[H]), v)
            });
            check_grad("moe dw2", &experts[e].w2.to_vec_f32(), &gr.w2.to_vec_f32(), |v| {
                with(&|p, v| p.w2 = t(v, &[H, D]), v)
            });
            check_grad("moe db2", &experts[e].b2.to_vec_f32(), &gr.b2.to_vec_f32(), |v| {
                with(&|p, v| p.b2 = t(v, &[D]), v)
            });
        }
    }
}

//! What one adaptation step (or time slice) reserves in the pool: every buffer with its size, in
//! allocation order, bounded by expert capacity.

use crate::ops::attention_tmp_bytes;
use crate::vmoe::model::VMoeConfig;

/// Bytes of one expert's temporary memory for `tokens` routed tokens: forward activations kept for the
/// backward pass (gathered input, pre-activation, activation, output: f32; gates f32; token indices
/// usize) plus backward buffers (d out, d gate, d act, d pre, d in) and the expert's weight gradients.
pub fn expert_tmp_bytes(config: &VMoeConfig, tokens: usize) -> u64 {
    let (d, h) = (config.dim, config.hidden);
    let forward = tokens * (2 * d + 2 * h + 1) * 4 + tokens * std::mem::size_of::<usize>();
    let backward = tokens * (2 * d + 2 * h + 1) * 4;
    (forward + backward + config.expert_params() * 4) as u64
}

/// The buffers one training step of `batch` images needs besides expert temporaries, with their sizes:
/// patches, residual stream, per-block attention (its norm, its saved Q/K/V/context and
/// `batch * heads * T^2` probabilities plus backward buffers, its output) and norm and router
/// buffers, final norm, head, and the gradients of the trainable parameters. Expert temporaries are
/// bounded by the capacity (see [`step_plan`]).
fn dense_plan(config: &VMoeConfig, batch: usize) -> Vec<(&'static str, u64)> {
    let c = config;
    let t = batch * c.tokens_per_image();
    let f = |n: usize| (n * 4) as u64;
    let mut plan = vec![("patches", f(t * c.patch_len())), ("residual", f(t * c.dim))];
    for _ in 0..c.blocks {
        plan.push(("attention norm", f(2 * t * c.dim + t)));
        plan.push(("attention tmp", attention_tmp_bytes(batch, c.tokens_per_image(), c.dim, c.heads)));
        plan.push(("attention out", f(t * c.dim)));
        plan.push(("norm", f(2 * t * c.dim + t)));
        plan.push(("router", f(2 * t * c.experts)));
        plan.push(("moe out", f(t * c.dim)));
    }
    plan.push(("final norm", f(2 * t * c.dim + t)));
    plan.push(("head", f(batch * (c.dim + 2 * c.proj + 2 * c.classes))));
    plan.push(("backward stream", f(3 * t * c.dim)));
    plan.push(("trainable grads", f(c.param_count() - c.shared_params())));
    plan
}

/// Every buffer one step reserves, in allocation order: the dense buffers, then one temporary per
/// expert bounded by its capacity.
pub fn step_plan(config: &VMoeConfig, batch: usize) -> Vec<(&'static str, u64)> {
    let mut plan = dense_plan(config, batch);
    let cap = config.capacity(batch * config.tokens_per_image()).min(batch * config.tokens_per_image());
    for _ in 0..config.blocks * config.experts {
        plan.push(("expert tmp", expert_tmp_bytes(config, cap)));
    }
    plan
}

/// The buffers one step of `batch` images reserves when only `chosen` of the model's experts train
/// (the rest frozen): [`step_plan`]'s dense buffers with the trainable gradients cut to the chosen
/// experts and the projector, then one temporary per chosen expert bounded by its capacity. Frozen
/// experts get no gradient buffer and no temporary: they only pass activations through, which the
/// dense buffers (`moe out`, `backward stream`) already hold.
pub fn subset_step_plan(config: &VMoeConfig, batch: usize, chosen: usize) -> Vec<(&'static str, u64)> {
    let mut plan = subset_dense_plan(config, batch, chosen);
    let cap = config.capacity(batch * config.tokens_per_image()).min(batch * config.tokens_per_image());
    plan.extend(std::iter::repeat_n(("expert tmp", expert_tmp_bytes(config, cap)), chosen));
    plan
}

/// [`subset_step_plan`] without the expert temporaries: the dense workspace of one model's step.
fn subset_dense_plan(config: &VMoeConfig, batch: usize, chosen: usize) -> Vec<(&'static str, u64)> {
    let grads = ((chosen * config.expert_params() + config.projector_params()) * 4) as u64;
    step_plan(config, batch)
        .into_iter()
        .filter(|(what, _)| *what != "expert tmp")
        .map(|(what, bytes)| if what == "trainable grads" { (what, grads) } else { (what, bytes) })
        .collect()
}

/// Aligned bytes of a plan's buffers (what reserving them takes from the pool).
pub fn plan_bytes(plan: &[(&'static str, u64)], align: u64) -> u64 {
    plan.iter().map(|(_, b)| b.div_ceil(align.max(1)) * align.max(1)).sum()
}

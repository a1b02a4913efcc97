//! Top-k expert routing with expert capacity (V-MoE style): softmax over expert logits, each token
//! picks its k most probable experts, and each expert takes at most `capacity` tokens.
//!
//! Slots are filled choice by choice: every token's first choice is placed (in token order) before
//! any second choice, so a token loses its second expert before another loses its first. Tokens
//! over capacity are dropped for that expert and reported in [`Routing::dropped`].

use super::softmax::{softmax, softmax_backward};
use super::{Op, rows_cols};
use crate::cuda::CudaDevice;
use crate::error::{KernelError, Result};
use crate::tensor::Tensor;

/// One token placed on one expert.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Assignment {
    /// Token (row) index.
    pub token: usize,
    /// The router probability used to weight the expert's output.
    pub gate: f32,
    /// Which of the token's k choices this is (0 = most probable).
    pub choice: usize,
}

/// A token that wanted an expert whose capacity was already full.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dropped {
    /// Token (row) index.
    pub token: usize,
    /// The expert it could not get.
    pub expert: usize,
    /// Which of the token's k choices it was.
    pub choice: usize,
}

/// The routing decision for a batch of tokens.
#[derive(Clone, Debug)]
pub struct Routing {
    /// Tokens routed.
    pub num_tokens: usize,
    /// Experts available.
    pub num_experts: usize,
    /// Choices per token.
    pub k: usize,
    /// Slots per expert.
    pub capacity: usize,
    /// Router probabilities (`softmax(logits)`), `num_tokens x num_experts`.
    pub probs: Tensor,
    /// Per expert, the tokens it processes, in slot order.
    pub experts: Vec<Vec<Assignment>>,
    /// (token, expert) choices refused for lack of capacity.
    pub dropped: Vec<Dropped>,
}

impl Routing {
    /// Tokens per expert.
    pub fn load(&self) -> Vec<usize> {
        self.experts.iter().map(Vec::len).collect()
    }

    /// Tokens that got no expert at all (their MoE output is zero; the residual carries them).
    pub fn unrouted_tokens(&self) -> Vec<usize> {
        let mut routed = vec![false; self.num_tokens];
        for a in self.experts.iter().flatten() {
            routed[a.token] = true;
        }
        (0..self.num_tokens).filter(|&t| !routed[t]).collect()
    }

    /// d loss / d logits from per-assignment gate gradients (as returned by the MoE backward):
    /// scatter into a dense `tokens x experts` d probs, then back through the softmax.
    pub fn logits_grad(&self, dgates: &[Vec<f32>]) -> Result<Tensor> {
        if dgates.len() != self.num_experts
            || dgates.iter().zip(&self.experts).any(|(g, a)| g.len() != a.len())
        {
            return Err(KernelError::shape(
                "routing logits_grad",
                "gate gradients do not match the routing's assignments",
            ));
        }
        let mut dprobs = vec![0.0; self.num_tokens * self.num_experts];
        for (e, (assigned, grads)) in self.experts.iter().zip(dgates).enumerate() {
            for (a, &g) in assigned.iter().zip(grads) {
                dprobs[a.token * self.num_experts + e] += g;
            }
        }
        let dprobs = Tensor::from_f32(&[self.num_tokens, self.num_experts], dprobs)?;
        softmax_backward(&self.probs, &dprobs)
    }
}

/// Top-k routing with capacity.
#[derive(Clone, Copy, Debug)]
pub struct TopKRouting {
    /// Experts per token.
    pub k: usize,
    /// Tokens per expert.
    pub capacity: usize,
}

impl Op for TopKRouting {
    type Args<'a> = &'a Tensor;
    type Output = Routing;
    const NAME: &'static str = "top_k_route";

    fn cpu(&self, logits: &Tensor) -> Result<Routing> {
        self.check(logits)?;
        self.route_probs(softmax(logits)?)
    }

    /// The router's softmax on the GPU; the top-k choice and the capacity slots (a few experts per
    /// token, filled in token order) are host bookkeeping that the MoE's gather reads anyway.
    fn cuda(&self, dev: &CudaDevice, logits: &Tensor) -> Result<Routing> {
        self.check(logits)?;
        self.route_probs(crate::cuda::softmax(dev, logits)?)
    }
}

impl TopKRouting {
    /// `k` must name between 1 and all of the experts.
    fn check(&self, logits: &Tensor) -> Result<()> {
        let (_, experts) = rows_cols("top_k_route", logits)?;
        if self.k == 0 || self.k > experts {
            return Err(KernelError::invalid(
                "top_k_route",
                format!("k = {} with {experts} experts", self.k),
            ));
        }
        Ok(())
    }

    /// The routing decision from the router probabilities.
    fn route_probs(&self, probs: Tensor) -> Result<Routing> {
        let (tokens, experts) = rows_cols("top_k_route", &probs)?;
        let p = probs.to_vec_f32();
        // Per token, experts by descending probability (ties: lower index first).
        let choices: Vec<Vec<usize>> = (0..tokens)
            .map(|t| {
                let row = &p[t * experts..(t + 1) * experts];
                let mut order: Vec<usize> = (0..experts).collect();
                order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
                order.truncate(self.k);
                order
            })
            .collect();
        let mut assigned = vec![Vec::new(); experts];
        let mut dropped = Vec::new();
        for choice in 0..self.k {
            for (token, picks) in choices.iter().enumerate() {
                let e = picks[choice];
                if assigned[e].len() < self.capacity {
                    assigned[e].push(Assignment { token, gate: p[token * experts + e], choice });
                } else {
                    dropped.push(Dropped { token, expert: e, choice });
                }
            }
        }
        Ok(Routing {
            num_tokens: tokens,
            num_experts: experts,
            k: self.k,
            capacity: self.capacity,
            probs,
            experts: assigned,
            dropped,
        })
    }
}

/// Top-k routing with capacity on the CPU.
pub fn top_k_route(logits: &Tensor, k: usize, capacity: usize) -> Result<Routing> {
    TopKRouting { k, capacity }.cpu(logits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_drops_later_tokens_and_second_choices_first() {
        // 4 tokens, 3 experts. Every token prefers expert 0, then expert 1 (token 3 prefers 2 second).
        let logits = Tensor::from_f32(
            &[4, 3],
            vec![
                3.0, 2.0, 0.0, //
                3.0, 2.0, 0.0, //
                3.0, 2.0, 0.0, //
                3.0, 0.0, 2.0,
            ],
        )
        .unwrap();
        let r = top_k_route(&logits, 2, 2).unwrap();
        let toks = |e: usize| r.experts[e].iter().map(|a| a.token).collect::<Vec<_>>();
        // First choices: tokens 0,1 fill expert 0; tokens 2,3 are dropped there.
        assert_eq!(toks(0), vec![0, 1]);
        // Second choices: tokens 0,1 fill expert 1; token 2's second choice (1) is dropped; token 3 gets expert 2.
        assert_eq!(toks(1), vec![0, 1]);
        assert_eq!(toks(2), vec![3]);
        let d: Vec<(usize, usize)> = r.dropped.iter().map(|d| (d.token, d.expert)).collect();
        assert_eq!(d, vec![(2, 0), (3, 0), (2, 1)]);
        assert_eq!(r.unrouted_tokens(), vec![2]);
        assert_eq!(r.load(), vec![2, 2, 1]);
        // Gates are softmax probabilities: p(0) = e^3 / (e^3 + e^2 + 1).
        let e = std::f32::consts::E;
        let p0 = e.powi(3) / (e.powi(3) + e.powi(2) + 1.0);
        assert!((r.experts[0][0].gate - p0).abs() < 1e-6);
        assert!(top_k_route(&logits, 4, 2).is_err());
    }
}

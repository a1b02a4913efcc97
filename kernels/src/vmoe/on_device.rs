//! The V-MoE's ops on one [`Device`]: every op the model and its training step use, dispatched
//! through [`Op::run`] so the same model code runs on the CPU references or the CUDA paths.

use crate::device::Device;
use crate::error::Result;
use crate::ops::{
    Attention, AttentionBackward, AttentionCache, AttentionGrads, AttentionParams, BiasAdd, BiasGrad,
    CrossEntropy, ExpertParams, Gelu, GeluBackward, LayerNorm, LayerNormBackward, LayerNormCache,
    LayerNormGrads, Matmul, MoeCache, MoeFfn, MoeFfnBackward, MoeGrads, Op, Routing, TopKRouting,
};
use crate::tensor::Tensor;

/// Runs the model's ops on the device it holds.
#[derive(Clone, Copy, Debug)]
pub(crate) struct On<'d>(pub &'d Device);

impl On<'_> {
    pub fn matmul(&self, a: &Tensor, b: &Tensor, trans_a: bool, trans_b: bool) -> Result<Tensor> {
        Matmul { trans_a, trans_b }.run(self.0, (a, b))
    }

    pub fn bias_add(&self, x: &Tensor, bias: &Tensor) -> Result<Tensor> {
        BiasAdd.run(self.0, (x, bias))
    }

    pub fn bias_grad(&self, dy: &Tensor) -> Result<Tensor> {
        BiasGrad.run(self.0, dy)
    }

    pub fn gelu(&self, x: &Tensor) -> Result<Tensor> {
        Gelu.run(self.0, x)
    }

    pub fn gelu_backward(&self, x: &Tensor, dy: &Tensor) -> Result<Tensor> {
        GeluBackward.run(self.0, (x, dy))
    }

    pub fn layer_norm(
        &self,
        x: &Tensor,
        gamma: &Tensor,
        beta: &Tensor,
        eps: f32,
    ) -> Result<(Tensor, LayerNormCache)> {
        LayerNorm { eps }.run(self.0, (x, gamma, beta))
    }

    pub fn layer_norm_backward(
        &self,
        dy: &Tensor,
        gamma: &Tensor,
        cache: &LayerNormCache,
    ) -> Result<LayerNormGrads> {
        LayerNormBackward.run(self.0, (dy, gamma, cache))
    }

    pub fn attention(
        &self,
        x: &Tensor,
        p: &AttentionParams,
        seq_len: usize,
        heads: usize,
    ) -> Result<(Tensor, AttentionCache)> {
        Attention { seq_len, heads }.run(self.0, (x, p))
    }

    pub fn attention_backward(
        &self,
        dy: &Tensor,
        p: &AttentionParams,
        cache: &AttentionCache,
    ) -> Result<AttentionGrads> {
        AttentionBackward.run(self.0, (dy, p, cache))
    }

    pub fn route(&self, logits: &Tensor, k: usize, capacity: usize) -> Result<Routing> {
        TopKRouting { k, capacity }.run(self.0, logits)
    }

    pub fn moe(&self, x: &Tensor, routing: &Routing, experts: &[ExpertParams]) -> Result<(Tensor, MoeCache)> {
        MoeFfn.run(self.0, (x, routing, experts))
    }

    pub fn moe_backward(&self, dy: &Tensor, cache: &MoeCache, experts: &[ExpertParams]) -> Result<MoeGrads> {
        MoeFfnBackward.run(self.0, (dy, cache, experts))
    }

    pub fn cross_entropy(&self, logits: &Tensor, targets: &[usize]) -> Result<(f32, Tensor)> {
        CrossEntropy.run(self.0, (logits, targets))
    }
}

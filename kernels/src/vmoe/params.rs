//! A V-MoE's parameters as tensors, grouped by what the co-adaptation pool does with them (merge
//! shared parts, keep experts and projector per model), in one fixed order for files and optimisers.

use crate::ops::{AttentionParams, ExpertParams};
use crate::tensor::Tensor;

/// Which part of the model a parameter belongs to; the co-adaptation pool merges `Shared` parts and
/// trains only `Expert` and `Projector` parts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ParamGroup {
    /// Patch/position embedding, attention, layer norms, routers: frozen during adaptation, merged in
    /// the pool (trained only from scratch).
    Shared,
    /// One expert's FFN weights.
    Expert {
        /// Block index.
        block: usize,
        /// Expert index within the block.
        expert: usize,
    },
    /// Projector and classification head.
    Projector,
}

/// One block's parameters: pre-norm self-attention, then the pre-norm MoE.
#[derive(Clone, Debug)]
pub struct MoeBlock {
    /// Attention pre-norm scale, `dim`.
    pub attn_gamma: Tensor,
    /// Attention pre-norm shift, `dim`.
    pub attn_beta: Tensor,
    /// Attention projections, each `dim x dim`.
    pub attn: AttentionParams,
    /// Pre-norm scale, `dim`.
    pub ln_gamma: Tensor,
    /// Pre-norm shift, `dim`.
    pub ln_beta: Tensor,
    /// Router, `dim x experts` (no bias).
    pub router: Tensor,
    /// The experts.
    pub experts: Vec<ExpertParams>,
}

/// Every parameter of a V-MoE (also used for its gradients: same shapes).
#[derive(Clone, Debug)]
pub struct VMoeParams {
    /// Patch embedding, `patch_len x dim`.
    pub patch_w: Tensor,
    /// Patch embedding bias, `dim`.
    pub patch_b: Tensor,
    /// Learnt position embedding, `tokens_per_image x dim`.
    pub pos: Tensor,
    /// The blocks.
    pub blocks: Vec<MoeBlock>,
    /// Final layer-norm scale, `dim`.
    pub final_gamma: Tensor,
    /// Final layer-norm shift, `dim`.
    pub final_beta: Tensor,
    /// Projector, `dim x proj`.
    pub proj_w: Tensor,
    /// Projector bias, `proj`.
    pub proj_b: Tensor,
    /// Head, `proj x classes`.
    pub head_w: Tensor,
    /// Head bias, `classes`.
    pub head_b: Tensor,
}

impl VMoeParams {
    /// Every tensor with its group, in a fixed order (the order of model files and optimiser state).
    pub fn tensors(&self) -> Vec<(ParamGroup, &Tensor)> {
        let mut out = vec![
            (ParamGroup::Shared, &self.patch_w),
            (ParamGroup::Shared, &self.patch_b),
            (ParamGroup::Shared, &self.pos),
        ];
        for (b, blk) in self.blocks.iter().enumerate() {
            let a = &blk.attn;
            for t in [&blk.attn_gamma, &blk.attn_beta, &a.wq, &a.wk, &a.wv, &a.wo] {
                out.push((ParamGroup::Shared, t));
            }
            out.push((ParamGroup::Shared, &blk.ln_gamma));
            out.push((ParamGroup::Shared, &blk.ln_beta));
            out.push((ParamGroup::Shared, &blk.router));
            for (e, ex) in blk.experts.iter().enumerate() {
                let g = ParamGroup::Expert { block: b, expert: e };
                out.extend([(g, &ex.w1), (g, &ex.b1), (g, &ex.w2), (g, &ex.b2)]);
            }
        }
        out.push((ParamGroup::Shared, &self.final_gamma));
        out.push((ParamGroup::Shared, &self.final_beta));
        for t in [&self.proj_w, &self.proj_b, &self.head_w, &self.head_b] {
            out.push((ParamGroup::Projector, t));
        }
        out
    }

    /// Every tensor, mutably, in the order of [`VMoeParams::tensors`].
    pub fn tensors_mut(&mut self) -> Vec<(ParamGroup, &mut Tensor)> {
        let mut out = vec![
            (ParamGroup::Shared, &mut self.patch_w),
            (ParamGroup::Shared, &mut self.patch_b),
            (ParamGroup::Shared, &mut self.pos),
        ];
        for (b, blk) in self.blocks.iter_mut().enumerate() {
            out.push((ParamGroup::Shared, &mut blk.attn_gamma));
            out.push((ParamGroup::Shared, &mut blk.attn_beta));
            out.push((ParamGroup::Shared, &mut blk.attn.wq));
            out.push((ParamGroup::Shared, &mut blk.attn.wk));
            out.push((ParamGroup::Shared, &mut blk.attn.wv));
            out.push((ParamGroup::Shared, &mut blk.attn.wo));
            out.push((ParamGroup::Shared, &mut blk.ln_gamma));
            out.push((ParamGroup::Shared, &mut blk.ln_beta));
            out.push((ParamGroup::Shared, &mut blk.router));
            for (e, ex) in blk.experts.iter_mut().enumerate() {
                let g = ParamGroup::Expert { block: b, expert: e };
                out.push((g, &mut ex.w1));
                out.push((g, &mut ex.b1));
                out.push((g, &mut ex.w2));
                out.push((g, &mut ex.b2));
            }
        }
        out.push((ParamGroup::Shared, &mut self.final_gamma));
        out.push((ParamGroup::Shared, &mut self.final_beta));
        out.push((ParamGroup::Projector, &mut self.proj_w));
        out.push((ParamGroup::Projector, &mut self.proj_b));
        out.push((ParamGroup::Projector, &mut self.head_w));
        out.push((ParamGroup::Projector, &mut self.head_b));
        out
    }

    /// Total elements.
    pub fn numel(&self) -> usize {
        self.tensors().iter().map(|(_, t)| t.numel()).sum()
    }
}

//! The V-MoE itself: patch embedding + position embedding, `blocks` pre-norm MoE blocks (layer norm ->
//! router -> top-k routing with capacity -> expert FFNs, residual), a final layer norm, mean pooling,
//! a projector (linear + GELU) and a linear head. Forward keeps a cache; backward returns gradients for
//! every parameter, built from the ops' own backward passes.

use rand::Rng;
use rand::rngs::SmallRng;

use super::VMoeError;
use crate::ops::{
    ExpertParams, LayerNormCache, MoeCache, Routing, bias_add, bias_grad, gelu, gelu_backward,
    layer_norm, layer_norm_backward, matmul, moe_ffn_backward, moe_ffn_forward, top_k_route,
};
use crate::tensor::Tensor;

/// Side of the square input images (scikit-learn digits are 8x8).
pub const IMAGE_SIDE: usize = 8;
/// Pixels per input image.
pub const IMAGE_PIXELS: usize = IMAGE_SIDE * IMAGE_SIDE;
/// Layer-norm epsilon used throughout.
pub const LN_EPS: f32 = 1e-5;

/// Largest width, hidden size, expert count, ... a config may ask for (caps what a model file can make
/// us allocate).
pub const MAX_DIM: usize = 1024;

/// The shape of a V-MoE.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct VMoeConfig {
    /// Patch side in pixels (2 or 4: 16 or 4 tokens per 8x8 image).
    pub patch: usize,
    /// Token width.
    pub dim: usize,
    /// MoE blocks (at least 2).
    pub blocks: usize,
    /// Experts per block.
    pub experts: usize,
    /// Experts each token is routed to.
    pub top_k: usize,
    /// Expert FFN hidden width.
    pub hidden: usize,
    /// Projector width.
    pub proj: usize,
    /// Output classes (10 for digits).
    pub classes: usize,
    /// Expert capacity as a multiple of the even share `top_k * tokens / experts`.
    pub capacity_factor: f32,
}

impl VMoeConfig {
    /// Names of the four student sizes, smallest first (the paper distils four compressed V-MoEs).
    pub const STUDENT_SIZES: [&'static str; 4] = ["tiny", "small", "base", "large"];

    /// Smallest student: 4 tokens per image, 4 experts, top-1.
    pub fn tiny() -> Self {
        Self {
            patch: 4,
            dim: 16,
            blocks: 2,
            experts: 4,
            top_k: 1,
            hidden: 32,
            proj: 32,
            classes: 10,
            capacity_factor: 1.5,
        }
    }

    /// Second student: 4 tokens per image, 4 experts, top-2.
    pub fn small() -> Self {
        Self {
            dim: 24,
            top_k: 2,
            hidden: 48,
            proj: 48,
            ..Self::tiny()
        }
    }

    /// Third student: 16 tokens per image (2x2 patches), 6 experts, top-2.
    pub fn base() -> Self {
        Self {
            patch: 2,
            dim: 24,
            blocks: 2,
            experts: 6,
            top_k: 2,
            hidden: 48,
            proj: 48,
            classes: 10,
            capacity_factor: 1.25,
        }
    }

    /// Largest student: 16 tokens per image, 3 blocks of 8 experts, top-2.
    pub fn large() -> Self {
        Self {
            dim: 32,
            blocks: 3,
            experts: 8,
            hidden: 64,
            proj: 64,
            ..Self::base()
        }
    }

    /// The reference model that labels uploaded samples: larger than every student.
    pub fn teacher() -> Self {
        Self {
            patch: 2,
            dim: 48,
            blocks: 3,
            experts: 8,
            top_k: 2,
            hidden: 96,
            proj: 96,
            classes: 10,
            capacity_factor: 1.5,
        }
    }

    /// The config called `name` (`tiny`, `small`, `base`, `large`, `teacher`).
    pub fn named(name: &str) -> Option<Self> {
        match name {
            "tiny" => Some(Self::tiny()),
            "small" => Some(Self::small()),
            "base" => Some(Self::base()),
            "large" => Some(Self::large()),
            "teacher" => Some(Self::teacher()),
            _ => None,
        }
    }

    /// Checks every field; the error says which one is off.
    pub fn validate(&self) -> Result<(), VMoeError> {
        let bad = |d: String| Err(VMoeError::Config(d));
        if self.patch == 0 || !IMAGE_SIDE.is_multiple_of(self.patch) {
            return bad(format!("patch {} does not tile {IMAGE_SIDE}", self.patch));
        }
        for (name, v) in [
            ("dim", self.dim),
            ("experts", self.experts),
            ("hidden", self.hidden),
            ("proj", self.proj),
            ("classes", self.classes),
        ] {
            if v == 0 || v > MAX_DIM {
                return bad(format!("{name} = {v} is outside 1..={MAX_DIM}"));
            }
        }
        if self.blocks < 2 || self.blocks > 64 {
            return bad(format!("blocks = {} is outside 2..=64", self.blocks));
        }
        if self.top_k == 0 || self.top_k > self.experts {
            return bad(format!(
                "top_k = {} with {} experts",
                self.top_k, self.experts
            ));
        }
        if !(self.capacity_factor.is_finite() && self.capacity_factor > 0.0) {
            return bad(format!("capacity_factor = {}", self.capacity_factor));
        }
        Ok(())
    }

    /// Tokens (patches) per image.
    pub fn tokens_per_image(&self) -> usize {
        (IMAGE_SIDE / self.patch).pow(2)
    }

    /// Pixels per patch.
    pub fn patch_len(&self) -> usize {
        self.patch * self.patch
    }

    /// Slots per expert for a batch of `tokens` tokens: `ceil(cf * top_k * tokens / experts)`.
    pub fn capacity(&self, tokens: usize) -> usize {
        let even = (self.top_k * tokens) as f64 / self.experts as f64;
        ((f64::from(self.capacity_factor) * even).ceil() as usize).max(1)
    }

    /// Parameters of one expert.
    pub fn expert_params(&self) -> usize {
        2 * self.dim * self.hidden + self.hidden + self.dim
    }

    /// Parameters of the projector and head.
    pub fn projector_params(&self) -> usize {
        self.dim * self.proj + self.proj + self.proj * self.classes + self.classes
    }

    /// Parameters shared across merged copies (patch and position embeddings, norms, routers).
    pub fn shared_params(&self) -> usize {
        let embed = self.patch_len() * self.dim + self.dim + self.tokens_per_image() * self.dim;
        embed + self.blocks * (2 * self.dim + self.dim * self.experts) + 2 * self.dim
    }

    /// All parameters.
    pub fn param_count(&self) -> usize {
        self.shared_params()
            + self.blocks * self.experts * self.expert_params()
            + self.projector_params()
    }
}

/// Which part of the model a parameter belongs to; the co-adaptation pool merges `Shared` parts and
/// trains only `Expert` and `Projector` parts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ParamGroup {
    /// Patch/position embedding, layer norms, routers: frozen during adaptation, merged in the pool.
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

/// One MoE block's parameters.
#[derive(Clone, Debug)]
pub struct MoeBlock {
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
    /// The MoE blocks.
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
            out.push((ParamGroup::Shared, &blk.ln_gamma));
            out.push((ParamGroup::Shared, &blk.ln_beta));
            out.push((ParamGroup::Shared, &blk.router));
            for (e, ex) in blk.experts.iter().enumerate() {
                let g = ParamGroup::Expert {
                    block: b,
                    expert: e,
                };
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
            out.push((ParamGroup::Shared, &mut blk.ln_gamma));
            out.push((ParamGroup::Shared, &mut blk.ln_beta));
            out.push((ParamGroup::Shared, &mut blk.router));
            for (e, ex) in blk.experts.iter_mut().enumerate() {
                let g = ParamGroup::Expert {
                    block: b,
                    expert: e,
                };
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

/// Everything the backward pass needs from one block's forward pass.
#[derive(Clone, Debug)]
pub struct BlockCache {
    /// Layer-norm output (the router's and experts' input), `tokens x dim`.
    pub normed: Tensor,
    /// Layer-norm saved state.
    pub ln: LayerNormCache,
    /// The routing decision.
    pub routing: Routing,
    /// The experts' saved state.
    pub moe: MoeCache,
}

/// Everything the backward pass needs from a forward pass.
#[derive(Clone, Debug)]
pub struct ForwardCache {
    /// Images in the batch.
    pub batch: usize,
    /// Patches, `batch * tokens_per_image x patch_len`.
    pub patches: Tensor,
    /// Per block.
    pub blocks: Vec<BlockCache>,
    /// Final layer norm.
    pub final_ln: LayerNormCache,
    /// Mean-pooled tokens, `batch x dim`.
    pub pooled: Tensor,
    /// Projector pre-activation, `batch x proj`.
    pub proj_pre: Tensor,
    /// Projector output `GELU(proj_pre)`, `batch x proj`.
    pub proj_act: Tensor,
}

impl ForwardCache {
    /// Bytes of one expert's saved activations in block `block` (gathered inputs, pre-activations,
    /// activations, outputs, token indices and gates).
    pub fn expert_activation_bytes(&self, block: usize, expert: usize) -> u64 {
        self.blocks
            .get(block)
            .and_then(|b| b.moe.experts.get(expert))
            .map_or(0, |c| {
                let floats = c.x.len() + c.h.len() + c.a.len() + c.o.len() + c.gates.len();
                (floats * 4 + c.tokens.len() * std::mem::size_of::<usize>()) as u64
            })
    }

    /// Tokens routed to each expert of block `block`.
    pub fn expert_load(&self, block: usize) -> Vec<usize> {
        self.blocks
            .get(block)
            .map_or_else(Vec::new, |b| b.routing.load())
    }
}

/// A V-MoE: config plus parameters.
#[derive(Clone, Debug)]
pub struct VMoe {
    /// The shape.
    pub config: VMoeConfig,
    /// The weights.
    pub params: VMoeParams,
}

fn uniform(rng: &mut SmallRng, shape: &[usize], bound: f32) -> Result<Tensor, VMoeError> {
    let n = shape.iter().product();
    let v = (0..n)
        .map(|_| rng.random_range(-bound..=bound))
        .collect::<Vec<f32>>();
    Ok(Tensor::from_f32(shape, v)?)
}

/// Glorot-uniform `fan_in x fan_out` matrix.
fn glorot(rng: &mut SmallRng, fan_in: usize, fan_out: usize) -> Result<Tensor, VMoeError> {
    let bound = (6.0 / (fan_in + fan_out) as f32).sqrt();
    uniform(rng, &[fan_in, fan_out], bound)
}

/// `dst[r] += src[r mod src_rows]` for a `rows x cols` `dst` (adds the position embedding per image).
fn add_rows_cyclic(dst: &mut [f32], src: &[f32], cols: usize) {
    for (d, s) in dst
        .chunks_exact_mut(cols)
        .zip(src.chunks_exact(cols).cycle())
    {
        d.iter_mut().zip(s).for_each(|(a, &b)| *a += b);
    }
}

fn add_into(a: &mut Tensor, b: &Tensor) -> Result<(), VMoeError> {
    let bv = b.f32_cow();
    let av = a.f32_mut()?;
    av.iter_mut().zip(bv.iter()).for_each(|(x, &y)| *x += y);
    Ok(())
}

impl VMoe {
    /// A freshly initialised model (Glorot-uniform weights, unit norms), reproducible from `rng`.
    pub fn new(config: VMoeConfig, rng: &mut SmallRng) -> Result<Self, VMoeError> {
        config.validate()?;
        let c = config;
        let d = c.dim;
        let mut blocks = Vec::with_capacity(c.blocks);
        for _ in 0..c.blocks {
            let mut experts = Vec::with_capacity(c.experts);
            for _ in 0..c.experts {
                experts.push(ExpertParams {
                    w1: glorot(rng, d, c.hidden)?,
                    b1: Tensor::zeros(&[c.hidden])?,
                    w2: glorot(rng, c.hidden, d)?,
                    b2: Tensor::zeros(&[d])?,
                });
            }
            blocks.push(MoeBlock {
                ln_gamma: Tensor::full(&[d], 1.0)?,
                ln_beta: Tensor::zeros(&[d])?,
                router: glorot(rng, d, c.experts)?,
                experts,
            });
        }
        let params = VMoeParams {
            patch_w: glorot(rng, c.patch_len(), d)?,
            patch_b: Tensor::zeros(&[d])?,
            pos: uniform(rng, &[c.tokens_per_image(), d], 0.1)?,
            blocks,
            final_gamma: Tensor::full(&[d], 1.0)?,
            final_beta: Tensor::zeros(&[d])?,
            proj_w: glorot(rng, d, c.proj)?,
            proj_b: Tensor::zeros(&[c.proj])?,
            head_w: glorot(rng, c.proj, c.classes)?,
            head_b: Tensor::zeros(&[c.classes])?,
        };
        Ok(Self { config, params })
    }

    /// A model of `config` with the given parameters, checking every shape.
    pub fn from_params(config: VMoeConfig, params: VMoeParams) -> Result<Self, VMoeError> {
        config.validate()?;
        let want = Self::shapes(&config);
        let got: Vec<Vec<usize>> = params
            .tensors()
            .iter()
            .map(|(_, t)| t.shape().to_vec())
            .collect();
        if want != got {
            return Err(VMoeError::Config(
                "parameter shapes do not match the config".into(),
            ));
        }
        Ok(Self { config, params })
    }

    /// The shape of every parameter tensor, in [`VMoeParams::tensors`] order.
    pub fn shapes(c: &VMoeConfig) -> Vec<Vec<usize>> {
        let d = c.dim;
        let mut out = vec![
            vec![c.patch_len(), d],
            vec![d],
            vec![c.tokens_per_image(), d],
        ];
        for _ in 0..c.blocks {
            out.extend([vec![d], vec![d], vec![d, c.experts]]);
            for _ in 0..c.experts {
                out.extend([
                    vec![d, c.hidden],
                    vec![c.hidden],
                    vec![c.hidden, d],
                    vec![d],
                ]);
            }
        }
        out.extend([
            vec![d],
            vec![d],
            vec![d, c.proj],
            vec![c.proj],
            vec![c.proj, c.classes],
            vec![c.classes],
        ]);
        out
    }

    /// Cuts `batch x 64` images into `batch * tokens x patch_len` patches (row-major within a patch).
    pub fn patchify(&self, images: &Tensor) -> Result<Tensor, VMoeError> {
        let (batch, pixels) = images.dims2()?;
        if pixels != IMAGE_PIXELS {
            return Err(VMoeError::Config(format!(
                "images have {pixels} pixels, expected {IMAGE_PIXELS}"
            )));
        }
        let p = self.config.patch;
        let per_side = IMAGE_SIDE / p;
        let x = images.f32_cow();
        let mut out = Vec::with_capacity(batch * IMAGE_PIXELS);
        for img in x.chunks_exact(IMAGE_PIXELS) {
            for pr in 0..per_side {
                for pc in 0..per_side {
                    for r in 0..p {
                        let start = (pr * p + r) * IMAGE_SIDE + pc * p;
                        out.extend_from_slice(&img[start..start + p]);
                    }
                }
            }
        }
        Ok(Tensor::from_f32(
            &[
                batch * self.config.tokens_per_image(),
                self.config.patch_len(),
            ],
            out,
        )?)
    }

    /// Logits (`batch x classes`) for `batch x 64` images with pixels in `0..=1`, and the cache for
    /// [`VMoe::backward`]. Routing capacity is computed over the whole batch, as in V-MoE.
    pub fn forward(&self, images: &Tensor) -> Result<(Tensor, ForwardCache), VMoeError> {
        let c = &self.config;
        let p = &self.params;
        let patches = self.patchify(images)?;
        let batch = patches.dims2()?.0 / c.tokens_per_image();
        let tokens = batch * c.tokens_per_image();
        let mut h = bias_add(&matmul(&patches, &p.patch_w, false, false)?, &p.patch_b)?;
        add_rows_cyclic(h.f32_mut()?, &p.pos.f32_cow(), c.dim);
        let capacity = c.capacity(tokens);
        let mut blocks = Vec::with_capacity(c.blocks);
        for blk in &p.blocks {
            let (normed, ln) = layer_norm(&h, &blk.ln_gamma, &blk.ln_beta, LN_EPS)?;
            let logits = matmul(&normed, &blk.router, false, false)?;
            let routing = top_k_route(&logits, c.top_k, capacity)?;
            let (y, moe) = moe_ffn_forward(&normed, &routing, &blk.experts)?;
            add_into(&mut h, &y)?;
            blocks.push(BlockCache {
                normed,
                ln,
                routing,
                moe,
            });
        }
        let (z, final_ln) = layer_norm(&h, &p.final_gamma, &p.final_beta, LN_EPS)?;
        let n = c.tokens_per_image();
        let zv = z.f32_cow();
        let mut pooled = vec![0.0f32; batch * c.dim];
        for (b, out) in pooled.chunks_exact_mut(c.dim).enumerate() {
            for row in zv[b * n * c.dim..(b + 1) * n * c.dim].chunks_exact(c.dim) {
                out.iter_mut().zip(row).for_each(|(o, &v)| *o += v);
            }
            out.iter_mut().for_each(|o| *o /= n as f32);
        }
        let pooled = Tensor::from_f32(&[batch, c.dim], pooled)?;
        let proj_pre = bias_add(&matmul(&pooled, &p.proj_w, false, false)?, &p.proj_b)?;
        let proj_act = gelu(&proj_pre)?;
        let logits = bias_add(&matmul(&proj_act, &p.head_w, false, false)?, &p.head_b)?;
        Ok((
            logits,
            ForwardCache {
                batch,
                patches,
                blocks,
                final_ln,
                pooled,
                proj_pre,
                proj_act,
            },
        ))
    }

    /// Predicted class of each image.
    pub fn predict(&self, images: &Tensor) -> Result<Vec<usize>, VMoeError> {
        let (logits, _) = self.forward(images)?;
        let classes = self.config.classes;
        Ok(logits
            .f32_cow()
            .chunks_exact(classes)
            .map(|row| {
                row.iter()
                    .enumerate()
                    .fold((0, f32::NEG_INFINITY), |best, (i, &v)| {
                        if v > best.1 { (i, v) } else { best }
                    })
                    .0
            })
            .collect())
    }

    /// Gradients of every parameter given `d loss / d logits` (`batch x classes`).
    pub fn backward(
        &self,
        cache: &ForwardCache,
        dlogits: &Tensor,
    ) -> Result<VMoeParams, VMoeError> {
        let c = &self.config;
        let p = &self.params;
        let batch = cache.batch;
        if dlogits.shape() != [batch, c.classes] {
            return Err(VMoeError::Config(format!(
                "dlogits {:?} for a batch of {batch} x {} classes",
                dlogits.shape(),
                c.classes
            )));
        }
        // Head and projector.
        let head_w = matmul(&cache.proj_act, dlogits, true, false)?;
        let head_b = bias_grad(dlogits)?;
        let dact = matmul(dlogits, &p.head_w, false, true)?;
        let dpre = gelu_backward(&cache.proj_pre, &dact)?;
        let proj_w = matmul(&cache.pooled, &dpre, true, false)?;
        let proj_b = bias_grad(&dpre)?;
        let dpooled = matmul(&dpre, &p.proj_w, false, true)?;
        // Mean pooling: every token of image b gets dpooled[b] / n.
        let n = c.tokens_per_image();
        let dpv = dpooled.f32_cow();
        let mut dz = Vec::with_capacity(batch * n * c.dim);
        for row in dpv.chunks_exact(c.dim) {
            for _ in 0..n {
                dz.extend(row.iter().map(|&v| v / n as f32));
            }
        }
        let dz = Tensor::from_f32(&[batch * n, c.dim], dz)?;
        let fin = layer_norm_backward(&dz, &p.final_gamma, &cache.final_ln)?;
        let mut dh = fin.dx;
        // Blocks, last first: h_out = h_in + MoE(LN(h_in)).
        let mut block_grads = Vec::with_capacity(c.blocks);
        for (blk, bc) in p.blocks.iter().zip(&cache.blocks).rev() {
            let moe = moe_ffn_backward(&dh, &bc.moe, &blk.experts)?;
            let dlogits_r = bc.routing.logits_grad(&moe.dgates)?;
            let router = matmul(&bc.normed, &dlogits_r, true, false)?;
            let mut dnormed = moe.dx;
            add_into(&mut dnormed, &matmul(&dlogits_r, &blk.router, false, true)?)?;
            let ln = layer_norm_backward(&dnormed, &blk.ln_gamma, &bc.ln)?;
            add_into(&mut dh, &ln.dx)?;
            block_grads.push(MoeBlock {
                ln_gamma: ln.dgamma,
                ln_beta: ln.dbeta,
                router,
                experts: moe
                    .experts
                    .into_iter()
                    .map(|g| ExpertParams {
                        w1: g.w1,
                        b1: g.b1,
                        w2: g.w2,
                        b2: g.b2,
                    })
                    .collect(),
            });
        }
        block_grads.reverse();
        // Embedding: h0 = patches W + b + pos.
        let patch_w = matmul(&cache.patches, &dh, true, false)?;
        let patch_b = bias_grad(&dh)?;
        let mut pos = vec![0.0f32; n * c.dim];
        for (i, row) in dh.f32_cow().chunks_exact(c.dim).enumerate() {
            let t = i % n;
            pos[t * c.dim..(t + 1) * c.dim]
                .iter_mut()
                .zip(row)
                .for_each(|(a, &v)| *a += v);
        }
        Ok(VMoeParams {
            patch_w,
            patch_b,
            pos: Tensor::from_f32(&[n, c.dim], pos)?,
            blocks: block_grads,
            final_gamma: fin.dgamma,
            final_beta: fin.dbeta,
            proj_w,
            proj_b,
            head_w,
            head_b,
        })
    }
}

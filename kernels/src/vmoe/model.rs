//! The V-MoE itself: the 8x8 image upsampled (bilinear) to 16x16, patch embedding + position
//! embedding, `blocks` blocks of pre-norm multi-head self-attention (residual) then a pre-norm MoE
//! (layer norm -> router -> top-k routing with capacity -> expert FFNs, residual), a final layer norm,
//! mean pooling, a projector (linear + GELU) and a linear head. Forward keeps a cache; backward
//! returns gradients for every parameter, built from the ops' own backward passes (so the input
//! gradient flows through attention to earlier blocks' experts even when attention is frozen).

use rand::Rng;
use rand::rngs::SmallRng;

use super::VMoeError;
pub use super::config::{IMAGE_PIXELS, IMAGE_SIDE, INPUT_PIXELS, INPUT_SIDE, LN_EPS, MAX_DIM, VMoeConfig};
use super::on_device::On;
pub use super::params::{MoeBlock, ParamGroup, VMoeParams};
use crate::device::Device;
use crate::ops::{AttentionCache, AttentionParams, ExpertParams, LayerNormCache, MoeCache, Routing};
use crate::tensor::Tensor;

/// Everything the backward pass needs from one block's forward pass.
#[derive(Clone, Debug)]
pub struct BlockCache {
    /// Attention pre-norm saved state.
    pub attn_ln: LayerNormCache,
    /// Attention saved state (its input is the pre-norm's output).
    pub attn: AttentionCache,
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
    /// Started from cached stem tokens ([`VMoe::forward_from_stem`]): `patches` and block 0's
    /// attention caches are empty and backward stops at block 0's MoE.
    pub from_stem: bool,
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
        self.blocks.get(block).and_then(|b| b.moe.experts.get(expert)).map_or(0, |c| {
            let floats = c.x.len() + c.h.len() + c.a.len() + c.o.len() + c.gates.len();
            (floats * 4 + c.tokens.len() * std::mem::size_of::<usize>()) as u64
        })
    }

    /// Bytes of block `block`'s saved attention activations (input, Q, K, V, context and the
    /// `images * heads * tokens^2` probabilities).
    pub fn attention_activation_bytes(&self, block: usize) -> u64 {
        self.blocks.get(block).map_or(0, |b| b.attn.bytes())
    }

    /// Tokens routed to each expert of block `block`.
    pub fn expert_load(&self, block: usize) -> Vec<usize> {
        self.blocks.get(block).map_or_else(Vec::new, |b| b.routing.load())
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
    let v = (0..n).map(|_| rng.random_range(-bound..=bound)).collect::<Vec<f32>>();
    Ok(Tensor::from_f32(shape, v)?)
}

/// Glorot-uniform `fan_in x fan_out` matrix.
fn glorot(rng: &mut SmallRng, fan_in: usize, fan_out: usize) -> Result<Tensor, VMoeError> {
    let bound = (6.0 / (fan_in + fan_out) as f32).sqrt();
    uniform(rng, &[fan_in, fan_out], bound)
}

/// `dst[r] += src[r mod src_rows]` for a `rows x cols` `dst` (adds the position embedding per image).
fn add_rows_cyclic(dst: &mut [f32], src: &[f32], cols: usize) {
    for (d, s) in dst.chunks_exact_mut(cols).zip(src.chunks_exact(cols).cycle()) {
        d.iter_mut().zip(s).for_each(|(a, &b)| *a += b);
    }
}

fn add_into(a: &mut Tensor, b: &Tensor) -> Result<(), VMoeError> {
    let bv = b.f32_cow();
    let av = a.f32_mut()?;
    av.iter_mut().zip(bv.iter()).for_each(|(x, &y)| *x += y);
    Ok(())
}

/// Source index pairs and the weight of the second, for bilinear upsampling of one axis from
/// [`IMAGE_SIDE`] to [`INPUT_SIDE`] (half-pixel centres, edges clamped).
fn taps() -> [(usize, usize, f32); INPUT_SIDE] {
    let mut out = [(0, 0, 0.0); INPUT_SIDE];
    let scale = IMAGE_SIDE as f32 / INPUT_SIDE as f32;
    for (i, tap) in out.iter_mut().enumerate() {
        let src = ((i as f32 + 0.5) * scale - 0.5).clamp(0.0, (IMAGE_SIDE - 1) as f32);
        let lo = src.floor() as usize;
        let hi = (lo + 1).min(IMAGE_SIDE - 1);
        *tap = (lo, hi, src - lo as f32);
    }
    out
}

/// One `IMAGE_SIDE x IMAGE_SIDE` image upsampled (bilinear, separable) to `INPUT_SIDE x INPUT_SIDE`.
/// Part of the model's stem, so cameras, drift and datasets all stay at the sensor's 8x8.
pub fn upsample(img: &[f32]) -> Vec<f32> {
    let t = taps();
    let mut rows = vec![0.0f32; IMAGE_SIDE * INPUT_SIDE];
    for (r, row) in img.chunks_exact(IMAGE_SIDE).take(IMAGE_SIDE).enumerate() {
        for (c, &(lo, hi, w)) in t.iter().enumerate() {
            rows[r * INPUT_SIDE + c] = (1.0 - w) * row[lo] + w * row[hi];
        }
    }
    let mut out = vec![0.0f32; INPUT_PIXELS];
    for (r, &(lo, hi, w)) in t.iter().enumerate() {
        for c in 0..INPUT_SIDE {
            out[r * INPUT_SIDE + c] = (1.0 - w) * rows[lo * INPUT_SIDE + c] + w * rows[hi * INPUT_SIDE + c];
        }
    }
    out
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
            let attn = AttentionParams {
                wq: glorot(rng, d, d)?,
                wk: glorot(rng, d, d)?,
                wv: glorot(rng, d, d)?,
                wo: glorot(rng, d, d)?,
            };
            blocks.push(MoeBlock {
                attn_gamma: Tensor::full(&[d], 1.0)?,
                attn_beta: Tensor::zeros(&[d])?,
                attn,
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
        let got: Vec<Vec<usize>> = params.tensors().iter().map(|(_, t)| t.shape().to_vec()).collect();
        if want != got {
            return Err(VMoeError::Config("parameter shapes do not match the config".into()));
        }
        Ok(Self { config, params })
    }

    /// The shape of every parameter tensor, in [`VMoeParams::tensors`] order.
    pub fn shapes(c: &VMoeConfig) -> Vec<Vec<usize>> {
        let d = c.dim;
        let mut out = vec![vec![c.patch_len(), d], vec![d], vec![c.tokens_per_image(), d]];
        for _ in 0..c.blocks {
            out.extend([vec![d], vec![d], vec![d, d], vec![d, d], vec![d, d], vec![d, d]]);
            out.extend([vec![d], vec![d], vec![d, c.experts]]);
            for _ in 0..c.experts {
                out.extend([vec![d, c.hidden], vec![c.hidden], vec![c.hidden, d], vec![d]]);
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

    /// Upsamples `batch x 64` images to the model's 16x16 grid and cuts them into
    /// `batch * tokens x patch_len` patches (row-major within a patch).
    pub fn patchify(&self, images: &Tensor) -> Result<Tensor, VMoeError> {
        let (batch, pixels) = images.dims2()?;
        if pixels != IMAGE_PIXELS {
            return Err(VMoeError::Config(format!("images have {pixels} pixels, expected {IMAGE_PIXELS}")));
        }
        let p = self.config.patch;
        let per_side = INPUT_SIDE / p;
        let x = images.f32_cow();
        let mut out = Vec::with_capacity(batch * INPUT_PIXELS);
        for img in x.chunks_exact(IMAGE_PIXELS) {
            let up = upsample(img);
            for pr in 0..per_side {
                for pc in 0..per_side {
                    for r in 0..p {
                        let start = (pr * p + r) * INPUT_SIDE + pc * p;
                        out.extend_from_slice(&up[start..start + p]);
                    }
                }
            }
        }
        Ok(Tensor::from_f32(&[batch * self.config.tokens_per_image(), self.config.patch_len()], out)?)
    }

    /// The residual stream entering block 0's MoE (`batch * tokens x dim`): patch and position
    /// embedding, then block 0's pre-norm attention and its residual. Everything it depends on is
    /// frozen during adaptation, so for a given model's shared parts and image it is the same every
    /// epoch: the reuse cache keeps it ([`super::reuse`]). Rows of image `i` are
    /// `i * tokens..(i + 1) * tokens`; every op up to here works row- or image-wise, so an image's
    /// rows do not depend on the rest of the batch.
    pub fn stem(&self, images: &Tensor) -> Result<Tensor, VMoeError> {
        Ok(self.stem_with_cache(On(&Device::Cpu), images)?.0)
    }

    /// [`Self::stem`] plus what the full backward pass needs from it.
    fn stem_with_cache(
        &self,
        on: On<'_>,
        images: &Tensor,
    ) -> Result<(Tensor, Tensor, LayerNormCache, AttentionCache), VMoeError> {
        let c = &self.config;
        let p = &self.params;
        let blk = p.blocks.first().ok_or_else(|| VMoeError::Config("a V-MoE without blocks".into()))?;
        let patches = self.patchify(images)?;
        let mut h = on.bias_add(&on.matmul(&patches, &p.patch_w, false, false)?, &p.patch_b)?;
        add_rows_cyclic(h.f32_mut()?, &p.pos.f32_cow(), c.dim);
        let (a_in, attn_ln) = on.layer_norm(&h, &blk.attn_gamma, &blk.attn_beta, LN_EPS)?;
        let (a_out, attn) = on.attention(&a_in, &blk.attn, c.tokens_per_image(), c.heads)?;
        add_into(&mut h, &a_out)?;
        Ok((h, patches, attn_ln, attn))
    }

    /// Logits (`batch x classes`) for `batch x 64` images with pixels in `0..=1`, and the cache for
    /// [`VMoe::backward`]. Routing capacity is computed over the whole batch, as in V-MoE.
    pub fn forward(&self, images: &Tensor) -> Result<(Tensor, ForwardCache), VMoeError> {
        self.forward_on(&Device::Cpu, images)
    }

    /// [`Self::forward`] with every op on `device` (the CPU references or the CUDA paths).
    pub fn forward_on(&self, device: &Device, images: &Tensor) -> Result<(Tensor, ForwardCache), VMoeError> {
        let on = On(device);
        let (h, patches, attn_ln, attn) = self.stem_with_cache(on, images)?;
        self.forward_rest(on, h, patches, Some((attn_ln, attn)))
    }

    /// The forward pass from cached [`Self::stem`] tokens (`batch * tokens x dim`, images in batch
    /// order): block 0's MoE onwards. Routing (capacity over the whole batch) is recomputed from the
    /// tokens, so any batch of cached images routes as the full pass would. Logits and the cache
    /// are bit-identical to [`Self::forward`]'s on the same images; [`Self::backward`] on this cache
    /// gives the same gradients for everything after the stem and zeros for the stem's (frozen)
    /// parameters, whose backward it skips.
    pub fn forward_from_stem(&self, stem: &Tensor) -> Result<(Tensor, ForwardCache), VMoeError> {
        self.forward_from_stem_on(&Device::Cpu, stem)
    }

    /// [`Self::forward_from_stem`] with every op on `device`.
    pub fn forward_from_stem_on(
        &self,
        device: &Device,
        stem: &Tensor,
    ) -> Result<(Tensor, ForwardCache), VMoeError> {
        let (rows, dim) = stem.dims2()?;
        let n = self.config.tokens_per_image();
        if dim != self.config.dim || rows % n != 0 || rows == 0 {
            return Err(VMoeError::Config(format!(
                "stem tokens {rows}x{dim}, expected a multiple of {n} rows of width {}",
                self.config.dim
            )));
        }
        self.forward_rest(On(device), stem.clone(), Tensor::zeros(&[0, self.config.patch_len()])?, None)
    }

    /// Block 0's MoE onwards from the residual stream `h`; `first` holds block 0's attention
    /// caches (`None`: started from cached stem tokens, no backward through the stem).
    fn forward_rest(
        &self,
        on: On<'_>,
        mut h: Tensor,
        patches: Tensor,
        first: Option<(LayerNormCache, AttentionCache)>,
    ) -> Result<(Tensor, ForwardCache), VMoeError> {
        let c = &self.config;
        let p = &self.params;
        let tokens = h.dims2()?.0;
        let batch = tokens / c.tokens_per_image();
        let capacity = c.capacity(tokens);
        let from_stem = first.is_none();
        let mut first = Some(match first {
            Some(done) => done,
            None => (empty_ln_cache(), empty_attention_cache(c)?),
        });
        let mut blocks = Vec::with_capacity(c.blocks);
        for blk in &p.blocks {
            let (attn_ln, attn) = match first.take() {
                Some(done) => done,
                None => {
                    let (a_in, attn_ln) = on.layer_norm(&h, &blk.attn_gamma, &blk.attn_beta, LN_EPS)?;
                    let (a_out, attn) = on.attention(&a_in, &blk.attn, c.tokens_per_image(), c.heads)?;
                    add_into(&mut h, &a_out)?;
                    (attn_ln, attn)
                }
            };
            let (normed, ln) = on.layer_norm(&h, &blk.ln_gamma, &blk.ln_beta, LN_EPS)?;
            let logits = on.matmul(&normed, &blk.router, false, false)?;
            let routing = on.route(&logits, c.top_k, capacity)?;
            let (y, moe) = on.moe(&normed, &routing, &blk.experts)?;
            add_into(&mut h, &y)?;
            blocks.push(BlockCache { attn_ln, attn, normed, ln, routing, moe });
        }
        let (z, final_ln) = on.layer_norm(&h, &p.final_gamma, &p.final_beta, LN_EPS)?;
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
        let proj_pre = on.bias_add(&on.matmul(&pooled, &p.proj_w, false, false)?, &p.proj_b)?;
        let proj_act = on.gelu(&proj_pre)?;
        let logits = on.bias_add(&on.matmul(&proj_act, &p.head_w, false, false)?, &p.head_b)?;
        Ok((logits, ForwardCache { batch, from_stem, patches, blocks, final_ln, pooled, proj_pre, proj_act }))
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
                    .fold((0, f32::NEG_INFINITY), |best, (i, &v)| if v > best.1 { (i, v) } else { best })
                    .0
            })
            .collect())
    }

    /// Gradients of every parameter given `d loss / d logits` (`batch x classes`).
    pub fn backward(&self, cache: &ForwardCache, dlogits: &Tensor) -> Result<VMoeParams, VMoeError> {
        self.backward_on(&Device::Cpu, cache, dlogits)
    }

    /// [`Self::backward`] with every op on `device`.
    pub fn backward_on(
        &self,
        device: &Device,
        cache: &ForwardCache,
        dlogits: &Tensor,
    ) -> Result<VMoeParams, VMoeError> {
        let on = On(device);
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
        let head_w = on.matmul(&cache.proj_act, dlogits, true, false)?;
        let head_b = on.bias_grad(dlogits)?;
        let dact = on.matmul(dlogits, &p.head_w, false, true)?;
        let dpre = on.gelu_backward(&cache.proj_pre, &dact)?;
        let proj_w = on.matmul(&cache.pooled, &dpre, true, false)?;
        let proj_b = on.bias_grad(&dpre)?;
        let dpooled = on.matmul(&dpre, &p.proj_w, false, true)?;
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
        let fin = on.layer_norm_backward(&dz, &p.final_gamma, &cache.final_ln)?;
        let mut dh = fin.dx;
        // Blocks, last first: h_mid = h_in + Attn(LN_a(h_in)), h_out = h_mid + MoE(LN(h_mid)).
        let mut block_grads = Vec::with_capacity(c.blocks);
        for (i, (blk, bc)) in p.blocks.iter().zip(&cache.blocks).enumerate().rev() {
            let moe = on.moe_backward(&dh, &bc.moe, &blk.experts)?;
            let dlogits_r = bc.routing.logits_grad(&moe.dgates)?;
            let router = on.matmul(&bc.normed, &dlogits_r, true, false)?;
            let mut dnormed = moe.dx;
            add_into(&mut dnormed, &on.matmul(&dlogits_r, &blk.router, false, true)?)?;
            let ln = on.layer_norm_backward(&dnormed, &blk.ln_gamma, &bc.ln)?;
            add_into(&mut dh, &ln.dx)?;
            let experts = moe
                .experts
                .into_iter()
                .map(|g| ExpertParams { w1: g.w1, b1: g.b1, w2: g.w2, b2: g.b2 })
                .collect();
            // The stem (embedding, block 0's attention) is frozen and was not run when the pass
            // started from cached stem tokens: zero grads, and backward stops here.
            let stem_skipped = cache.from_stem && i == 0;
            let (attn_gamma, attn_beta, attn) = if stem_skipped {
                let d = c.dim;
                (Tensor::zeros(&[d])?, Tensor::zeros(&[d])?, zero_attention(d)?)
            } else {
                let attn = on.attention_backward(&dh, &blk.attn, &bc.attn)?;
                let attn_ln = on.layer_norm_backward(&attn.dx, &blk.attn_gamma, &bc.attn_ln)?;
                add_into(&mut dh, &attn_ln.dx)?;
                (attn_ln.dgamma, attn_ln.dbeta, attn.params)
            };
            block_grads.push(MoeBlock {
                attn_gamma,
                attn_beta,
                attn,
                ln_gamma: ln.dgamma,
                ln_beta: ln.dbeta,
                router,
                experts,
            });
            if stem_skipped {
                break;
            }
        }
        block_grads.reverse();
        let (patch_w, patch_b, pos) = if cache.from_stem {
            (Tensor::zeros(&[c.patch_len(), c.dim])?, Tensor::zeros(&[c.dim])?, Tensor::zeros(&[n, c.dim])?)
        } else {
            // Embedding: h0 = patches W + b + pos.
            let mut pos = vec![0.0f32; n * c.dim];
            for (i, row) in dh.f32_cow().chunks_exact(c.dim).enumerate() {
                let t = i % n;
                pos[t * c.dim..(t + 1) * c.dim].iter_mut().zip(row).for_each(|(a, &v)| *a += v);
            }
            (
                on.matmul(&cache.patches, &dh, true, false)?,
                on.bias_grad(&dh)?,
                Tensor::from_f32(&[n, c.dim], pos)?,
            )
        };
        Ok(VMoeParams {
            patch_w,
            patch_b,
            pos,
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

/// A layer-norm cache with nothing saved (block 0 of a pass started from cached stem tokens).
fn empty_ln_cache() -> LayerNormCache {
    LayerNormCache { x_hat: Vec::new(), rstd: Vec::new(), dims: (0, 0) }
}

/// An attention cache with nothing saved (see [`empty_ln_cache`]).
fn empty_attention_cache(c: &VMoeConfig) -> Result<AttentionCache, VMoeError> {
    Ok(AttentionCache {
        x: Tensor::zeros(&[0, c.dim])?,
        q: Vec::new(),
        k: Vec::new(),
        v: Vec::new(),
        probs: Vec::new(),
        ctx: Tensor::zeros(&[0, c.dim])?,
        seq_len: c.tokens_per_image(),
        heads: c.heads,
    })
}

/// Zero gradients for a `dim`-wide attention layer.
fn zero_attention(d: usize) -> Result<AttentionParams, VMoeError> {
    Ok(AttentionParams {
        wq: Tensor::zeros(&[d, d])?,
        wk: Tensor::zeros(&[d, d])?,
        wv: Tensor::zeros(&[d, d])?,
        wo: Tensor::zeros(&[d, d])?,
    })
}

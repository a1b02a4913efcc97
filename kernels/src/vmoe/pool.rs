//! The co-adaptation pool (AdaSprite's MoE merging): several V-MoEs held together, their shared parts
//! (patch/position embeddings, attention, layer norms, routers: everything frozen during adaptation)
//! stored once when identical, their experts and projectors kept per model. Every parameter buffer, optimiser
//! state and activation buffer is accounted in a [`MemoryPool`]: allocated on load (or before a step),
//! freed on unload (or after it). A step whose buffers do not fit is refused with the pool's
//! [`crate::KernelError::OutOfMemory`] and leaves the pool as it was; the budget is never exceeded.
//!
//! Shared tensors are deduplicated by a blake3 hash of shape and bytes, and every merged model holds a
//! view of the one canonical buffer (no copy). External fragmentation is sampled after every event.
//!
//! With the reuse cache on ([`CoAdaptPool::enable_reuse`], [`super::reuse`]) its memory tier is an
//! arena carved from the same [`MemoryPool`], and every step starts from cached stem tokens where the
//! policy has them (bit-identical results); [`CoAdaptPool::reuse_expect`] names the batch after the
//! current call so its disk entries are prefetched while the call's last step computes.
//!
//! With the lifespan-ordered layout on ([`CoAdaptPool::set_ordered`]; decisions in
//! `troupe_policy::adapt::layout`) long-lived buffers and the optimiser state (allocated with the
//! model) go low, the reuse arena on top, and each step's temporaries in one region of contiguous
//! slots placed by execution order.

use std::collections::{BTreeMap, HashMap};

use super::VMoeError;
use super::model::{ParamGroup, VMoe, VMoeConfig};
use super::reuse::{ReuseSetup, ReuseStats, StemCache, shared_identity};
use super::train::{Dataset, StepInput, TrainScope, Trainer, predict_all};
use crate::device::Device;
use crate::ops::attention_backward_bytes;
use crate::pool::{Allocation, MemoryPool, PoolStats};
use crate::tensor::Tensor;

mod layout;
mod plan;

pub use plan::{expert_tmp_bytes, plan_bytes, step_plan, subset_step_plan};

/// A model loaded in the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModelId(pub u32);

/// The pool's occupancy after one event.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FragSample {
    /// Event number (0, 1, 2, ...).
    pub event: u64,
    /// When, in microseconds of the pool's clock ([`CoAdaptPool::set_clock`]).
    pub at_us: u64,
    /// What happened (`load`, `unload`, `reserve`, `release`, `refused`).
    pub what: &'static str,
    /// Bytes allocated.
    pub used: u64,
    /// Bytes free.
    pub free: u64,
    /// Largest contiguous free block.
    pub largest_free: u64,
    /// `1 - largest_free / free`.
    pub external_fragmentation: f64,
}

/// Microseconds since this process first asked (the pool's default clock: monotonic).
pub fn monotonic_us() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    u64::try_from(START.get_or_init(std::time::Instant::now).elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// External fragmentation weighted by how long the pool stayed in each state: each sample holds
/// until the next one (the last until `until_us`, if later), so a state that lasts a whole step
/// counts for that step rather than once per event. A stamp earlier than the one before it counts
/// as that one (no state gets a negative or doubled share, so the result stays within 0..=1).
/// `None` without samples or without time between the first and the end.
pub fn time_weighted_fragmentation(samples: &[FragSample], until_us: u64) -> Option<f64> {
    let first = samples.first()?.at_us;
    // stamps made non-decreasing: a clock switched mid-run cannot weigh a state past the span
    let stamps: Vec<u64> = samples
        .iter()
        .scan(first, |latest, s| {
            *latest = (*latest).max(s.at_us);
            Some(*latest)
        })
        .collect();
    let end = until_us.max(*stamps.last()?);
    let span = end.saturating_sub(first);
    if span == 0 {
        return None;
    }
    let ends = stamps.iter().skip(1).copied().chain(std::iter::once(end));
    let sum: f64 = samples
        .iter()
        .zip(&stamps)
        .zip(ends)
        .map(|((s, &at), next)| s.external_fragmentation * next.saturating_sub(at) as f64)
        .sum();
    Some(sum / span as f64)
}

/// One measurement of an expert's temporary memory in an adaptation step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TmpSample {
    /// The model.
    pub model: ModelId,
    /// Block index.
    pub block: usize,
    /// Expert index.
    pub expert: usize,
    /// Tokens routed to the expert in the step.
    pub tokens: usize,
    /// Model width.
    pub dim: usize,
    /// Expert hidden width.
    pub hidden: usize,
    /// Bytes: the forward activations it kept (measured) plus its backward buffers and gradients.
    pub bytes: u64,
}

/// One measurement of a block's attention temporaries in an adaptation step (the part that grows with
/// the square of the tokens per image).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnSample {
    /// The model.
    pub model: ModelId,
    /// Block index.
    pub block: usize,
    /// Images in the step (sequences).
    pub images: usize,
    /// Tokens per image (the sequence length `T` of the `T^2` term).
    pub tokens: usize,
    /// Model width.
    pub dim: usize,
    /// Attention heads.
    pub heads: usize,
    /// Bytes: the forward activations attention kept (measured) plus its backward buffers.
    pub bytes: u64,
}

/// What one adaptation step did.
#[derive(Clone, Debug, PartialEq)]
pub struct AdaptReport {
    /// Cross-entropy against the teacher's labels before the update.
    pub loss: f32,
    /// Bytes reserved in the pool for the step's activations, gradients and temporaries.
    pub reserved_bytes: u64,
    /// Bytes of activations the forward pass actually kept (at most the reservation's share).
    pub activation_bytes: u64,
    /// Of which attention's (probabilities included) over all blocks.
    pub attention_bytes: u64,
    /// Pool bytes in use at the step's peak.
    pub peak_used: u64,
    /// Tokens per expert, per block.
    pub expert_loads: Vec<Vec<usize>>,
}

struct SharedEntry {
    tensor: Tensor,
    alloc: Allocation,
    refs: usize,
}

struct Pooled {
    name: String,
    model: VMoe,
    shared_keys: Vec<[u8; 32]>,
    /// `[block][expert]`.
    expert_allocs: Vec<Vec<Allocation>>,
    projector_alloc: Allocation,
    trainer: Option<(Trainer, Allocation)>,
    /// The optimiser state's bytes, allocated with the model (lifespan-ordered layout) and taken
    /// by its trainer on the first step.
    state: Option<Allocation>,
}

/// The measurements one step of model `id` gives (its forward `cache`): every block's attention
/// temporaries and the temporaries of each expert in `experts` (`(block, expert)`, the ones that
/// trained): the forward activations kept (measured from the cache) plus the backward buffers and
/// weight gradients ([`expert_tmp_bytes`]'s backward terms, [`attention_backward_bytes`]).
fn step_samples(
    id: ModelId,
    config: &VMoeConfig,
    cache: &super::model::ForwardCache,
    experts: &[(usize, usize)],
) -> (Vec<AttnSample>, Vec<TmpSample>) {
    let (batch, tokens) = (cache.batch, config.tokens_per_image());
    let attn = (0..config.blocks)
        .map(|block| AttnSample {
            model: id,
            block,
            images: batch,
            tokens,
            dim: config.dim,
            heads: config.heads,
            bytes: cache.attention_activation_bytes(block)
                + attention_backward_bytes(batch, tokens, config.dim),
        })
        .collect();
    let loads: Vec<Vec<usize>> = (0..config.blocks).map(|b| cache.expert_load(b)).collect();
    let tmp = experts
        .iter()
        .map(|&(block, expert)| {
            let routed = loads.get(block).and_then(|l| l.get(expert)).copied().unwrap_or(0);
            let backward = (routed * (2 * config.dim + 2 * config.hidden + 1) * 4) as u64;
            TmpSample {
                model: id,
                block,
                expert,
                tokens: routed,
                dim: config.dim,
                hidden: config.hidden,
                bytes: cache.expert_activation_bytes(block, expert)
                    + backward
                    + (config.expert_params() * 4) as u64,
            }
        })
        .collect();
    (attn, tmp)
}

/// One model's share of a time slice: a batch and the experts `(block, expert)` that train on it.
#[derive(Clone, Copy, Debug)]
pub struct SliceTask<'a> {
    /// The model.
    pub model: ModelId,
    /// `batch x pixels` images.
    pub images: &'a Tensor,
    /// The teacher's labels.
    pub labels: &'a [usize],
    /// The experts that train; every other expert of the model is frozen for this step.
    pub experts: &'a [(usize, usize)],
}

/// What one model did in a slice.
#[derive(Clone, Debug, PartialEq)]
pub struct SliceModelReport {
    /// The model.
    pub model: ModelId,
    /// Cross-entropy before the update.
    pub loss: f32,
    /// The experts `(block, expert)` whose weights the optimiser updated, ascending.
    pub trained: Vec<(usize, usize)>,
    /// Tokens per expert, per block.
    pub expert_loads: Vec<Vec<usize>>,
    /// Wall time of its step in microseconds (a measurement for lifespan estimates, not a decision).
    pub elapsed_us: u64,
}

/// What one slice did.
#[derive(Clone, Debug, PartialEq)]
pub struct SliceReport {
    /// Per model, in the slice's order.
    pub models: Vec<SliceModelReport>,
    /// Bytes reserved for the slice: every chosen expert's temporaries plus one dense workspace.
    pub reserved_bytes: u64,
    /// Pool bytes in use while the slice ran.
    pub peak_used: u64,
}

/// A model made ready to merge off the pool's thread ([`CoAdaptPool::prepare_load`]): its own copy
/// of the trainable tensors and the hash of every shared tensor. Committing it
/// ([`CoAdaptPool::commit_load`]) only allocates and takes references.
#[derive(Clone, Debug)]
pub struct PreparedLoad {
    name: String,
    model: Box<VMoe>,
    /// blake3 of each shared tensor's shape and bytes, in [`super::model::VMoeParams::tensors`] order.
    keys: Vec<[u8; 32]>,
}

impl PreparedLoad {
    /// The name it will be loaded under.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Gives the model back (a refused commit keeps it on the host).
    pub fn into_model(self) -> VMoe {
        *self.model
    }
}

/// A load's buffers, allocated and not yet committed.
struct Staged {
    keys: Vec<[u8; 32]>,
    fresh: HashMap<[u8; 32], (Tensor, Allocation)>,
    expert_allocs: Vec<Vec<Allocation>>,
    projector_alloc: Allocation,
    state: Option<Allocation>,
}

/// The merged models and their memory (see the module docs).
pub struct CoAdaptPool {
    pool: MemoryPool,
    shared: HashMap<[u8; 32], SharedEntry>,
    models: BTreeMap<ModelId, Pooled>,
    next_id: u32,
    events: u64,
    frag: Vec<FragSample>,
    tmp: Vec<TmpSample>,
    attn: Vec<AttnSample>,
    peak_used: u64,
    weight_decay: f32,
    share: bool,
    /// Stamps fragmentation samples (microseconds).
    clock: fn() -> u64,
    /// The reuse cache of stem tokens, when enabled (its memory tier is an arena in `pool`).
    reuse: Option<StemCache>,
    /// A batch the caller said comes after the current call's last step (prefetch lookahead).
    expected: Option<(ModelId, Tensor)>,
    /// The lifespan-ordered layout (`pool/layout.rs`) is on.
    ordered: bool,
    /// The last temporaries region placed with it on.
    last_region: Option<(u64, u64)>,
    /// Where the models' training steps run ([`Self::set_device`]).
    device: Device,
    /// Bytes moved by compaction so far (`pool/layout.rs`).
    compacted_bytes: u64,
}

fn shared_key(t: &Tensor) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    for d in t.shape() {
        h.update(&(*d as u64).to_le_bytes());
    }
    h.update(&t.to_le_bytes());
    *h.finalize().as_bytes()
}

impl CoAdaptPool {
    /// A pool of `budget` bytes (256-byte aligned).
    pub fn new(label: &str, budget: u64) -> Result<Self, VMoeError> {
        Ok(Self {
            pool: MemoryPool::new(label, budget, 256)?,
            shared: HashMap::new(),
            models: BTreeMap::new(),
            next_id: 0,
            events: 0,
            frag: Vec::new(),
            tmp: Vec::new(),
            attn: Vec::new(),
            peak_used: 0,
            weight_decay: 0.0,
            share: true,
            clock: monotonic_us,
            reuse: None,
            expected: None,
            ordered: false,
            last_region: None,
            device: Device::Cpu,
            compacted_bytes: 0,
        })
    }

    /// Runs every model's training steps on `device` (default: the CPU); on CUDA each model's
    /// optimiser moments are allocated in device memory when its trainer is made. Refused once a
    /// trainer exists, so no model trains on two devices.
    pub fn set_device(&mut self, device: Device) -> Result<(), VMoeError> {
        if self.models.values().any(|p| p.trainer.is_some()) {
            return Err(VMoeError::Config(format!(
                "the pool's device is set before any model trains (asked for {} afterwards)",
                device.name()
            )));
        }
        self.device = device;
        Ok(())
    }

    /// Where the models' training steps run.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The clock that stamps fragmentation samples (default [`monotonic_us`]; the bench gives its
    /// process CPU time so that time weights match its clock). Samples taken before (e.g. the
    /// reuse tier reserved while the pool was set up) are stamped again at the new clock's now:
    /// a stamp of the old clock next to the new one's would weigh that state by the clocks'
    /// difference (it once held for tens of seconds of a run of two).
    pub fn set_clock(&mut self, clock: fn() -> u64) {
        self.clock = clock;
        let now = clock();
        for s in &mut self.frag {
            s.at_us = now;
        }
    }

    /// Whether identical shared tensors of different models are stored once (the default, AdaSprite's
    /// merging) or every model keeps its own copy (isolated adaptation, the baseline). Applies to
    /// models loaded after the call.
    pub fn set_sharing(&mut self, share: bool) {
        self.share = share;
    }

    fn sample(&mut self, what: &'static str) {
        let s = self.pool.stats();
        self.peak_used = self.peak_used.max(s.used);
        self.frag.push(FragSample {
            event: self.events,
            at_us: (self.clock)(),
            what,
            used: s.used,
            free: s.free,
            largest_free: s.largest_free_block,
            external_fragmentation: s.external_fragmentation,
        });
        self.events += 1;
    }

    /// Merges `model` into the pool under `name`: shared tensors already present are reused (refcounted,
    /// same buffer), the rest and every expert and the projector are allocated. Refused (nothing
    /// changes) when it does not fit. The same as [`Self::prepare_load`] then [`Self::commit_load`].
    pub fn load(&mut self, name: &str, model: &VMoe) -> Result<ModelId, VMoeError> {
        self.commit_load(Self::prepare_load(name, model.clone())?).map_err(|b| b.0)
    }

    /// The part of a load that needs no pool: copies the trainable tensors (experts, projector,
    /// head) into buffers of the model's own and hashes every shared tensor. Pure and `Send`, so a
    /// background thread can run it while the pool computes (AdaSprite's preloading).
    pub fn prepare_load(name: &str, mut model: VMoe) -> Result<PreparedLoad, VMoeError> {
        let mut keys = Vec::new();
        for (group, t) in model.params.tensors_mut() {
            if group == ParamGroup::Shared {
                keys.push(shared_key(t));
            } else {
                // Copy-on-write: a tensor still shared with the host copy gets its own buffer.
                t.f32_mut()?;
            }
        }
        Ok(PreparedLoad { name: name.to_string(), model: Box::new(model), keys })
    }

    /// Merges a prepared model (see [`Self::load`]); refused, with the prepared model handed back
    /// and nothing changed, when it does not fit.
    pub fn commit_load(&mut self, prepared: PreparedLoad) -> Result<ModelId, Box<(VMoeError, PreparedLoad)>> {
        match self.commit_inner(&prepared) {
            Ok(staged) => {
                let PreparedLoad { name, model, .. } = prepared;
                Ok(self.commit_apply(name, *model, staged))
            }
            Err(e) => Err(Box::new((e, prepared))),
        }
    }

    /// Allocates a prepared model's buffers (all or none).
    fn commit_inner(&mut self, prepared: &PreparedLoad) -> Result<Staged, VMoeError> {
        let model = &prepared.model;
        let mut taken = Vec::new();
        // Shared tensors: new ones are allocated first; refs are only taken once everything fits.
        let mut keys = Vec::new();
        let mut fresh: HashMap<[u8; 32], (Tensor, Allocation)> = HashMap::new();
        let shared = model.params.tensors().into_iter().filter(|(g, _)| *g == ParamGroup::Shared);
        for ((_, t), prepared_key) in shared.zip(&prepared.keys) {
            let mut key = *prepared_key;
            if !self.share {
                // Unshared: the key names this model, so nothing is found from another one.
                key = *blake3::Hasher::new()
                    .update(&key)
                    .update(&self.next_id.to_le_bytes())
                    .finalize()
                    .as_bytes();
            }
            keys.push(key);
            if !self.shared.contains_key(&key) && !fresh.contains_key(&key) {
                let a = self.alloc(t.size_in_bytes() as u64, &mut taken)?;
                let mut own = t.clone();
                if !self.share {
                    // Isolated: a buffer of its own, as a per-task copy would hold (copy-on-write).
                    own.f32_mut()?;
                }
                fresh.insert(key, (own, a));
            }
        }
        let c = model.config;
        let mut expert_allocs = Vec::with_capacity(c.blocks);
        for _ in 0..c.blocks {
            let mut row = Vec::with_capacity(c.experts);
            for _ in 0..c.experts {
                row.push(self.alloc((c.expert_params() * 4) as u64, &mut taken)?);
            }
            expert_allocs.push(row);
        }
        let projector_alloc = self.alloc((c.projector_params() * 4) as u64, &mut taken)?;
        // Lifespan-ordered: the optimiser state lives as long as the model, so it is placed with
        // it now rather than inside a step.
        let state = if self.ordered {
            Some(self.alloc(Trainer::state_bytes(&c, TrainScope::ExpertsAndProjector), &mut taken)?)
        } else {
            None
        };
        Ok(Staged { keys, fresh, expert_allocs, projector_alloc, state })
    }

    /// Takes references and registers a model whose buffers [`Self::commit_inner`] allocated.
    fn commit_apply(&mut self, name: String, mut model: VMoe, staged: Staged) -> ModelId {
        let Staged { keys, fresh, expert_allocs, projector_alloc, state } = staged;
        // Everything fits: commit.
        for (key, (tensor, alloc)) in fresh {
            self.shared.insert(key, SharedEntry { tensor, alloc, refs: 0 });
        }
        let mut key_iter = keys.iter();
        for (group, t) in model.params.tensors_mut() {
            if group != ParamGroup::Shared {
                continue;
            }
            if let Some(entry) = key_iter.next().and_then(|k| self.shared.get_mut(k)) {
                entry.refs += 1;
                *t = entry.tensor.clone();
            }
        }
        let id = ModelId(self.next_id);
        self.next_id += 1;
        self.models.insert(
            id,
            Pooled { name, model, shared_keys: keys, expert_allocs, projector_alloc, trainer: None, state },
        );
        self.sample("load");
        id
    }

    /// Removes a model, freeing its experts, projector, optimiser state and any shared tensor no other
    /// model uses. Returns the model as adapted.
    pub fn unload(&mut self, id: ModelId) -> Result<VMoe, VMoeError> {
        let p = self.models.remove(&id).ok_or(VMoeError::UnknownModel(id.0))?;
        for a in p.expert_allocs.into_iter().flatten() {
            self.pool.free(a)?;
        }
        self.pool.free(p.projector_alloc)?;
        if let Some((_, a)) = p.trainer {
            self.pool.free(a)?;
        }
        if let Some(a) = p.state {
            self.pool.free(a)?;
        }
        for key in p.shared_keys {
            let gone = match self.shared.get_mut(&key) {
                Some(e) => {
                    e.refs -= 1;
                    e.refs == 0
                }
                None => false,
            };
            if gone && let Some(e) = self.shared.remove(&key) {
                self.pool.free(e.alloc)?;
            }
        }
        self.sample("unload");
        self.compact()?;
        Ok(p.model)
    }

    /// One adaptation step of model `id` on `images` (`batch x 64`) labelled by the teacher: only its
    /// experts, projector and head train (AdamW at `lr`). The optimiser state is allocated on the first
    /// step (with the lifespan-ordered layout, when the model was loaded); the step's activations, gradients and temporaries are reserved up front (bounded by expert
    /// capacity) and freed after. If anything does not fit the step is refused, nothing trains, and
    /// the pool is as before (the optimiser state is kept once allocated).
    pub fn adapt_step(
        &mut self,
        id: ModelId,
        images: &Tensor,
        labels: &[usize],
        lr: f32,
    ) -> Result<AdaptReport, VMoeError> {
        let config = self.models.get(&id).ok_or(VMoeError::UnknownModel(id.0))?.model.config;
        let batch = images.dims2()?.0;
        self.ensure_trainer(id, lr)?;
        let plan = step_plan(&config, batch);
        let mut taken = Vec::new();
        let sizes: Vec<u64> = plan.iter().map(|(_, b)| *b).collect();
        self.alloc_temporaries(&sizes, &mut taken)?;
        let reserved_bytes = taken.iter().map(|a| a.len).sum();
        self.sample("reserve");
        let peak_used = self.pool.stats().used;
        let result = self.run_step(id, images, labels, lr);
        for a in taken {
            self.pool.free(a)?;
        }
        self.sample("release");
        let (loss, cache) = result?;
        let all: Vec<(usize, usize)> =
            (0..config.blocks).flat_map(|b| (0..config.experts).map(move |e| (b, e))).collect();
        let (attn, tmp) = step_samples(id, &config, &cache, &all);
        let attention_bytes = (0..config.blocks).map(|b| cache.attention_activation_bytes(b)).sum::<u64>();
        let activation_bytes =
            attention_bytes + all.iter().map(|&(b, e)| cache.expert_activation_bytes(b, e)).sum::<u64>();
        self.attn.extend(attn);
        self.tmp.extend(tmp);
        let expert_loads = (0..config.blocks).map(|b| cache.expert_load(b)).collect();
        Ok(AdaptReport { loss, reserved_bytes, activation_bytes, attention_bytes, peak_used, expert_loads })
    }

    /// Allocates model `id`'s optimiser state (experts and projector) unless it has one; refused
    /// (nothing changes) when it does not fit.
    pub fn ensure_trainer(&mut self, id: ModelId, lr: f32) -> Result<(), VMoeError> {
        let p = self.models.get(&id).ok_or(VMoeError::UnknownModel(id.0))?;
        if p.trainer.is_some() {
            return Ok(());
        }
        let bytes = Trainer::state_bytes(&p.model.config, TrainScope::ExpertsAndProjector);
        let state = p.state;
        // Made first: a device that refuses the moments leaves the pool as it was.
        let mut t = Trainer::on_device(
            &p.model,
            TrainScope::ExpertsAndProjector,
            lr,
            self.weight_decay,
            self.device.clone(),
        )?;
        t.set_lr(lr);
        let a = match state {
            Some(a) => a,
            None => self.alloc(bytes, &mut Vec::new())?,
        };
        if let Some(p) = self.models.get_mut(&id) {
            p.state = None;
            p.trainer = Some((t, a));
        }
        Ok(())
    }

    /// One time slice of co-adaptation: for each [`SliceTask`], one step of its model on its batch
    /// that trains only the chosen experts (plus projector and head); the other experts are frozen
    /// (no gradient buffer, no optimiser update, no temporaries). Every chosen expert's temporaries
    /// are reserved together for the whole slice (they share it), plus one dense workspace (the
    /// largest model's [`subset_step_plan`] without expert temporaries) that the models use in turn.
    /// Optimiser state is allocated first where missing. If anything does not fit the slice is
    /// refused before any model trains and the pool is as before (optimiser state once allocated
    /// is kept).
    pub fn train_slice(&mut self, tasks: &[SliceTask<'_>], lr: f32) -> Result<SliceReport, VMoeError> {
        let mut plans = Vec::with_capacity(tasks.len());
        for (i, t) in tasks.iter().enumerate() {
            let p = self.models.get(&t.model).ok_or(VMoeError::UnknownModel(t.model.0))?;
            let c = p.model.config;
            if tasks[..i].iter().any(|o| o.model == t.model) {
                return Err(VMoeError::Config(format!("model {} appears twice in a slice", t.model.0)));
            }
            if let Some(&(b, e)) = t.experts.iter().find(|(b, e)| *b >= c.blocks || *e >= c.experts) {
                return Err(VMoeError::Config(format!(
                    "expert ({b}, {e}) of a {}x{} model",
                    c.blocks, c.experts
                )));
            }
            let batch = t.images.dims2()?.0;
            plans.push(subset_step_plan(&c, batch, t.experts.len()));
        }
        for t in tasks {
            self.ensure_trainer(t.model, lr)?;
        }
        let workspace = plans
            .iter()
            .map(|p| p.iter().filter(|(what, _)| *what != "expert tmp").copied().collect::<Vec<_>>())
            .max_by_key(|p| plan_bytes(p, 256))
            .unwrap_or_default();
        // In execution order: the dense workspace every model uses in turn, then each model's
        // experts' temporaries in the slice's order.
        let sizes: Vec<u64> = workspace
            .iter()
            .map(|(_, b)| *b)
            .chain(
                plans
                    .iter()
                    .flat_map(|p| p.iter().filter(|(what, _)| *what == "expert tmp").map(|(_, b)| *b)),
            )
            .collect();
        let mut taken = Vec::new();
        self.alloc_temporaries(&sizes, &mut taken)?;
        let reserved_bytes = taken.iter().map(|a| a.len).sum();
        self.sample("reserve");
        let peak_used = self.pool.stats().used;
        let mut models = Vec::with_capacity(tasks.len());
        let mut failed = None;
        let expected = self.expected.take();
        for (i, t) in tasks.iter().enumerate() {
            let next = match tasks.get(i + 1) {
                Some(n) => Some((n.model, n.images)),
                None => expected.as_ref().map(|(m, x)| (*m, x)),
            };
            match self.run_selected(t, lr, next) {
                Ok(r) => models.push(r),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        for a in taken {
            self.pool.free(a)?;
        }
        self.sample("release");
        if let Some(e) = failed {
            return Err(e);
        }
        Ok(SliceReport { models, reserved_bytes, peak_used })
    }

    /// Runs one [`SliceTask`]'s step and records the trained experts' temporary-memory samples.
    fn run_selected(
        &mut self,
        t: &SliceTask<'_>,
        lr: f32,
        next: Option<(ModelId, &Tensor)>,
    ) -> Result<SliceModelReport, VMoeError> {
        let stem = self.reuse_stem(t.model, t.images, next)?;
        let p = self.models.get_mut(&t.model).ok_or(VMoeError::UnknownModel(t.model.0))?;
        let config = p.model.config;
        let Some((trainer, _)) = p.trainer.as_mut() else {
            return Err(VMoeError::Config("optimiser state missing".into()));
        };
        trainer.set_lr(lr);
        let chosen = t.experts;
        let trains = |g: ParamGroup| match g {
            ParamGroup::Expert { block, expert } => chosen.contains(&(block, expert)),
            _ => true,
        };
        let started = std::time::Instant::now();
        let input = stem.as_ref().map_or(StepInput::Images(t.images), StepInput::Stem);
        let (loss, cache, trained) = trainer.step_selected_input(&mut p.model, input, t.labels, &trains)?;
        let ended = std::time::Instant::now();
        if let Some(r) = self.reuse.as_mut() {
            r.record_compute(started, ended);
        }
        let elapsed_us = u64::try_from(ended.duration_since(started).as_micros()).unwrap_or(u64::MAX);
        let expert_loads: Vec<Vec<usize>> = (0..config.blocks).map(|b| cache.expert_load(b)).collect();
        let (attn, tmp) = step_samples(t.model, &config, &cache, &trained);
        self.attn.extend(attn);
        self.tmp.extend(tmp);
        Ok(SliceModelReport { model: t.model, loss, trained, expert_loads, elapsed_us })
    }

    fn run_step(
        &mut self,
        id: ModelId,
        images: &Tensor,
        labels: &[usize],
        lr: f32,
    ) -> Result<(f32, super::model::ForwardCache), VMoeError> {
        let next = self.expected.take();
        let stem = self.reuse_stem(id, images, next.as_ref().map(|(m, x)| (*m, x)))?;
        let p = self.models.get_mut(&id).ok_or(VMoeError::UnknownModel(id.0))?;
        let Some((trainer, _)) = p.trainer.as_mut() else {
            return Err(VMoeError::Config("optimiser state missing".into()));
        };
        trainer.set_lr(lr);
        let input = stem.as_ref().map_or(StepInput::Images(images), StepInput::Stem);
        let started = std::time::Instant::now();
        let out = trainer.step_input(&mut p.model, input, labels);
        if let Some(r) = self.reuse.as_mut() {
            r.record_compute(started, std::time::Instant::now());
        }
        out
    }

    /// With the reuse cache on: the stem tokens of `images` for model `id` from the cache (then
    /// the plan and prefetch of `next`, so its disk reads overlap this step's compute). Off: `None`.
    fn reuse_stem(
        &mut self,
        id: ModelId,
        images: &Tensor,
        next: Option<(ModelId, &Tensor)>,
    ) -> Result<Option<Tensor>, VMoeError> {
        let Some(cache) = self.reuse.as_mut() else { return Ok(None) };
        let p = self.models.get(&id).ok_or(VMoeError::UnknownModel(id.0))?;
        let stem = cache.stem(&p.model, &shared_identity(&p.shared_keys), images)?;
        if let Some((n, x)) = next
            && let Some(q) = self.models.get(&n)
        {
            cache.plan_next(&q.model, &shared_identity(&q.shared_keys), x)?;
        }
        Ok(Some(stem))
    }

    /// Turns the reuse cache of stem tokens on: `setup.budget` bytes are carved from this pool
    /// (refused with [`crate::KernelError::OutOfMemory`] when they do not fit) and the disk tier
    /// is a fresh directory under `setup.disk_parent`. From then on every adaptation step starts
    /// from cached stem tokens where the policy has them; results are bit-identical to reuse off.
    pub fn enable_reuse(&mut self, setup: &ReuseSetup) -> Result<(), VMoeError> {
        if self.reuse.is_some() {
            return Err(VMoeError::Config("the reuse cache is already on".into()));
        }
        let at = self.reuse_arena_at(setup.budget.max(1));
        let cache = match StemCache::new_at(&mut self.pool, setup, at) {
            Ok(c) => c,
            Err(e) => {
                self.sample("refused");
                return Err(e);
            }
        };
        self.reuse = Some(cache);
        self.sample("reserve");
        Ok(())
    }

    /// Turns the reuse cache off: its arena goes back to the pool, its disk directory is removed.
    pub fn disable_reuse(&mut self) -> Result<(), VMoeError> {
        self.expected = None;
        if let Some(c) = self.reuse.take() {
            c.release(&mut self.pool)?;
            self.sample("release");
        }
        Ok(())
    }

    /// The reuse cache's figures (`None` when it is off).
    pub fn reuse_stats(&self) -> Option<ReuseStats> {
        self.reuse.as_ref().map(StemCache::stats)
    }

    /// The reuse cache's disk directory (`None` when it is off).
    pub fn reuse_dir(&self) -> Option<&std::path::Path> {
        self.reuse.as_ref().map(StemCache::dir)
    }

    /// Says which batch of which model the next step after the current call runs, so the reuse
    /// cache can prefetch its disk entries while the last step of the call computes. Taken by the
    /// next [`Self::adapt_step`] or [`Self::train_slice`]; ignored with the cache off.
    pub fn reuse_expect(&mut self, id: ModelId, images: &Tensor) {
        if self.reuse.is_some() {
            self.expected = Some((id, images.clone()));
        }
    }

    /// The model as it stands (shared parts are views of the pool's canonical buffers).
    pub fn model(&self, id: ModelId) -> Option<&VMoe> {
        self.models.get(&id).map(|p| &p.model)
    }

    /// The name a model was loaded under.
    pub fn name(&self, id: ModelId) -> Option<&str> {
        self.models.get(&id).map(|p| p.name.as_str())
    }

    /// Loaded models.
    pub fn ids(&self) -> Vec<ModelId> {
        self.models.keys().copied().collect()
    }

    /// Predictions of model `id` on `data` (in batches of [`super::train::EVAL_BATCH`]).
    pub fn predict(&self, id: ModelId, data: &Dataset) -> Result<Vec<usize>, VMoeError> {
        let p = self.models.get(&id).ok_or(VMoeError::UnknownModel(id.0))?;
        predict_all(&p.model, data)
    }

    /// Pool bytes of one expert's weights (its aligned allocation).
    pub fn expert_memory_bytes(&self, id: ModelId, block: usize, expert: usize) -> Option<u64> {
        self.models.get(&id)?.expert_allocs.get(block)?.get(expert).map(|a| a.len)
    }

    /// Pool bytes only this model holds: experts, projector, optimiser state.
    pub fn exclusive_memory_bytes(&self, id: ModelId) -> Option<u64> {
        let p = self.models.get(&id)?;
        let experts: u64 = p.expert_allocs.iter().flatten().map(|a| a.len).sum();
        let state = p.trainer.as_ref().map_or(0, |(_, a)| a.len) + p.state.map_or(0, |a| a.len);
        Some(experts + p.projector_alloc.len + state)
    }

    /// Pool bytes of shared tensors (stored once however many models use them).
    pub fn shared_memory_bytes(&self) -> u64 {
        self.shared.values().map(|e| e.alloc.len).sum()
    }

    /// Number of distinct shared tensors stored.
    pub fn shared_tensors(&self) -> usize {
        self.shared.len()
    }

    /// The memory pool's current figures.
    pub fn stats(&self) -> PoolStats {
        self.pool.stats()
    }

    /// Bytes the lifespan-ordered layout has moved to close holes left by departed models.
    pub fn compacted_bytes(&self) -> u64 {
        self.compacted_bytes
    }

    /// Most bytes ever in use.
    pub fn peak_used(&self) -> u64 {
        self.peak_used
    }

    /// Occupancy and fragmentation after every event so far.
    pub fn fragmentation_samples(&self) -> &[FragSample] {
        &self.frag
    }

    /// Per-expert temporary-memory measurements from every adaptation step so far.
    pub fn tmp_samples(&self) -> &[TmpSample] {
        &self.tmp
    }

    /// Per-block attention temporary-memory measurements from every adaptation step so far.
    pub fn attention_samples(&self) -> &[AttnSample] {
        &self.attn
    }

    /// Sets the AdamW weight decay for optimisers created from now on (default 0).
    pub fn set_weight_decay(&mut self, wd: f32) {
        self.weight_decay = wd;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(at_us: u64, frag: f64) -> FragSample {
        FragSample {
            event: at_us,
            at_us,
            what: "reserve",
            used: 0,
            free: 0,
            largest_free: 0,
            external_fragmentation: frag,
        }
    }

    #[test]
    fn fragmentation_is_weighted_by_how_long_each_state_lasts() {
        // 0.5 for 10 us, then 0.0 for 90 us: 0.05 (the per-event mean would be 0.25).
        let s = [at(0, 0.5), at(10, 0.0), at(100, 0.0)];
        assert!((time_weighted_fragmentation(&s, 0).unwrap() - 0.05).abs() < 1e-12);
        // The last state holds until the end given: 0.5 x 10 + 0.2 x 30 over 40.
        let s = [at(0, 0.5), at(10, 0.2)];
        assert!((time_weighted_fragmentation(&s, 40).unwrap() - 0.275).abs() < 1e-12);
        assert_eq!(time_weighted_fragmentation(&[], 10), None);
        assert_eq!(time_weighted_fragmentation(&[at(5, 0.3)], 5), None);
    }

    #[test]
    fn a_stamp_out_of_order_neither_outweighs_the_span_nor_goes_negative() {
        // A first stamp from another clock, far ahead: the later ones count as made at it, so only
        // the last state holds, until the end.
        let s = [at(1_000, 0.0), at(10, 0.9), at(20, 0.9)];
        let f = time_weighted_fragmentation(&s, 1_010).unwrap();
        assert!((0.0..=1.0).contains(&f), "{f}");
        assert!((f - 0.9 * 10.0 / 10.0).abs() < 1e-12, "{f}");
        // Far behind: it holds until the next stamp, which is where the span starts.
        let s = [at(0, 0.0), at(1_000, 0.5), at(1_010, 0.5)];
        assert!((time_weighted_fragmentation(&s, 1_020).unwrap() - 0.5 * 20.0 / 1_020.0).abs() < 1e-12);
    }

    #[test]
    fn samples_taken_before_the_clock_is_set_are_stamped_at_its_now() {
        fn later() -> u64 {
            5_000_000
        }
        let mut pool = CoAdaptPool::new("clock", 1 << 20).unwrap();
        pool.sample("reserve");
        pool.set_clock(later);
        pool.sample("reserve");
        let stamps: Vec<u64> = pool.fragmentation_samples().iter().map(|s| s.at_us).collect();
        assert_eq!(stamps, vec![5_000_000, 5_000_000]);
    }
}

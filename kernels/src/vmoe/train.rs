//! Training and evaluation: digits as datasets (seeded split, corrupted copies for the teacher),
//! minibatch AdamW with a chosen scope of trainable parameters, accuracy and exact match.
//! Everything is deterministic given the seed.

use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::VMoeError;
use super::model::{IMAGE_PIXELS, ParamGroup, VMoe, VMoeConfig};
use super::on_device::On;
use crate::assets::Digits;
use crate::cuda::CudaAdamW;
use crate::device::Device;
use crate::drift::{Corruption, Frame};
use crate::ops::AdamW;
use crate::tensor::Tensor;

/// Images (pixels in `0..=1`, row-major 8x8) with labels.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Dataset {
    /// `len() * 64` pixels.
    pub images: Vec<f32>,
    /// One label per image.
    pub labels: Vec<usize>,
}

impl Dataset {
    /// The digits, pixels scaled from `0..=16` to `0..=1`.
    pub fn from_digits(d: &Digits) -> Result<Self, VMoeError> {
        if d.rows * d.cols != IMAGE_PIXELS {
            return Err(VMoeError::Config(format!("digits are {}x{}, the V-MoE takes 8x8", d.rows, d.cols)));
        }
        Ok(Self {
            images: d.pixels.iter().map(|&p| f32::from(p) / f32::from(Digits::MAX_PIXEL)).collect(),
            labels: d.labels.iter().map(|&l| usize::from(l)).collect(),
        })
    }

    /// Frames of a camera stream as a dataset (true labels).
    pub fn from_frames(frames: &[Frame]) -> Self {
        Self {
            images: frames.iter().flat_map(|f| f.image.iter().copied()).collect(),
            labels: frames.iter().map(|f| f.label).collect(),
        }
    }

    /// Number of images.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// The images at `idx`, in that order; an error names the first index past the end.
    pub fn subset(&self, idx: &[usize]) -> Result<Self, VMoeError> {
        if let Some(&bad) = idx.iter().find(|&&i| i >= self.len()) {
            return Err(VMoeError::Config(format!("image {bad} of a dataset of {}", self.len())));
        }
        Ok(Self {
            images: idx
                .iter()
                .flat_map(|&i| &self.images[i * IMAGE_PIXELS..(i + 1) * IMAGE_PIXELS])
                .copied()
                .collect(),
            labels: idx.iter().map(|&i| self.labels[i]).collect(),
        })
    }

    /// A seeded shuffle split into `(train, test)` with `test_fraction` of the images in test.
    pub fn split(&self, test_fraction: f64, seed: u64) -> Result<(Self, Self), VMoeError> {
        let mut idx: Vec<usize> = (0..self.len()).collect();
        idx.shuffle(&mut SmallRng::seed_from_u64(seed));
        let n_test = ((self.len() as f64) * test_fraction.clamp(0.0, 1.0)).round() as usize;
        let (test, train) = idx.split_at(n_test);
        Ok((self.subset(train)?, self.subset(test)?))
    }

    /// `batch x 64` tensor of the images at `idx`.
    pub fn batch(&self, idx: &[usize]) -> Result<Tensor, VMoeError> {
        let s = self.subset(idx)?;
        Ok(Tensor::from_f32(&[idx.len(), IMAGE_PIXELS], s.images)?)
    }

    /// `copies` corrupted copies of every image: each copy gets a random non-clean corruption at a
    /// random severity in `min_severity..=1` (seeded). The teacher trains on these plus the clean set.
    pub fn corrupted(&self, copies: usize, min_severity: f32, seed: u64) -> Self {
        let mut rng = SmallRng::seed_from_u64(seed);
        let kinds = &Corruption::ALL[1..];
        let mut out = Self::default();
        for _ in 0..copies {
            for i in 0..self.len() {
                let mut img = self.images[i * IMAGE_PIXELS..(i + 1) * IMAGE_PIXELS].to_vec();
                let kind = kinds[rng.random_range(0..kinds.len())];
                let sev = rng.random_range(min_severity.clamp(0.0, 1.0)..=1.0);
                kind.apply(&mut img, sev, &mut rng);
                out.images.extend(img);
                out.labels.push(self.labels[i]);
            }
        }
        out
    }

    /// This dataset followed by `other`.
    pub fn concat(&self, other: &Self) -> Self {
        let mut out = self.clone();
        out.images.extend_from_slice(&other.images);
        out.labels.extend_from_slice(&other.labels);
        out
    }
}

/// Which parameters a trainer updates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrainScope {
    /// Everything (pre-training).
    Full,
    /// Experts, projector and head only (adaptation; shared parts stay frozen and mergeable).
    ExpertsAndProjector,
}

impl TrainScope {
    /// Whether parameters of `group` train.
    pub fn trains(self, group: ParamGroup) -> bool {
        match self {
            TrainScope::Full => true,
            TrainScope::ExpertsAndProjector => !matches!(group, ParamGroup::Shared),
        }
    }
}

/// AdamW over a model's parameters within a [`TrainScope`]; one optimiser state per tensor. On a
/// CUDA device every op of the step runs there and the moments of the trainable tensors live in
/// device memory, allocated when the trainer is made (at load), not inside a step.
#[derive(Clone, Debug)]
pub struct Trainer {
    scope: TrainScope,
    opts: Vec<AdamW>,
    device: Device,
    /// Per tensor, its moments on the device (CUDA only; `None` outside the scope).
    device_opts: Vec<Option<CudaAdamW>>,
    steps: u64,
}

impl Trainer {
    /// A trainer for `model` with learning rate `lr` and decoupled weight decay `weight_decay`.
    pub fn new(model: &VMoe, scope: TrainScope, lr: f32, weight_decay: f32) -> Self {
        let opts = model
            .params
            .tensors()
            .iter()
            .map(|_| {
                let mut o = AdamW::new(lr);
                o.weight_decay = weight_decay;
                o
            })
            .collect();
        Self { scope, opts, device: Device::Cpu, device_opts: Vec::new(), steps: 0 }
    }

    /// [`Self::new`] running every op of a step on `device`. On CUDA the moments of each tensor in
    /// the scope are allocated on the device now.
    pub fn on_device(
        model: &VMoe,
        scope: TrainScope,
        lr: f32,
        weight_decay: f32,
        device: Device,
    ) -> Result<Self, VMoeError> {
        let mut t = Self::new(model, scope, lr, weight_decay);
        if let Device::Cuda(dev) = &device {
            t.device_opts = model
                .params
                .tensors()
                .iter()
                .zip(&t.opts)
                .map(|((group, tensor), hyper)| {
                    scope
                        .trains(*group)
                        .then(|| CudaAdamW::new(dev, hyper.clone(), tensor.numel()))
                        .transpose()
                })
                .collect::<Result<_, _>>()?;
        }
        t.device = device;
        Ok(t)
    }

    /// The device every op of a step runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Moves the optimiser's host moments into fresh buffers (a pool compaction's copy; moments
    /// on a CUDA device stay in device memory, outside the pool's accounting of them).
    pub fn relocate_state(&mut self) {
        for o in &mut self.opts {
            o.relocate();
        }
    }

    /// Sets the learning rate of every parameter.
    pub fn set_lr(&mut self, lr: f32) {
        self.opts.iter_mut().for_each(|o| o.lr = lr);
        self.device_opts.iter_mut().flatten().for_each(|o| o.hyper.lr = lr);
    }

    /// Steps taken.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The scope.
    pub fn scope(&self) -> TrainScope {
        self.scope
    }

    /// Bytes of optimiser state (two f32 moments per trainable parameter) for `config`.
    pub fn state_bytes(config: &VMoeConfig, scope: TrainScope) -> u64 {
        let trainable = match scope {
            TrainScope::Full => config.param_count(),
            TrainScope::ExpertsAndProjector => config.param_count() - config.shared_params(),
        };
        (trainable * 2 * 4) as u64
    }

    /// One step of mean cross-entropy on `images` (`batch x 64`) against `labels`; returns the loss
    /// before the update and the forward cache (for memory measurements).
    pub fn step_with_cache(
        &mut self,
        model: &mut VMoe,
        images: &Tensor,
        labels: &[usize],
    ) -> Result<(f32, super::model::ForwardCache), VMoeError> {
        self.step_input(model, StepInput::Images(images), labels)
    }

    /// [`Self::step_with_cache`] from images or cached stem tokens ([`StepInput`]). From the stem
    /// only a scope that keeps it frozen makes sense ([`TrainScope::ExpertsAndProjector`]).
    pub fn step_input(
        &mut self,
        model: &mut VMoe,
        input: StepInput<'_>,
        labels: &[usize],
    ) -> Result<(f32, super::model::ForwardCache), VMoeError> {
        let (loss, cache, _) = self.step_selected_input(model, input, labels, &|_| true)?;
        Ok((loss, cache))
    }

    /// One step that updates only the parameters `trains` accepts (within the scope); the others are
    /// frozen for this step (no optimiser update, their moments untouched). Returns the loss before
    /// the update, the forward cache and the experts `(block, expert)` that were updated, ascending.
    /// Used by the co-adaptation pool to train the experts of one time slice.
    pub fn step_selected(
        &mut self,
        model: &mut VMoe,
        images: &Tensor,
        labels: &[usize],
        trains: &dyn Fn(ParamGroup) -> bool,
    ) -> Result<SelectedStep, VMoeError> {
        self.step_selected_input(model, StepInput::Images(images), labels, trains)
    }

    /// [`Self::step_selected`] from either images or cached stem tokens ([`StepInput`]); both give
    /// bit-identical updates (the stem is frozen, [`super::model::VMoe::forward_from_stem`]).
    pub fn step_selected_input(
        &mut self,
        model: &mut VMoe,
        input: StepInput<'_>,
        labels: &[usize],
        trains: &dyn Fn(ParamGroup) -> bool,
    ) -> Result<SelectedStep, VMoeError> {
        if self.opts.len() != model.params.tensors().len() {
            return Err(VMoeError::Config("trainer was made for a different model".into()));
        }
        if matches!(input, StepInput::Stem(_)) && self.scope == TrainScope::Full {
            return Err(VMoeError::Config("a full-scope step cannot start from cached stem tokens".into()));
        }
        let device = &self.device;
        let (logits, cache) = input.forward(model, device)?;
        let (loss, dlogits) = On(device).cross_entropy(&logits, labels)?;
        let grads = model.backward_on(device, &cache, &dlogits)?;
        let mut updated = Vec::new();
        for (i, ((opt, (group, param)), (_, grad))) in
            self.opts.iter_mut().zip(model.params.tensors_mut()).zip(grads.tensors()).enumerate()
        {
            if self.scope.trains(group) && trains(group) {
                match (device, self.device_opts.get_mut(i)) {
                    (Device::Cuda(dev), Some(Some(on_device))) => {
                        on_device.step(dev, param.f32_mut()?, &grad.f32_cow())?
                    }
                    _ => opt.step(param.f32_mut()?, &grad.f32_cow())?,
                }
                if let ParamGroup::Expert { block, expert } = group
                    && updated.last() != Some(&(block, expert))
                {
                    updated.push((block, expert));
                }
            }
        }
        self.steps += 1;
        Ok((loss, cache, updated))
    }

    /// One step; returns the loss before the update.
    pub fn step(&mut self, model: &mut VMoe, images: &Tensor, labels: &[usize]) -> Result<f32, VMoeError> {
        Ok(self.step_with_cache(model, images, labels)?.0)
    }
}

/// What a training step starts from.
#[derive(Clone, Copy, Debug)]
pub enum StepInput<'a> {
    /// `batch x 64` images: the full forward pass.
    Images(&'a Tensor),
    /// Cached stem tokens (`batch * tokens x dim`, [`super::model::VMoe::stem`]): the pass starts
    /// at block 0's MoE. Only valid while the stem is frozen (adaptation).
    Stem(&'a Tensor),
}

impl StepInput<'_> {
    fn forward(
        self,
        model: &VMoe,
        device: &Device,
    ) -> Result<(Tensor, super::model::ForwardCache), VMoeError> {
        match self {
            StepInput::Images(x) => model.forward_on(device, x),
            StepInput::Stem(s) => model.forward_from_stem_on(device, s),
        }
    }
}

/// What [`Trainer::step_selected`] returns: the loss before the update, the forward cache, and
/// the experts `(block, expert)` updated, ascending.
pub type SelectedStep = (f32, super::model::ForwardCache, Vec<(usize, usize)>);

/// How to train a model: seed, epochs, batch size, learning rate (linearly decayed to 10%).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Recipe {
    /// Seeds the init and the batch order.
    pub seed: u64,
    /// Passes over the data.
    pub epochs: usize,
    /// Images per step.
    pub batch: usize,
    /// Peak learning rate.
    pub lr: f32,
    /// AdamW decoupled weight decay.
    pub weight_decay: f32,
}

impl Recipe {
    /// The full recipe used for the cached students and teacher.
    pub fn full(seed: u64) -> Self {
        Self { seed, epochs: 30, batch: 32, lr: 0.01, weight_decay: 1e-4 }
    }

    /// A short recipe for tests in debug builds (and the cached zoo they share): 5 epochs, so the
    /// teacher and four students train in about a minute on two cores in the test profile.
    pub fn fast(seed: u64) -> Self {
        Self { epochs: 5, ..Self::full(seed) }
    }

    /// The recipe of the paper-shaped student ([`super::VMoeConfig::sprite`], width 192): 10 epochs
    /// at peak 1e-3. At the fast recipe's 0.01 it trains to 0.67 clean accuracy and its frozen
    /// features do not adapt (one run here: +0.4 points mean over six drifts); at 1e-3, 0.97.
    pub fn wide(seed: u64) -> Self {
        Self { epochs: 10, lr: 1e-3, ..Self::full(seed) }
    }

    /// A short name of the recipe's fields (part of cached model file names).
    pub fn tag(&self) -> String {
        format!("s{}-e{}-b{}-lr{}-wd{}", self.seed, self.epochs, self.batch, self.lr, self.weight_decay)
    }
}

/// What a training run did.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainReport {
    /// Optimiser steps.
    pub steps: u64,
    /// Mean training loss of each epoch.
    pub epoch_loss: Vec<f32>,
}

/// Trains `model` on `data` for `recipe.epochs` epochs (seeded batch order).
pub fn train(
    model: &mut VMoe,
    data: &Dataset,
    recipe: &Recipe,
    scope: TrainScope,
) -> Result<TrainReport, VMoeError> {
    if data.is_empty() || recipe.batch == 0 {
        return Err(VMoeError::Config("empty data or batch size 0".into()));
    }
    let mut trainer = Trainer::new(model, scope, recipe.lr, recipe.weight_decay);
    let mut rng = SmallRng::seed_from_u64(recipe.seed ^ 0x5eed_ba7c);
    let mut order: Vec<usize> = (0..data.len()).collect();
    let steps_per_epoch = data.len().div_ceil(recipe.batch);
    let total = (steps_per_epoch * recipe.epochs).max(1) as f32;
    let mut epoch_loss = Vec::with_capacity(recipe.epochs);
    for _ in 0..recipe.epochs {
        order.shuffle(&mut rng);
        let mut sum = 0.0;
        for idx in order.chunks(recipe.batch) {
            let progress = trainer.steps() as f32 / total;
            trainer.set_lr(recipe.lr * (1.0 - 0.9 * progress));
            let labels: Vec<usize> = idx.iter().map(|&i| data.labels[i]).collect();
            sum += trainer.step(model, &data.batch(idx)?, &labels)?;
        }
        epoch_loss.push(sum / steps_per_epoch as f32);
    }
    Ok(TrainReport { steps: trainer.steps(), epoch_loss })
}

/// Images per forward pass in [`predict_all`]; predictions depend on batch composition through expert
/// capacity, so evaluation always uses this size and the data's order.
pub const EVAL_BATCH: usize = 64;

/// Predicted class of every image, in order (batches of [`EVAL_BATCH`]).
pub fn predict_all(model: &VMoe, data: &Dataset) -> Result<Vec<usize>, VMoeError> {
    let mut out = Vec::with_capacity(data.len());
    let idx: Vec<usize> = (0..data.len()).collect();
    for chunk in idx.chunks(EVAL_BATCH) {
        out.extend(model.predict(&data.batch(chunk)?)?);
    }
    Ok(out)
}

/// Share of positions where `a` and `b` agree (0 when empty or of different lengths).
pub fn exact_match(a: &[usize], b: &[usize]) -> f64 {
    if a.is_empty() || a.len() != b.len() {
        return 0.0;
    }
    a.iter().zip(b).filter(|(x, y)| x == y).count() as f64 / a.len() as f64
}

/// Share of predictions equal to the labels.
pub fn accuracy(preds: &[usize], labels: &[usize]) -> f64 {
    exact_match(preds, labels)
}

/// Seed of the fixed train/test split of digits used throughout.
pub const SPLIT_SEED: u64 = 2024;
/// Share of digits held out for testing.
pub const TEST_FRACTION: f64 = 0.2;

/// The digits from the setup cache, split `(train, test)` with [`SPLIT_SEED`].
pub fn digits_split() -> Result<(Dataset, Dataset), VMoeError> {
    let digits = crate::assets::Assets::locate()?.digits()?;
    Dataset::from_digits(&digits)?.split(TEST_FRACTION, SPLIT_SEED)
}

/// The teacher's training set: the clean images plus two corrupted copies (severity 0.2..=1).
pub fn teacher_data(train: &Dataset, seed: u64) -> Dataset {
    train.concat(&train.corrupted(2, 0.2, seed ^ 0x7eac))
}

/// A model of `config` initialised from `recipe.seed` and trained on `data`.
pub fn train_new(
    config: VMoeConfig,
    data: &Dataset,
    recipe: &Recipe,
) -> Result<(VMoe, TrainReport), VMoeError> {
    let mut model = VMoe::new(config, &mut SmallRng::seed_from_u64(recipe.seed))?;
    let report = train(&mut model, data, recipe, TrainScope::Full)?;
    Ok((model, report))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toy(n: usize) -> Dataset {
        Dataset {
            images: (0..n * IMAGE_PIXELS).map(|i| (i % 7) as f32 / 7.0).collect(),
            labels: (0..n).map(|i| i % 10).collect(),
        }
    }

    #[test]
    fn split_is_seeded_and_disjoint() {
        let d = toy(50);
        let (tr, te) = d.split(0.2, 3).unwrap();
        assert_eq!((tr.len(), te.len()), (40, 10));
        assert_eq!(d.split(0.2, 3).unwrap(), (tr.clone(), te.clone()));
        assert_ne!(d.split(0.2, 4).unwrap().1, te);
        assert_eq!(tr.images.len(), 40 * IMAGE_PIXELS);
    }

    #[test]
    fn corrupted_copies_keep_labels_and_change_pixels() {
        let d = toy(20);
        let c = d.corrupted(2, 0.5, 1);
        assert_eq!(c.len(), 40);
        assert_eq!(&c.labels[..20], &d.labels[..]);
        assert_eq!(&c.labels[20..], &d.labels[..]);
        assert_ne!(&c.images[..20 * IMAGE_PIXELS], &d.images[..]);
        assert!(c.images.iter().all(|v| (0.0..=1.0).contains(v)));
        assert_eq!(c, d.corrupted(2, 0.5, 1));
        assert_eq!(teacher_data(&d, 1).len(), 60);
    }

    #[test]
    fn exact_match_by_hand() {
        assert_eq!(exact_match(&[1, 2, 3, 4], &[1, 0, 3, 0]), 0.5);
        assert_eq!(exact_match(&[], &[]), 0.0);
        assert_eq!(exact_match(&[1], &[1, 2]), 0.0);
        assert_eq!(accuracy(&[3, 3], &[3, 3]), 1.0);
    }
}

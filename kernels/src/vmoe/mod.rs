//! A small Vision Mixture-of-Experts (V-MoE) on the crate's ops, trained on scikit-learn's 8x8 digits:
//! the model behind the `coadapt` workload (AdaSprite). Images are upsampled to 16x16 in the model's
//! stem and cut into 64 tokens; each block is pre-norm self-attention then a pre-norm MoE.
//!
//! - [`config`]: the shape (four student sizes and a teacher); [`params`]: the weights by group
//!   (attention is shared: frozen in adaptation, merged in the pool).
//! - [`model`]: forward with cache, full backward.
//! - [`train`]: datasets from digits, seeded minibatch AdamW training, accuracy and exact match.
//! - [`mod@file`]: checksummed model files and the trained-model cache under `.cache/models/vmoe/`.
//! - [`reuse`]: the reuse cache of stem tokens (DRAM arena carved from the pool, disk tier through
//!   the weight store, background prefetch), its decisions from `troupe_policy::adapt::reuse`.
//! - [`merge`]: the parallel expert set of a co-adaptation group (cross-task expert transfer).
//! - [`pool`]: the co-adaptation pool (merged shared parts, per-model experts, memory through a
//!   [`crate::MemoryPool`], expert-and-projector adaptation steps).

pub mod config;
pub mod file;
pub mod merge;
pub mod model;
mod on_device;
pub mod params;
pub mod pool;
pub mod reuse;
pub mod train;

use std::path::PathBuf;

use crate::assets::AssetError;
use crate::error::KernelError;

pub use file::{ModelZoo, Provenance, load_model, save_model};
pub use model::{ForwardCache, MoeBlock, ParamGroup, VMoe, VMoeConfig, VMoeParams};
pub use pool::{AdaptReport, AttnSample, CoAdaptPool, FragSample, ModelId, TmpSample};
pub use train::{Dataset, Recipe, StepInput, TrainReport, TrainScope, Trainer, accuracy, exact_match};

/// Everything that can go wrong building, training, storing or pooling a V-MoE.
#[derive(Debug, thiserror::Error)]
pub enum VMoeError {
    /// A kernel op, tensor or memory pool failed (includes the pool refusing memory).
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// The config or an argument does not describe a valid model or batch.
    #[error("invalid V-MoE input: {0}")]
    Config(String),
    /// A model file is malformed (bad magic, length, checksum, config).
    #[error("model file {path} is malformed: {detail}")]
    BadModelFile {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// Reading or writing a model file failed.
    #[error("I/O error while {context} {path}: {source}")]
    Io {
        /// What we were doing.
        context: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The setup cache (digits) is missing or broken.
    #[error(transparent)]
    Assets(#[from] AssetError),
    /// No model with this id is loaded in the pool.
    #[error("no model {0} in the co-adaptation pool")]
    UnknownModel(u32),
}

//! The `coadapt` workload's actors (AdaSprite, ARCHITECTURE.md "Workload 3"): camera actors stream
//! a drifting [`troupe_kernels::drift::CameraStream`] through their V-MoE for their whole stream,
//! notice every drift (a drop in confidence or a move of the input's statistics), and upload
//! samples to the edge; the edge actor labels them with the teacher, co-adapts every camera's
//! experts and projector in one [`troupe_kernels::vmoe::CoAdaptPool`] under a co-adaptation
//! scheduler ([`engine`]), and sends the adapted parameters back. Cameras report their progress
//! (accuracy over time, adaptations, stream ended) to the edge for the job.
//!
//! - [`wire`]: the checked rkyv messages; [`params`]: the trainable part as a flat vector.
//! - [`detect`]: the confidence-drop drift detector; the online loop's decisions (re-arming,
//!   input shift, sample log, job completion) are `troupe_policy::adapt::online`;
//!   [`engine`]: scheduler + pool executor.
//! - [`throttle`]: the reuse cache's storage reads at an edge board's bandwidth (cgroup blkio/io).
//! - [`edge`] and [`camera`]: the actor shells; [`sim_compute`]: their model compute's
//!   deterministic stand-ins on a simulated cluster.

pub mod camera;
/// The drift detector is a pure decision: it lives in `troupe_policy::adapt::drift`.
pub use troupe_policy::adapt::drift as detect;
pub mod edge;
mod edge_journal;
pub mod engine;
pub mod params;
pub mod sim_compute;
pub mod throttle;
pub mod wire;

use troupe_kernels::vmoe::train::{Dataset, digits_split, teacher_data};
use troupe_kernels::vmoe::{ModelZoo, Recipe, VMoe, VMoeConfig, VMoeError};

/// The name the edge's front ([`edge::EdgeActor`]) is registered by: cameras find it with
/// `actors.wait_for::<EdgeActor>(EDGE_ACTOR, ..)` and call it through the typed handle.
pub const EDGE_ACTOR: &str = "coadapt-edge";

/// Seed of the cached students and teacher (the kernels' tests use the same models).
pub const MODEL_SEED: u64 = 1;

/// The digits split `(train, test)` used throughout.
pub fn digits() -> Result<(Dataset, Dataset), VMoeError> {
    digits_split()
}

/// The student in the paper's shape ([`VMoeConfig::sprite`]: frozen parts about 60% of its
/// weights), the one the bench adapts.
pub const PAPER_STUDENT: &str = "sprite";

/// A student of size `size` (`tiny`, `small`, `base`, `large`, [`PAPER_STUDENT`]) trained on clean
/// digits, from the model cache (trained on first use by the fast recipe, the paper-shaped student
/// by [`Recipe::wide`], and cached).
pub fn zoo_student(size: &str, train: &Dataset) -> Result<VMoe, VMoeError> {
    let config = student_config(size)?;
    let recipe = if size == PAPER_STUDENT { Recipe::wide(MODEL_SEED) } else { Recipe::fast(MODEL_SEED) };
    let zoo = ModelZoo::in_cache()?;
    Ok(zoo.get_or_train(size, config, &recipe, "digits", train)?.0)
}

/// The config of student `size`, refusing the teacher and unknown names.
pub fn student_config(size: &str) -> Result<VMoeConfig, VMoeError> {
    if !VMoeConfig::STUDENT_SIZES.contains(&size) && size != PAPER_STUDENT {
        return Err(VMoeError::Config(format!(
            "unknown student size {size:?} (tiny, small, base, large, {PAPER_STUDENT})"
        )));
    }
    VMoeConfig::named(size).ok_or_else(|| VMoeError::Config(format!("unknown student size {size:?}")))
}

/// The teacher (trained on clean and corrupted digits), from the model cache.
pub fn zoo_teacher(train: &Dataset) -> Result<VMoe, VMoeError> {
    let recipe = Recipe::fast(MODEL_SEED);
    let data = teacher_data(train, recipe.seed);
    let zoo = ModelZoo::in_cache()?;
    Ok(zoo.get_or_train("teacher", VMoeConfig::teacher(), &recipe, "digits+corrupted", &data)?.0)
}

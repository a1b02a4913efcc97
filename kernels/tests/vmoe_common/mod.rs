//! Shared by the vmoe_* tests: the digits split, a teacher and a student from the model zoo in the setup
//! cache (trained by the fast recipe on first use, then read back from `.cache/models/vmoe/`).

#![allow(dead_code)]

use std::sync::OnceLock;

use troupe_kernels::vmoe::train::{Dataset, digits_split, teacher_data};
use troupe_kernels::vmoe::{ModelZoo, Recipe, VMoe, VMoeConfig};

/// Seed of every model the tests use.
pub const SEED: u64 = 1;

pub fn split() -> &'static (Dataset, Dataset) {
    static SPLIT: OnceLock<(Dataset, Dataset)> = OnceLock::new();
    SPLIT.get_or_init(|| digits_split().expect("digits missing: run scripts/setup"))
}

fn zoo() -> ModelZoo {
    ModelZoo::in_cache().expect("setup cache missing: run scripts/setup")
}

/// The teacher: the teacher config trained on clean + corrupted digits.
pub fn teacher() -> &'static VMoe {
    static T: OnceLock<VMoe> = OnceLock::new();
    T.get_or_init(|| {
        let recipe = Recipe::fast(SEED);
        let data = teacher_data(&split().0, recipe.seed);
        zoo()
            .get_or_train("teacher", VMoeConfig::teacher(), &recipe, "digits+corrupted", &data)
            .expect("teacher")
            .0
    })
}

/// The tiny student trained on clean digits only.
pub fn student() -> &'static VMoe {
    static S: OnceLock<VMoe> = OnceLock::new();
    S.get_or_init(|| {
        zoo()
            .get_or_train("tiny", VMoeConfig::tiny(), &Recipe::fast(SEED), "digits", &split().0)
            .expect("student")
            .0
    })
}

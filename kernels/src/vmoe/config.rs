//! The shape of a V-MoE: [`VMoeConfig`] with four named student sizes and a teacher, validation
//! (caps on every dimension, so a model file cannot make us allocate without bound) and the
//! parameter counts the pool's memory accounting uses.

use super::VMoeError;

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
        Self { dim: 24, top_k: 2, hidden: 48, proj: 48, ..Self::tiny() }
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
        Self { dim: 32, blocks: 3, experts: 8, hidden: 64, proj: 64, ..Self::base() }
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
            return bad(format!("top_k = {} with {} experts", self.top_k, self.experts));
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
        self.shared_params() + self.blocks * self.experts * self.expert_params() + self.projector_params()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_grow_and_counts_add_up() {
        let counts: Vec<usize> =
            VMoeConfig::STUDENT_SIZES.iter().map(|n| VMoeConfig::named(n).unwrap().param_count()).collect();
        assert!(counts.windows(2).all(|w| w[0] < w[1]), "{counts:?}");
        assert!(VMoeConfig::teacher().param_count() > counts[3]);
        assert!(VMoeConfig::named("huge").is_none());
        // tiny by hand: embed 16*16 + 16 + 4*16 = 336; per block 2*16 + 16*4 = 96 (x2);
        // final norm 32 -> shared 560. Expert 2*16*32 + 32 + 16 = 1072 (x8). Projector
        // 16*32 + 32 + 32*10 + 10 = 874. Total 560 + 8576 + 874 = 10010.
        let t = VMoeConfig::tiny();
        assert_eq!((t.shared_params(), t.expert_params(), t.projector_params()), (560, 1072, 874));
        assert_eq!(t.param_count(), 10_010);
    }

    #[test]
    fn capacity_by_hand() {
        // tiny: 64 images x 4 tokens, top-1 over 4 experts: even share 64, x1.5 = 96.
        assert_eq!(VMoeConfig::tiny().capacity(256), 96);
        // base: 10 tokens, top-2 over 6 experts: 20/6 = 3.33, x1.25 = 4.17 -> 5.
        assert_eq!(VMoeConfig::base().capacity(10), 5);
        assert_eq!(VMoeConfig::tiny().capacity(0), 1);
        for bad in [
            VMoeConfig { dim: 0, ..VMoeConfig::tiny() },
            VMoeConfig { hidden: MAX_DIM + 1, ..VMoeConfig::tiny() },
            VMoeConfig { capacity_factor: f32::NAN, ..VMoeConfig::tiny() },
            VMoeConfig { blocks: 65, ..VMoeConfig::tiny() },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }
}

//! The shape of a V-MoE: [`VMoeConfig`] with four named student sizes and a teacher, validation
//! (caps on every dimension, so a model file cannot make us allocate without bound) and the
//! parameter counts the pool's memory accounting uses.
//!
//! Every size sees 64 tokens per image: the 8x8 camera image is upsampled (bilinear) to
//! [`INPUT_SIDE`] x [`INPUT_SIDE`] by the model's stem and cut into 2x2 patches, so attention has a
//! real `T^2` to pay for. Experts are wide (hidden 4-6x the width) and many, so one task's adaptation
//! state is a real share of an edge pool, while top-1/top-2 routing keeps the compute per token small.

use super::VMoeError;

/// Side of the square images the model is given (scikit-learn digits and camera frames are 8x8).
pub const IMAGE_SIDE: usize = 8;
/// Pixels per input image.
pub const IMAGE_PIXELS: usize = IMAGE_SIDE * IMAGE_SIDE;
/// Side of the grid the model works on: inputs are upsampled (bilinear) from [`IMAGE_SIDE`] to this
/// before patching (see [`super::model::upsample`]).
pub const INPUT_SIDE: usize = 16;
/// Pixels of the upsampled grid.
pub const INPUT_PIXELS: usize = INPUT_SIDE * INPUT_SIDE;
/// Layer-norm epsilon used throughout.
pub const LN_EPS: f32 = 1e-5;

/// Largest width, hidden size, expert count, ... a config may ask for (caps what a model file can make
/// us allocate).
pub const MAX_DIM: usize = 1024;

/// The shape of a V-MoE.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct VMoeConfig {
    /// Patch side in pixels of the upsampled grid (2 or 4: 64 or 16 tokens per image).
    pub patch: usize,
    /// Token width.
    pub dim: usize,
    /// Attention heads (divides `dim`).
    pub heads: usize,
    /// Blocks, each attention then MoE (at least 2).
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

    /// Smallest student: 64 tokens per image, 2 blocks of 8 experts, top-1.
    pub fn tiny() -> Self {
        Self {
            patch: 2,
            dim: 16,
            heads: 2,
            blocks: 2,
            experts: 8,
            top_k: 1,
            hidden: 64,
            proj: 32,
            classes: 10,
            capacity_factor: 1.5,
        }
    }

    /// Second student: 12 wider experts per block.
    pub fn small() -> Self {
        Self { experts: 12, hidden: 96, proj: 48, ..Self::tiny() }
    }

    /// Third student: width 24, 12 experts of hidden 128 per block, top-2.
    pub fn base() -> Self {
        Self { dim: 24, experts: 12, top_k: 2, hidden: 128, proj: 48, capacity_factor: 1.25, ..Self::tiny() }
    }

    /// Largest student: 3 blocks of the base's experts.
    pub fn large() -> Self {
        Self { blocks: 3, proj: 64, ..Self::base() }
    }

    /// The paper's shape (AdaSprite §2.2, "sprite"): the frozen parts every co-adapted copy shares
    /// (embeddings, attention, norms, routers) are about 60% of its weights and the experts are
    /// small, 16 tokens per image (4x4 patches) so that one step of 16 images needs under a third
    /// of a pool that holds eight tasks' state. Not one of [`Self::STUDENT_SIZES`]: the bench and
    /// the campus adapt it; the test suites keep to the cheaper sizes.
    pub fn sprite() -> Self {
        Self {
            patch: 4,
            dim: 192,
            heads: 4,
            blocks: 2,
            experts: 8,
            top_k: 1,
            hidden: 32,
            proj: 64,
            classes: 10,
            capacity_factor: 1.25,
        }
    }

    /// Share of the weights that are frozen in adaptation and merged across co-adapted copies
    /// ([`Self::shared_params`] over [`Self::param_count`]).
    pub fn frozen_share(&self) -> f64 {
        self.shared_params() as f64 / self.param_count().max(1) as f64
    }

    /// The reference model that labels uploaded samples: larger than every student (width 32,
    /// 2 blocks of 16 experts; top-1 and 2 blocks keep its training, on 3x the students' data,
    /// affordable in test builds).
    pub fn teacher() -> Self {
        Self {
            patch: 2,
            dim: 32,
            heads: 2,
            blocks: 2,
            experts: 16,
            top_k: 1,
            hidden: 128,
            proj: 64,
            classes: 10,
            capacity_factor: 1.5,
        }
    }

    /// The config called `name` (`tiny`, `small`, `base`, `large`, `sprite`, `teacher`).
    pub fn named(name: &str) -> Option<Self> {
        match name {
            "tiny" => Some(Self::tiny()),
            "small" => Some(Self::small()),
            "base" => Some(Self::base()),
            "large" => Some(Self::large()),
            "sprite" => Some(Self::sprite()),
            "teacher" => Some(Self::teacher()),
            _ => None,
        }
    }

    /// Checks every field; the error says which one is off.
    pub fn validate(&self) -> Result<(), VMoeError> {
        let bad = |d: String| Err(VMoeError::Config(d));
        if self.patch == 0 || !INPUT_SIDE.is_multiple_of(self.patch) {
            return bad(format!("patch {} does not tile {INPUT_SIDE}", self.patch));
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
        if self.heads == 0 || !self.dim.is_multiple_of(self.heads) {
            return bad(format!("heads = {} does not divide dim = {}", self.heads, self.dim));
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
        (INPUT_SIDE / self.patch).pow(2)
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

    /// Parameters of one block's attention: its pre-norm and the Q/K/V/O projections.
    pub fn attention_params(&self) -> usize {
        2 * self.dim + 4 * self.dim * self.dim
    }

    /// Parameters shared across merged copies (patch and position embeddings, attention, norms,
    /// routers): everything frozen during adaptation.
    pub fn shared_params(&self) -> usize {
        let embed = self.patch_len() * self.dim + self.dim + self.tokens_per_image() * self.dim;
        let per_block = self.attention_params() + 2 * self.dim + self.dim * self.experts;
        embed + self.blocks * per_block + 2 * self.dim
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
        // tiny by hand: embed 4*16 + 16 + 64*16 = 1104; per block attention 2*16 + 4*16*16 = 1056,
        // norm 32, router 16*8 = 128 -> 1216 (x2); final norm 32 -> shared 3568. Expert
        // 2*16*64 + 64 + 16 = 2128 (x16). Projector 16*32 + 32 + 32*10 + 10 = 874.
        // Total 3568 + 34048 + 874 = 38490.
        let t = VMoeConfig::tiny();
        assert_eq!(t.tokens_per_image(), 64);
        assert_eq!((t.shared_params(), t.expert_params(), t.projector_params()), (3568, 2128, 874));
        assert_eq!(t.param_count(), 38_490);
        assert!(
            VMoeConfig::STUDENT_SIZES.iter().all(|n| VMoeConfig::named(n).unwrap().tokens_per_image() >= 64)
        );
    }

    #[test]
    fn the_paper_shape_is_mostly_frozen() {
        // sprite by hand: embed 16*192 + 192 + 16*192 = 6336; per block attention 2*192 +
        // 4*192^2 = 147840, norm 384, router 192*8 = 1536 -> 149760 (x2); final norm 384 -> shared
        // 306240. Expert 2*192*32 + 32 + 192 = 12512 (x16 = 200192). Projector 192*64 + 64 +
        // 64*10 + 10 = 13002. Total 519434; frozen 306240 / 519434 = 0.590.
        let s = VMoeConfig::named("sprite").unwrap();
        s.validate().unwrap();
        assert_eq!((s.shared_params(), s.expert_params(), s.projector_params()), (306_240, 12_512, 13_002));
        assert_eq!(s.param_count(), 519_434);
        assert!((s.frozen_share() - 0.5896).abs() < 1e-3, "{}", s.frozen_share());
        assert!(VMoeConfig::tiny().frozen_share() < 0.1);
    }

    #[test]
    fn capacity_by_hand() {
        // tiny: 256 tokens, top-1 over 8 experts: even share 32, x1.5 = 48.
        assert_eq!(VMoeConfig::tiny().capacity(256), 48);
        // base: 10 tokens, top-2 over 12 experts: 20/12 = 1.67, x1.25 = 2.08 -> 3.
        assert_eq!(VMoeConfig::base().capacity(10), 3);
        assert_eq!(VMoeConfig::tiny().capacity(0), 1);
        for bad in [
            VMoeConfig { dim: 0, ..VMoeConfig::tiny() },
            VMoeConfig { hidden: MAX_DIM + 1, ..VMoeConfig::tiny() },
            VMoeConfig { capacity_factor: f32::NAN, ..VMoeConfig::tiny() },
            VMoeConfig { blocks: 65, ..VMoeConfig::tiny() },
            VMoeConfig { heads: 3, ..VMoeConfig::tiny() },
            VMoeConfig { patch: 3, ..VMoeConfig::tiny() },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }
}

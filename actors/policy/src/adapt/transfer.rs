//! Cross-task expert transfer (AdaSprite §2.2, MoE merging): the experts of the tasks co-adapted
//! together act as one parallel expert set that every member routes to; this rule decides whose
//! experts a member's gradient may update. Its own always (its drift is what it adapts to); a
//! peer's only while that peer is still adapting and their drifts look alike (their uploads' pixel
//! mean and contrast within a tolerance), so an update that helps one helps the other instead of
//! pulling a peer's experts toward another weather; a finished peer's experts are read-only (they
//! went back to its camera).

/// What a member's uploads look like: the pixel mean and the mean per-image standard deviation
/// (pixels in `0..=1`), the input statistics the cameras' drift detector watches.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DriftSignature {
    /// Mean pixel value.
    pub mean: f64,
    /// Mean per-image standard deviation of the pixels.
    pub contrast: f64,
}

impl DriftSignature {
    /// The signature of `images` (`pixels` values each, in `0..=1`); zeros when there are none.
    pub fn of(images: &[f32], pixels: usize) -> Self {
        let n = images.len().checked_div(pixels).unwrap_or(0);
        if n == 0 {
            return Self { mean: 0.0, contrast: 0.0 };
        }
        let (mut mean, mut contrast) = (0.0f64, 0.0f64);
        for img in images.chunks_exact(pixels) {
            let m = img.iter().map(|&v| f64::from(v)).sum::<f64>() / pixels as f64;
            let var = img.iter().map(|&v| (f64::from(v) - m).powi(2)).sum::<f64>() / pixels as f64;
            mean += m;
            contrast += var.sqrt();
        }
        Self { mean: mean / n as f64, contrast: contrast / n as f64 }
    }

    /// Largest of the two statistics' differences (how far apart two drifts look).
    pub fn distance(&self, other: &Self) -> f64 {
        (self.mean - other.mean).abs().max((self.contrast - other.contrast).abs())
    }
}

/// Default tolerance of [`writable`]: drifts whose uploads' mean and contrast are within 0.1 of
/// each other (pixels in `0..=1`) are treated as alike.
pub const ALIKE_TOLERANCE: f64 = 0.1;

/// Which members' experts member `task` may update, one flag per member of the group (`sigs` and
/// `done` are per member, same order): its own always; a peer's when the peer is not `done` and
/// their signatures are within `tolerance`. An out-of-range `task` may update nothing.
pub fn writable(task: usize, sigs: &[DriftSignature], done: &[bool], tolerance: f64) -> Vec<bool> {
    let Some(own) = sigs.get(task) else { return vec![false; sigs.len()] };
    sigs.iter()
        .enumerate()
        .map(|(g, s)| g == task || (!done.get(g).copied().unwrap_or(true) && own.distance(s) <= tolerance))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sig(mean: f64, contrast: f64) -> DriftSignature {
        DriftSignature { mean, contrast }
    }

    #[test]
    fn own_always_alike_peers_while_adapting_never_finished_or_unlike() {
        let sigs = [sig(0.5, 0.1), sig(0.55, 0.12), sig(0.9, 0.05), sig(0.52, 0.1)];
        let done = [false, false, false, true];
        assert_eq!(writable(0, &sigs, &done, ALIKE_TOLERANCE), [true, true, false, false]);
        // The rule is about whose experts, not whether to step: a finished member no longer steps.
        assert_eq!(writable(3, &sigs, &done, ALIKE_TOLERANCE), [true, true, false, true]);
        assert_eq!(writable(2, &sigs, &done, ALIKE_TOLERANCE), [false, false, true, false]);
        // Tolerance 0: only its own.
        assert_eq!(writable(1, &sigs, &done, 0.0), [false, true, false, false]);
        assert_eq!(writable(9, &sigs, &done, 1.0), [false; 4]);
    }

    #[test]
    fn signature_by_hand() {
        // Two 2-pixel images: (0, 1) mean 0.5 std 0.5; (0.5, 0.5) mean 0.5 std 0.
        let s = DriftSignature::of(&[0.0, 1.0, 0.5, 0.5], 2);
        assert!((s.mean - 0.5).abs() < 1e-12 && (s.contrast - 0.25).abs() < 1e-12, "{s:?}");
        assert_eq!(DriftSignature::of(&[], 64), sig(0.0, 0.0));
        assert_eq!(DriftSignature::of(&[1.0], 0), sig(0.0, 0.0));
        assert!((sig(0.1, 0.2).distance(&sig(0.3, 0.25)) - 0.2).abs() < 1e-12);
    }
}

//! How a camera notices drift without labels: the mean top-1 confidence (largest softmax
//! probability) of its V-MoE over each batch of frames. The first `reference_batches` batches set
//! the baseline; drift is declared when `patience` consecutive batches fall `drop` or more below it.
//! Corruptions that hurt accuracy (fog, glare, snow) make the student unsure, so its confidence
//! falls with its accuracy; no teacher or label is needed on the camera.

/// Knobs of the detector.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DetectorConfig {
    /// Batches that set the baseline.
    pub reference_batches: usize,
    /// Confidence drop (absolute, 0..1) that counts as drift.
    pub drop: f64,
    /// Consecutive low batches needed.
    pub patience: usize,
}

impl Default for DetectorConfig {
    fn default() -> Self {
        Self { reference_batches: 2, drop: 0.08, patience: 2 }
    }
}

/// What the detector says after a batch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Verdict {
    /// Still learning the baseline.
    Calibrating,
    /// No drift.
    Stable,
    /// Drift: confidence fell from `baseline` to `now`.
    Drift {
        /// The baseline mean confidence.
        baseline: f64,
        /// The latest batch's mean confidence.
        now: f64,
    },
}

/// The detector (feed one batch mean at a time).
#[derive(Clone, Debug)]
pub struct DriftDetector {
    cfg: DetectorConfig,
    reference: Vec<f64>,
    low_run: usize,
}

impl DriftDetector {
    /// A detector with no baseline yet.
    pub fn new(cfg: DetectorConfig) -> Self {
        Self { cfg, reference: Vec::new(), low_run: 0 }
    }

    /// The baseline, once set.
    pub fn baseline(&self) -> Option<f64> {
        (self.reference.len() >= self.cfg.reference_batches.max(1))
            .then(|| self.reference.iter().sum::<f64>() / self.reference.len() as f64)
    }

    /// Feeds one batch's mean confidence.
    pub fn observe(&mut self, mean_confidence: f64) -> Verdict {
        let Some(baseline) = self.baseline() else {
            self.reference.push(mean_confidence);
            return Verdict::Calibrating;
        };
        if baseline - mean_confidence >= self.cfg.drop {
            self.low_run += 1;
        } else {
            self.low_run = 0;
        }
        if self.low_run >= self.cfg.patience.max(1) {
            Verdict::Drift { baseline, now: mean_confidence }
        } else {
            Verdict::Stable
        }
    }
}

/// Mean over rows of the largest softmax probability of `logits` (`rows x classes`).
pub fn mean_top1_confidence(logits: &[f32], classes: usize) -> f64 {
    if classes == 0 || logits.len() < classes {
        return 0.0;
    }
    let rows = logits.chunks_exact(classes);
    let n = rows.len();
    let sum: f64 = rows
        .map(|row| {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let z: f64 = row.iter().map(|&v| f64::from(v - max).exp()).sum();
            1.0 / z
        })
        .sum();
    sum / n as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn confidence_by_hand() {
        // Two classes, logits (0, 0): p = 0.5. Logits (ln 3, 0): p = 3/4. Mean 0.625.
        let c = mean_top1_confidence(&[0.0, 0.0, 3f32.ln(), 0.0], 2);
        assert!((c - 0.625).abs() < 1e-6, "{c}");
        assert_eq!(mean_top1_confidence(&[], 10), 0.0);
    }

    #[test]
    fn drift_needs_a_sustained_drop() {
        let mut d = DriftDetector::new(DetectorConfig { reference_batches: 2, drop: 0.1, patience: 2 });
        assert_eq!(d.observe(0.9), Verdict::Calibrating);
        assert_eq!(d.observe(0.8), Verdict::Calibrating);
        // Baseline 0.85: 0.76 is 0.09 below (stable); one low batch alone is not drift.
        assert_eq!(d.observe(0.76), Verdict::Stable);
        assert_eq!(d.observe(0.70), Verdict::Stable);
        assert_eq!(d.observe(0.84), Verdict::Stable, "a recovery resets the run");
        assert_eq!(d.observe(0.70), Verdict::Stable);
        match d.observe(0.60) {
            Verdict::Drift { baseline, now } => {
                assert!((baseline - 0.85).abs() < 1e-12 && now == 0.60, "{baseline} {now}")
            }
            other => panic!("expected drift, got {other:?}"),
        }
    }
}

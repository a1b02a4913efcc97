//! Online co-adaptation decisions for a camera that streams for a whole job (issue 11, item 5):
//! when a drift phase calls for an adaptation, how the detector re-arms after an update is
//! installed, which accuracy samples a bounded log keeps, and when the job that waits for every
//! camera may end (and what it still misses when it may not).
//!
//! Pure and deterministic: the camera shell feeds frame counts and confidences, the job feeds
//! what the cameras reported; nothing here reads a clock or draws a random number.

use super::drift::{DetectorConfig, DriftDetector, Verdict};

/// Knobs of the camera's online loop.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OnlineConfig {
    /// The drift detector (re-armed with the same settings after every update).
    pub detector: DetectorConfig,
    /// Most adaptations one camera asks for over its stream (bounds the edge work one camera
    /// can cause; drift past it is logged and not adapted).
    pub max_adaptations: u32,
}

/// What the camera should do after a batch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OnlineStep {
    /// Keep streaming.
    Stream,
    /// Drift: collect the frames that follow and ask the edge for adaptation `index` (0-based).
    Adapt {
        /// Which adaptation of this camera this is.
        index: u32,
        /// The baseline mean confidence the drop was measured from.
        baseline: f64,
        /// The batch's mean confidence.
        now: f64,
    },
    /// Drift, but the camera already asked for its most adaptations.
    Exhausted,
}

/// The camera's online state: watching with an armed detector, or waiting for an update.
#[derive(Clone, Debug)]
pub struct OnlineDrift {
    cfg: OnlineConfig,
    detector: DriftDetector,
    requested: u32,
    pending: bool,
    exhausted_logged: bool,
}

impl OnlineDrift {
    /// Watching, with a detector that calibrates on the first batches.
    pub fn new(cfg: OnlineConfig) -> Self {
        Self {
            cfg,
            detector: DriftDetector::new(cfg.detector),
            requested: 0,
            pending: false,
            exhausted_logged: false,
        }
    }

    /// Adaptations asked for so far.
    pub fn requested(&self) -> u32 {
        self.requested
    }

    /// Whether an adaptation was asked for and its update not yet installed (or given up).
    pub fn pending(&self) -> bool {
        self.pending
    }

    /// The armed detector's baseline, once calibrated.
    pub fn baseline(&self) -> Option<f64> {
        self.detector.baseline()
    }

    /// Feeds one batch's mean top-1 confidence. While an adaptation is pending the detector is
    /// not fed (the frames are drifted by definition and would only repeat the verdict).
    pub fn observe(&mut self, mean_confidence: f64) -> OnlineStep {
        if self.pending {
            return OnlineStep::Stream;
        }
        match self.detector.observe(mean_confidence) {
            Verdict::Calibrating | Verdict::Stable => OnlineStep::Stream,
            Verdict::Drift { baseline, now } => {
                if self.requested >= self.cfg.max_adaptations {
                    // re-arm so a long drifted phase does not report on every batch
                    self.detector = DriftDetector::new(self.cfg.detector);
                    if self.exhausted_logged {
                        return OnlineStep::Stream;
                    }
                    self.exhausted_logged = true;
                    return OnlineStep::Exhausted;
                }
                let index = self.requested;
                self.requested += 1;
                self.pending = true;
                OnlineStep::Adapt { index, baseline, now }
            }
        }
    }

    /// The update of the pending adaptation was installed (or the adaptation failed and the
    /// camera keeps its model): the detector re-arms and calibrates a fresh baseline on the
    /// model now running, under the weather now in force, so the next drift phase is measured
    /// against the adapted model rather than the original one.
    pub fn settled(&mut self) {
        self.pending = false;
        self.detector = DriftDetector::new(self.cfg.detector);
    }
}

/// A bounded log of `(frame, value)` samples over a stream of unknown length: it records every
/// `stride`-th offered sample; when full it keeps every other sample and doubles the stride, so
/// it never holds more than `cap` and always spans the whole stream evenly.
#[derive(Clone, Debug, PartialEq)]
pub struct SampleLog<T> {
    cap: usize,
    stride: u64,
    offered: u64,
    samples: Vec<(u64, T)>,
}

impl<T: Copy> SampleLog<T> {
    /// An empty log holding at most `cap` samples (at least 2).
    pub fn new(cap: usize) -> Self {
        Self { cap: cap.max(2), stride: 1, offered: 0, samples: Vec::new() }
    }

    /// Offers one sample; returns whether it was kept.
    pub fn offer(&mut self, frame: u64, value: T) -> bool {
        let keep = self.offered.is_multiple_of(self.stride);
        self.offered += 1;
        if !keep {
            return false;
        }
        if self.samples.len() >= self.cap {
            let mut i = 0;
            self.samples.retain(|_| {
                i += 1;
                (i - 1) % 2 == 0
            });
            self.stride *= 2;
            // this sample's position is a multiple of the old stride; keep it only if it is one
            // of the new stride too
            if !(self.offered - 1).is_multiple_of(self.stride) {
                return false;
            }
        }
        self.samples.push((frame, value));
        true
    }

    /// The samples kept, oldest first.
    pub fn samples(&self) -> &[(u64, T)] {
        &self.samples
    }

    /// Every how many offered samples one is kept now.
    pub fn stride(&self) -> u64 {
        self.stride
    }
}

/// What the job knows about one camera (from its latest progress report).
#[derive(Clone, Debug, PartialEq)]
pub struct CameraProgress {
    /// Camera name.
    pub name: String,
    /// Frames streamed so far.
    pub frame: u64,
    /// Its whole stream has been streamed.
    pub ended: bool,
    /// Adaptations it asked the edge for.
    pub requested: u32,
    /// Adaptations that came back (installed or failed).
    pub answered: u32,
}

/// Whether the job may end: every one of `expected` cameras has been heard from, streamed to
/// the end, and had every adaptation it asked for answered.
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    /// All done.
    pub done: bool,
    /// What is missing, one entry per camera (and one for cameras never heard from), for a
    /// timeout message.
    pub missing: Vec<String>,
}

/// Decides [`Completion`] from the cameras heard from.
pub fn completion(expected: u32, cameras: &[CameraProgress]) -> Completion {
    let mut missing = Vec::new();
    let heard = cameras.len() as u64;
    if heard < u64::from(expected) {
        missing.push(format!("{} of {expected} cameras not heard from yet", u64::from(expected) - heard));
    }
    for c in cameras {
        let outstanding = c.requested.saturating_sub(c.answered);
        match (c.ended, outstanding) {
            (true, 0) => {}
            (false, 0) => missing.push(format!("{}: stream not ended (at frame {})", c.name, c.frame)),
            (ended, n) => missing.push(format!(
                "{}: {n} of {} adaptations not back{}",
                c.name,
                c.requested,
                if ended { String::new() } else { format!(", stream at frame {}", c.frame) }
            )),
        }
    }
    Completion { done: missing.is_empty(), missing }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(max: u32) -> OnlineConfig {
        OnlineConfig {
            detector: DetectorConfig { reference_batches: 2, drop: 0.1, patience: 2 },
            max_adaptations: max,
        }
    }

    /// Feeds confidences, returning the steps that are not `Stream`.
    fn feed(o: &mut OnlineDrift, confs: &[f64]) -> Vec<OnlineStep> {
        confs.iter().map(|&c| o.observe(c)).filter(|s| *s != OnlineStep::Stream).collect()
    }

    #[test]
    fn two_drift_phases_give_two_adaptations_measured_from_the_adapted_baseline() {
        let mut o = OnlineDrift::new(cfg(8));
        // calibrate at 0.9, drift to 0.6 (two low batches)
        let steps = feed(&mut o, &[0.9, 0.9, 0.9, 0.6, 0.6]);
        assert_eq!(steps, vec![OnlineStep::Adapt { index: 0, baseline: 0.9, now: 0.6 }]);
        assert!(o.pending());
        // while pending, even lower confidences ask for nothing more
        assert!(feed(&mut o, &[0.3, 0.3, 0.3]).is_empty());
        o.settled();
        assert!(!o.pending() && o.baseline().is_none(), "re-armed: calibrating again");
        // the adapted model runs at 0.7 on the drifted weather: that is its new baseline, and
        // 0.65 (0.25 below the original 0.9, 0.05 below the new one) is no drift
        assert!(feed(&mut o, &[0.7, 0.7, 0.65, 0.65, 0.65]).is_empty());
        assert_eq!(o.baseline(), Some(0.7));
        // the second phase drops it to 0.5
        let steps = feed(&mut o, &[0.5, 0.5]);
        assert_eq!(steps, vec![OnlineStep::Adapt { index: 1, baseline: 0.7, now: 0.5 }]);
        assert_eq!(o.requested(), 2);
    }

    #[test]
    fn adaptations_are_capped_and_the_cap_is_reported_once() {
        let mut o = OnlineDrift::new(cfg(1));
        assert_eq!(feed(&mut o, &[0.9, 0.9, 0.5, 0.5]).len(), 1);
        o.settled();
        let steps = feed(&mut o, &[0.9, 0.9, 0.5, 0.5, 0.9, 0.9, 0.5, 0.5]);
        assert_eq!(steps, vec![OnlineStep::Exhausted]);
        assert_eq!(o.requested(), 1);
        assert!(!o.pending());
    }

    #[test]
    fn sample_log_stays_bounded_and_spans_the_stream() {
        let mut log = SampleLog::new(4);
        for f in 0..4 {
            assert!(log.offer(f, f as f32));
        }
        // full: the 5th sample halves the log to frames 0, 2 and doubles the stride; sample 4 is a
        // multiple of 2 and is kept
        assert!(log.offer(4, 4.0));
        assert_eq!(log.samples().iter().map(|s| s.0).collect::<Vec<_>>(), [0, 2, 4]);
        assert_eq!(log.stride(), 2);
        assert!(!log.offer(5, 5.0));
        assert!(log.offer(6, 6.0));
        for f in 7..1000 {
            log.offer(f, f as f32);
            assert!(log.samples().len() <= 4);
        }
        let frames: Vec<u64> = log.samples().iter().map(|s| s.0).collect();
        assert_eq!(frames[0], 0, "the start is always kept");
        assert!(frames.windows(2).all(|w| w[1] - w[0] == log.stride()), "evenly spaced: {frames:?}");
        assert!(*frames.last().unwrap() + 2 * log.stride() > 999, "spans the stream: {frames:?}");
    }

    fn cam(name: &str, frame: u64, ended: bool, requested: u32, answered: u32) -> CameraProgress {
        CameraProgress { name: name.into(), frame, ended, requested, answered }
    }

    #[test]
    fn the_job_ends_only_when_every_camera_ended_and_every_adaptation_came_back() {
        let c = completion(2, &[cam("a", 100, false, 1, 0)]);
        assert!(!c.done);
        assert_eq!(
            c.missing,
            ["1 of 2 cameras not heard from yet", "a: 1 of 1 adaptations not back, stream at frame 100"]
        );
        let c = completion(2, &[cam("a", 1024, true, 2, 1), cam("late", 64, false, 0, 0)]);
        assert_eq!(c.missing, ["a: 1 of 2 adaptations not back", "late: stream not ended (at frame 64)"]);
        let c = completion(2, &[cam("a", 1024, true, 2, 2), cam("late", 512, true, 1, 1)]);
        assert!(c.done && c.missing.is_empty());
        // more cameras than expected: still needs each of them done
        assert!(!completion(1, &[cam("a", 9, true, 0, 0), cam("b", 9, false, 0, 0)]).done);
    }
}

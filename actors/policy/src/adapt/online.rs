//! Online co-adaptation decisions for a camera that streams for a whole job (issue 11, item 5):
//! when a drift phase calls for an adaptation, how the detectors re-arm after an update is
//! installed, which accuracy samples a bounded log keeps, and when the job that waits for every
//! camera may end (and what it still misses when it may not).
//!
//! Drift is noticed from two label-free signals, either one enough: the student's mean top-1
//! confidence falling (the [`DriftDetector`]), and the input's statistics moving
//! ([`InputShift`]: batch pixel mean and per-image contrast). The second is needed once a camera
//! has been adapted: measured on the tiny student, a fog-adapted model's confidence stays near
//! its baseline (0.73-0.80 against 0.78) when a second phase of sun or snow drops its accuracy
//! from 0.6 to 0.2-0.35, while the input's statistics move by more than the threshold.
//!
//! Pure and deterministic: the camera shell feeds confidences and input statistics, the job
//! feeds what the cameras reported; nothing here reads a clock or draws a random number.

use std::time::Duration;

use super::drift::{DetectorConfig, DriftDetector, Verdict};

/// Knobs of the camera's online loop.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OnlineConfig {
    /// The confidence detector (re-armed with the same settings after every update); its
    /// reference batches and patience apply to the input statistics too.
    pub detector: DetectorConfig,
    /// Move of an input statistic (pixel mean or mean per-image standard deviation, pixels in
    /// `0..=1`) away from its baseline that counts as drift.
    pub shift: f64,
    /// Most adaptations one camera asks for over its stream (bounds the edge work one camera
    /// can cause; drift past it is logged and not adapted).
    pub max_adaptations: u32,
}

/// The signal that noticed a drift.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signal {
    /// The model's confidence fell.
    Confidence,
    /// The input's statistics moved.
    Input,
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
        /// Which signal noticed it.
        signal: Signal,
    },
    /// Drift, but the camera already asked for its most adaptations.
    Exhausted,
}

/// Statistics of a batch of images (`pixels` per image, values in `0..=1`) that weather moves:
/// `[mean pixel, mean per-image standard deviation]`.
pub fn input_stats(images: &[f32], pixels: usize) -> [f64; 2] {
    let rows = images.chunks_exact(pixels.max(1));
    let n = rows.len().max(1) as f64;
    let (mut mean, mut std) = (0.0, 0.0);
    for img in rows {
        let m = img.iter().map(|&v| f64::from(v)).sum::<f64>() / img.len() as f64;
        let var = img.iter().map(|&v| (f64::from(v) - m).powi(2)).sum::<f64>() / img.len() as f64;
        mean += m;
        std += var.sqrt();
    }
    [mean / n, std / n]
}

/// Notices the input's statistics moving: the first `reference_batches` batches set a baseline
/// per statistic; drift when `patience` consecutive batches have some statistic `shift` or more
/// away from it (either direction).
#[derive(Clone, Debug)]
pub struct InputShift {
    reference_batches: usize,
    patience: usize,
    shift: f64,
    reference: Vec<[f64; 2]>,
    run: usize,
}

impl InputShift {
    /// A detector with no baseline yet.
    pub fn new(reference_batches: usize, patience: usize, shift: f64) -> Self {
        Self {
            reference_batches: reference_batches.max(1),
            patience: patience.max(1),
            shift,
            reference: Vec::new(),
            run: 0,
        }
    }

    /// The baseline statistics, once set.
    pub fn baseline(&self) -> Option<[f64; 2]> {
        (self.reference.len() >= self.reference_batches).then(|| {
            let n = self.reference.len() as f64;
            let sum = self.reference.iter().fold([0.0; 2], |a, r| [a[0] + r[0], a[1] + r[1]]);
            [sum[0] / n, sum[1] / n]
        })
    }

    /// Feeds one batch's statistics; whether drift is declared.
    pub fn observe(&mut self, stats: [f64; 2]) -> bool {
        let Some(base) = self.baseline() else {
            self.reference.push(stats);
            return false;
        };
        if base.iter().zip(stats).any(|(b, s)| (s - b).abs() >= self.shift) {
            self.run += 1;
        } else {
            self.run = 0;
        }
        self.run >= self.patience
    }
}

/// The camera's online state: watching with armed detectors, or waiting for an update.
#[derive(Clone, Debug)]
pub struct OnlineDrift {
    cfg: OnlineConfig,
    confidence: DriftDetector,
    inputs: InputShift,
    requested: u32,
    pending: bool,
    exhausted_logged: bool,
}

impl OnlineDrift {
    /// Watching, with detectors that calibrate on the first batches.
    pub fn new(cfg: OnlineConfig) -> Self {
        Self {
            cfg,
            confidence: DriftDetector::new(cfg.detector),
            inputs: Self::input_detector(&cfg),
            requested: 0,
            pending: false,
            exhausted_logged: false,
        }
    }

    fn input_detector(cfg: &OnlineConfig) -> InputShift {
        InputShift::new(cfg.detector.reference_batches, cfg.detector.patience, cfg.shift)
    }

    fn rearm(&mut self) {
        self.confidence = DriftDetector::new(self.cfg.detector);
        self.inputs = Self::input_detector(&self.cfg);
    }

    /// Adaptations asked for so far.
    pub fn requested(&self) -> u32 {
        self.requested
    }

    /// Whether an adaptation was asked for and its update not yet installed (or given up).
    pub fn pending(&self) -> bool {
        self.pending
    }

    /// The armed confidence detector's baseline, once calibrated.
    pub fn baseline(&self) -> Option<f64> {
        self.confidence.baseline()
    }

    /// Feeds one batch's mean top-1 confidence and [`input_stats`]. While an adaptation is
    /// pending the detectors are not fed (the frames are drifted by definition and would only
    /// repeat the verdict).
    pub fn observe(&mut self, mean_confidence: f64, stats: [f64; 2]) -> OnlineStep {
        if self.pending {
            return OnlineStep::Stream;
        }
        let verdict = self.confidence.observe(mean_confidence);
        let shifted = self.inputs.observe(stats);
        let signal = match verdict {
            Verdict::Drift { .. } => Signal::Confidence,
            _ if shifted => Signal::Input,
            _ => return OnlineStep::Stream,
        };
        if self.requested >= self.cfg.max_adaptations {
            // re-arm so a long drifted phase does not report on every batch
            self.rearm();
            if self.exhausted_logged {
                return OnlineStep::Stream;
            }
            self.exhausted_logged = true;
            return OnlineStep::Exhausted;
        }
        let index = self.requested;
        self.requested += 1;
        self.pending = true;
        OnlineStep::Adapt { index, signal }
    }

    /// The update of the pending adaptation was installed (or the adaptation failed and the
    /// camera keeps its model): both detectors re-arm and calibrate fresh baselines on the model
    /// now running, under the weather now in force, so the next drift phase is measured against
    /// the adapted model and the current weather rather than the original ones.
    pub fn settled(&mut self) {
        self.pending = false;
        self.rearm();
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

/// Calls of one message a camera lets go unanswered within its call timeout before it gives
/// up on the edge ([`edge_asks_again_after_timeout`]); with each giving its patience for a lost
/// edge whole again, one message is asked for a bounded time.
pub const EDGE_TIMEOUTS: u32 = 3;

/// Whether a camera asks the edge again after the `timeouts`-th call of one message that got no
/// answer within the call timeout (then with its patience for a lost edge whole again: a call
/// that timed out has used it up). A timeout is not the edge lost: the request or its answer
/// may have been dropped while the edge stayed up, or the adaptation is slow; asking again is
/// answered once (the edge waits the repeat on the adaptation under way, or answers it with the
/// kept answer).
pub fn edge_asks_again_after_timeout(timeouts: u32) -> bool {
    timeouts < EDGE_TIMEOUTS
}

/// Whether a camera asks the edge again after a call lost with the edge (its node died or
/// restarted before answering), and after how long: 50 ms doubling to at most 2 s, while
/// `elapsed` since the first try is within `patience`. `None`: give up.
pub fn edge_retry(attempt: u32, elapsed: Duration, patience: Duration) -> Option<Duration> {
    if elapsed >= patience {
        return None;
    }
    let wait =
        Duration::from_millis(50u64.saturating_mul(1u64 << attempt.min(6))).min(Duration::from_secs(2));
    Some(wait.min(patience - elapsed))
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
            shift: 0.05,
            max_adaptations: max,
        }
    }

    /// Input statistics of a steady weather.
    const CLEAR: [f64; 2] = [0.3, 0.4];

    /// Feeds confidences under steady inputs, returning the steps that are not `Stream`.
    fn feed(o: &mut OnlineDrift, confs: &[f64]) -> Vec<OnlineStep> {
        confs.iter().map(|&c| o.observe(c, CLEAR)).filter(|s| *s != OnlineStep::Stream).collect()
    }

    #[test]
    fn input_stats_by_hand() {
        // image 1: all 0.5 (mean 0.5, std 0); image 2: half 0, half 1 (mean 0.5, std 0.5)
        let imgs = [0.5, 0.5, 0.5, 0.5, 0.0, 0.0, 1.0, 1.0];
        let [mean, std] = input_stats(&imgs, 4);
        assert!((mean - 0.5).abs() < 1e-12 && (std - 0.25).abs() < 1e-12, "{mean} {std}");
    }

    #[test]
    fn two_drift_phases_give_two_adaptations_measured_from_the_adapted_baseline() {
        let mut o = OnlineDrift::new(cfg(8));
        // calibrate at 0.9, drift to 0.6 (two low batches)
        let steps = feed(&mut o, &[0.9, 0.9, 0.9, 0.6, 0.6]);
        assert_eq!(steps, vec![OnlineStep::Adapt { index: 0, signal: Signal::Confidence }]);
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
        assert_eq!(steps, vec![OnlineStep::Adapt { index: 1, signal: Signal::Confidence }]);
        assert_eq!(o.requested(), 2);
    }

    #[test]
    fn a_weather_change_the_confidence_misses_is_noticed_from_the_inputs() {
        let mut o = OnlineDrift::new(cfg(8));
        let steady = |o: &mut OnlineDrift, stats: [f64; 2], n: usize| {
            (0..n).map(|_| o.observe(0.78, stats)).filter(|s| *s != OnlineStep::Stream).count()
        };
        assert_eq!(steady(&mut o, CLEAR, 6), 0);
        // confidence flat, contrast down by 0.04 (below the threshold): nothing
        assert_eq!(steady(&mut o, [0.3, 0.36], 4), 0);
        // pixel mean up by 0.2: one batch is not enough, the second is
        assert_eq!(o.observe(0.78, [0.5, 0.4]), OnlineStep::Stream);
        assert_eq!(o.observe(0.78, [0.5, 0.4]), OnlineStep::Adapt { index: 0, signal: Signal::Input });
        o.settled();
        // re-armed on the new weather: it is the baseline now
        assert_eq!(steady(&mut o, [0.5, 0.4], 6), 0);
        assert_eq!(o.observe(0.78, CLEAR), OnlineStep::Stream);
        assert_eq!(o.observe(0.78, CLEAR), OnlineStep::Adapt { index: 1, signal: Signal::Input });
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

    #[test]
    fn a_lost_edge_call_is_retried_with_growing_waits_until_the_patience_is_spent() {
        let p = Duration::from_secs(10);
        assert_eq!(edge_retry(0, Duration::ZERO, p), Some(Duration::from_millis(50)));
        assert_eq!(edge_retry(2, Duration::ZERO, p), Some(Duration::from_millis(200)));
        assert_eq!(edge_retry(40, Duration::ZERO, p), Some(Duration::from_secs(2)), "capped, no overflow");
        assert_eq!(edge_retry(40, Duration::from_millis(9_900), p), Some(Duration::from_millis(100)));
        assert_eq!(edge_retry(0, p, p), None);
        assert!(edge_asks_again_after_timeout(0) && edge_asks_again_after_timeout(EDGE_TIMEOUTS - 1));
        assert!(!edge_asks_again_after_timeout(EDGE_TIMEOUTS), "gives up after its timeouts");
    }
}

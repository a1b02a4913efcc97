//! Data drift for camera streams: weather-like corruptions of 8x8 grey images (pixels in `0..=1`) and a
//! per-camera schedule that says which corruption, how strong, from which frame on.
//!
//! Rain is Gaussian noise, sun is over-exposure (brightness), fog is blur plus haze, snow is contrast
//! loss plus white speckle. Every corruption takes a severity in `0..=1` and a seeded RNG, so a stream
//! is reproducible from its seed.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Side of the images the corruptions work on.
pub const SIDE: usize = 8;
/// Pixels per image.
pub const PIXELS: usize = SIDE * SIDE;

/// Largest schedule text accepted by [`DriftSchedule::parse`].
pub const MAX_SCHEDULE_BYTES: usize = 64 * 1024;
/// Most phases a schedule may have.
pub const MAX_PHASES: usize = 1024;

/// A schedule that cannot be parsed or used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DriftError {
    /// The schedule text is too long.
    #[error("drift schedule is {0} bytes, more than the {MAX_SCHEDULE_BYTES} accepted")]
    TooLong(usize),
    /// A line of the schedule is wrong.
    #[error("drift schedule line {line}: {detail}")]
    Line {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        detail: String,
    },
    /// The schedule as a whole is unusable.
    #[error("drift schedule: {0}")]
    Invalid(String),
}

/// A kind of corruption (the weather a camera sees).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Corruption {
    /// No corruption.
    Clean,
    /// Gaussian noise (sigma = 0.5 severity).
    Rain,
    /// Brightness: `x + 0.7 s` plus a gain, clipped (over-exposure).
    Sun,
    /// 3x3 blur mixed in by severity, then haze towards grey 0.6.
    Fog,
    /// Contrast reduced towards the image mean, then white speckle with probability 0.2 severity.
    Snow,
}

impl Corruption {
    /// All corruptions, clean first.
    pub const ALL: [Corruption; 5] =
        [Corruption::Clean, Corruption::Rain, Corruption::Sun, Corruption::Fog, Corruption::Snow];

    /// The name used in schedules.
    pub fn name(self) -> &'static str {
        match self {
            Corruption::Clean => "clean",
            Corruption::Rain => "rain",
            Corruption::Sun => "sun",
            Corruption::Fog => "fog",
            Corruption::Snow => "snow",
        }
    }

    /// The corruption called `name` (case-insensitive).
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.name().eq_ignore_ascii_case(name))
    }

    /// Corrupts `img` (pixels in `0..=1`, `PIXELS` of them) in place; results stay in `0..=1`.
    /// Severity is clamped to `0..=1`; severity 0 leaves the image unchanged.
    pub fn apply(self, img: &mut [f32], severity: f32, rng: &mut SmallRng) {
        let s = if severity.is_finite() { severity.clamp(0.0, 1.0) } else { 0.0 };
        match self {
            Corruption::Clean => {}
            Corruption::Rain => {
                let sigma = 0.5 * s;
                for v in img.iter_mut() {
                    *v += sigma * gaussian(rng);
                }
            }
            Corruption::Sun => {
                for v in img.iter_mut() {
                    *v = *v * (1.0 + 0.5 * s) + 0.7 * s;
                }
            }
            Corruption::Fog => {
                let blurred = blur3(img);
                for (v, b) in img.iter_mut().zip(blurred) {
                    let mixed = (1.0 - s) * *v + s * b;
                    *v = (1.0 - 0.6 * s) * mixed + 0.6 * s * 0.6;
                }
            }
            Corruption::Snow => {
                let mean = img.iter().sum::<f32>() / img.len().max(1) as f32;
                let keep = 1.0 - 0.7 * s;
                for v in img.iter_mut() {
                    *v = mean + (*v - mean) * keep;
                    if rng.random::<f32>() < 0.2 * s {
                        *v = 1.0;
                    }
                }
            }
        }
        for v in img.iter_mut() {
            *v = v.clamp(0.0, 1.0);
        }
    }
}

/// A standard normal sample (Box-Muller).
pub fn gaussian(rng: &mut SmallRng) -> f32 {
    let u1: f32 = rng.random::<f32>().max(f32::MIN_POSITIVE);
    let u2: f32 = rng.random();
    (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
}

/// 3x3 box blur of an 8x8 image (edges average the neighbours that exist).
fn blur3(img: &[f32]) -> Vec<f32> {
    let mut out = vec![0.0; img.len()];
    if img.len() != PIXELS {
        return img.to_vec();
    }
    for r in 0..SIDE {
        for c in 0..SIDE {
            let (mut sum, mut n) = (0.0, 0.0);
            for rr in r.saturating_sub(1)..=(r + 1).min(SIDE - 1) {
                for cc in c.saturating_sub(1)..=(c + 1).min(SIDE - 1) {
                    sum += img[rr * SIDE + cc];
                    n += 1.0;
                }
            }
            out[r * SIDE + c] = sum / n;
        }
    }
    out
}

/// From `start_frame` on, frames get `corruption` at `severity` (until the next phase).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DriftPhase {
    /// First frame of the phase.
    pub start_frame: u64,
    /// The corruption.
    pub corruption: Corruption,
    /// Its severity, `0..=1`.
    pub severity: f32,
}

/// A camera's drift over time: phases sorted by start frame, the first at frame 0.
#[derive(Clone, Debug, PartialEq)]
pub struct DriftSchedule {
    phases: Vec<DriftPhase>,
}

impl DriftSchedule {
    /// A schedule from phases; they must start at frame 0, strictly increase, and have severities in
    /// `0..=1`.
    pub fn new(phases: Vec<DriftPhase>) -> Result<Self, DriftError> {
        if phases.is_empty() || phases.len() > MAX_PHASES {
            return Err(DriftError::Invalid(format!("{} phases (need 1..={MAX_PHASES})", phases.len())));
        }
        if phases[0].start_frame != 0 {
            return Err(DriftError::Invalid(format!(
                "first phase starts at frame {}, not 0",
                phases[0].start_frame
            )));
        }
        if let Some(w) = phases.windows(2).find(|w| w[1].start_frame <= w[0].start_frame) {
            return Err(DriftError::Invalid(format!(
                "phase at frame {} does not come after frame {}",
                w[1].start_frame, w[0].start_frame
            )));
        }
        if let Some(p) = phases.iter().find(|p| !(0.0..=1.0).contains(&p.severity)) {
            return Err(DriftError::Invalid(format!(
                "severity {} at frame {} is outside 0..=1",
                p.severity, p.start_frame
            )));
        }
        Ok(Self { phases })
    }

    /// A schedule that never drifts.
    pub fn clean() -> Self {
        Self { phases: vec![DriftPhase { start_frame: 0, corruption: Corruption::Clean, severity: 0.0 }] }
    }

    /// Parses lines `start_frame corruption severity` (e.g. `200 rain 0.6`); `#` starts a comment,
    /// blank lines are skipped.
    pub fn parse(text: &str) -> Result<Self, DriftError> {
        if text.len() > MAX_SCHEDULE_BYTES {
            return Err(DriftError::TooLong(text.len()));
        }
        let mut phases = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = raw.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let bad = |detail: String| DriftError::Line { line: i + 1, detail };
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [start, name, sev] = fields[..] else {
                return Err(bad(format!(
                    "expected `start_frame corruption severity`, got {} fields",
                    fields.len()
                )));
            };
            let start_frame = start.parse::<u64>().map_err(|e| bad(format!("start frame {start:?}: {e}")))?;
            let corruption = Corruption::parse(name)
                .ok_or_else(|| bad(format!("unknown corruption {name:?} (clean, rain, sun, fog, snow)")))?;
            let severity = sev.parse::<f32>().map_err(|e| bad(format!("severity {sev:?}: {e}")))?;
            if phases.len() == MAX_PHASES {
                return Err(bad(format!("more than {MAX_PHASES} phases")));
            }
            phases.push(DriftPhase { start_frame, corruption, severity });
        }
        Self::new(phases)
    }

    /// The phases.
    pub fn phases(&self) -> &[DriftPhase] {
        &self.phases
    }

    /// The phase in force at `frame`.
    pub fn at(&self, frame: u64) -> DriftPhase {
        let i = self.phases.partition_point(|p| p.start_frame <= frame);
        self.phases[i.saturating_sub(1)]
    }
}

/// One frame of a camera stream.
#[derive(Clone, Debug, PartialEq)]
pub struct Frame {
    /// The camera.
    pub camera: u32,
    /// Frame number in the camera's stream.
    pub index: u64,
    /// Corrupted pixels in `0..=1` (`PIXELS` of them, row-major).
    pub image: Vec<f32>,
    /// The true label of the underlying image.
    pub label: usize,
    /// The corruption applied.
    pub corruption: Corruption,
    /// Its severity.
    pub severity: f32,
}

/// A camera's endless stream of frames: images drawn (seeded) from a source set, corrupted by the
/// schedule's phase at each frame.
#[derive(Clone, Debug)]
pub struct CameraStream<'a> {
    camera: u32,
    schedule: DriftSchedule,
    images: &'a [f32],
    labels: &'a [usize],
    rng: SmallRng,
    next: u64,
}

impl<'a> CameraStream<'a> {
    /// A stream over `images` (`labels.len()` images of `PIXELS` pixels in `0..=1`).
    pub fn new(
        camera: u32,
        schedule: DriftSchedule,
        images: &'a [f32],
        labels: &'a [usize],
        seed: u64,
    ) -> Result<Self, DriftError> {
        if labels.is_empty() || images.len() != labels.len() * PIXELS {
            return Err(DriftError::Invalid(format!(
                "{} pixels for {} labels (need {PIXELS} per image, at least one image)",
                images.len(),
                labels.len()
            )));
        }
        Ok(Self {
            camera,
            schedule,
            images,
            labels,
            rng: SmallRng::seed_from_u64(seed ^ (u64::from(camera) << 32)),
            next: 0,
        })
    }

    /// Skips ahead to frame `frame` (the next frame returned has this index).
    pub fn seek(&mut self, frame: u64) {
        self.next = frame;
    }

    /// The schedule.
    pub fn schedule(&self) -> &DriftSchedule {
        &self.schedule
    }
}

impl Iterator for CameraStream<'_> {
    type Item = Frame;

    fn next(&mut self) -> Option<Frame> {
        let idx = self.rng.random_range(0..self.labels.len());
        let phase = self.schedule.at(self.next);
        let mut image = self.images[idx * PIXELS..(idx + 1) * PIXELS].to_vec();
        phase.corruption.apply(&mut image, phase.severity, &mut self.rng);
        let frame = Frame {
            camera: self.camera,
            index: self.next,
            image,
            label: self.labels[idx],
            corruption: phase.corruption,
            severity: phase.severity,
        };
        self.next += 1;
        Some(frame)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digit_like() -> Vec<f32> {
        (0..PIXELS).map(|i| if (i % SIDE) == 3 || (i % SIDE) == 4 { 1.0 } else { 0.0 }).collect()
    }

    #[test]
    fn corruptions_by_hand() {
        let mut rng = SmallRng::seed_from_u64(1);
        let base = digit_like();
        for c in Corruption::ALL {
            let mut img = base.clone();
            c.apply(&mut img, 0.0, &mut rng);
            assert_eq!(img, base, "{c:?} at severity 0 changes nothing");
        }
        // Sun at 1: 0 -> 0.7, 1 -> 1.5 + 0.7 clipped to 1.
        let mut img = base.clone();
        Corruption::Sun.apply(&mut img, 1.0, &mut rng);
        assert!((img[0] - 0.7).abs() < 1e-6 && img[3] == 1.0);
        // Fog at 1: pixel (0,0) blurs over a 2x2 window with no ink -> 0, haze -> 0.4 * 0 + 0.36.
        let mut img = base.clone();
        Corruption::Fog.apply(&mut img, 1.0, &mut rng);
        assert!((img[0] - 0.36).abs() < 1e-6, "{}", img[0]);
        // Pixel (0,3): window cols 2..=4 rows 0..=1 has 4 ink of 6 -> 2/3; 0.4 * 2/3 + 0.36.
        assert!((img[3] - (0.4 * 2.0 / 3.0 + 0.36)).abs() < 1e-6);
        // Rain: noise with sigma 0.5 at severity 1 changes most pixels; values stay in 0..=1.
        let mut img = base.clone();
        Corruption::Rain.apply(&mut img, 1.0, &mut rng);
        let changed = img.iter().zip(&base).filter(|(a, b)| a != b).count();
        assert!(changed > PIXELS / 2, "{changed}");
        assert!(img.iter().all(|v| (0.0..=1.0).contains(v)));
        // Snow at 1 without speckle pulls towards the mean 0.25 by 0.3: ink 1 -> 0.475.
        let mut img = base.clone();
        Corruption::Snow.apply(&mut img, 1.0, &mut rng);
        assert!(img.iter().all(|&v| v == 1.0 || (v - 0.475).abs() < 1e-6 || (v - 0.175).abs() < 1e-6));
    }

    #[test]
    fn schedule_parses_and_rejects() {
        let s = DriftSchedule::parse("# camera 0\n0 clean 0\n100 rain 0.6\n\n250 fog 1.0 # heavy\n").unwrap();
        assert_eq!(s.phases().len(), 3);
        assert_eq!(s.at(0).corruption, Corruption::Clean);
        assert_eq!(s.at(99).corruption, Corruption::Clean);
        assert_eq!(s.at(100).corruption, Corruption::Rain);
        assert_eq!(s.at(249).severity, 0.6);
        assert_eq!(s.at(10_000).corruption, Corruption::Fog);
        let err = |t: &str| DriftSchedule::parse(t).unwrap_err().to_string();
        assert!(err("0 hail 0.5").contains("line 1: unknown corruption"));
        assert!(err("0 clean 0\n5 rain 2.0").contains("outside 0..=1"));
        assert!(err("0 clean 0\n5 rain").contains("line 2"));
        assert!(err("3 rain 0.1").contains("not 0"));
        assert!(err("0 rain 0.1\n0 sun 0.1").contains("does not come after"));
        assert!(err("").contains("0 phases"));
        assert!(matches!(
            DriftSchedule::parse(&"#".repeat(MAX_SCHEDULE_BYTES + 1)),
            Err(DriftError::TooLong(_))
        ));
    }

    #[test]
    fn stream_follows_the_schedule_and_is_seeded() {
        let images: Vec<f32> = (0..3).flat_map(|_| digit_like()).collect();
        let labels = vec![1, 2, 3];
        let sched = DriftSchedule::parse("0 clean 0\n5 sun 1.0").unwrap();
        let a: Vec<Frame> =
            CameraStream::new(7, sched.clone(), &images, &labels, 9).unwrap().take(10).collect();
        let b: Vec<Frame> = CameraStream::new(7, sched, &images, &labels, 9).unwrap().take(10).collect();
        assert_eq!(a, b);
        assert!(a[..5].iter().all(|f| f.corruption == Corruption::Clean && f.image == digit_like()));
        assert!(a[5..].iter().all(|f| f.corruption == Corruption::Sun && (f.image[0] - 0.7).abs() < 1e-6));
        assert_eq!(a[9].index, 9);
        assert!(CameraStream::new(0, DriftSchedule::clean(), &images[..10], &labels, 0).is_err());
    }
}

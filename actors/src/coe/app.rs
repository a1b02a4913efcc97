//! The CoE application generator (`troupe coe gen`): real ONNX experts on disk, a manifest,
//! and a request trace whose selections come from running the experts.
//!
//! Experts are MLPs on 8x8 digit images (64 inputs in 0..1), **trained** in Rust
//! ([`troupe_kernels::mlp`]: minibatch AdamW on softmax cross-entropy, seeded) and written with
//! [`troupe_kernels::onnx::writer`]. The digits are split by the seed ([`super::train::split`])
//! into train (60%), calibration and test (20% each). Each entry expert covers the ten classes
//! and deals them into one coarse group per subsequent expert; a preliminary is trained to name
//! the group of a digit (its softmax argmax, plus a close runner-up, picks which subsequent
//! experts run), a leaf is trained on its group's images plus twice as many others and outputs
//! the [`DIGIT_CLASSES`] digit classes. The CoE's answer is the reached leaves' outputs weighted
//! by their routing probabilities. Hidden widths are chosen so each ONNX file hits the size
//! drawn by the policy crate's synthetic model (log-uniform 1-40 MB at paper scale).
//!
//! Generation runs every trained expert, in dependency order, on the calibration and test
//! images that reach it: the usage probabilities written into the model come from the
//! calibration walks, the trace's requests draw their images from the test split and carry the
//! selections the real experts make, and `accuracy.txt` ([`super::accuracy`]) records the CoE's
//! test accuracy beside a single MLP of the same total bytes trained on the same rows with the
//! same optimiser, epochs and learning rate ([`TrainPlan`]).
//!
//! Layout of an app folder: `app.txt` (manifest), `accuracy.txt`, `trace.txt` (the policy crate's trace format,
//! whose `input` field is a digit image index), `store/e<id>.blob` (the weight store's blob files),
//! and the same app as a user would write it: `app.toml` ([`super::appfile`]) naming
//! `experts/e<id>.onnx` (the ONNX files again), for `troupe coe serve --app`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use troupe_kernels::Device;
use troupe_kernels::WeightStore;
use troupe_kernels::assets::{Assets, Digits};
use troupe_kernels::mlp;
use troupe_kernels::onnx::writer::mlp_model;
use troupe_kernels::onnx::{NamedTensor, OnnxSession, SessionConfig};
use troupe_policy::Micros;
use troupe_policy::coe::sweep::{self, Arrivals, KnobError};
use troupe_policy::coe::synth::{ModelConfig, synthetic_model};
use troupe_policy::coe::{CoeModel, ExpertId, ExpertSpec, RequestId, Tier, Trace, TraceRequest};

use super::CoeError;
use super::accuracy::{ACCURACY_FILE, Accuracy};
use super::appfile::{AppFile, Memory};
use super::train::{self, DIGIT_CLASSES};

/// Input width: an 8x8 image.
pub const INPUT_WIDTH: usize = 64;
/// A runner-up child is selected too when its probability is at least this share of the best.
pub const RUNNER_UP_SHARE: f32 = 0.9;
/// Name of the graph input.
pub const INPUT_NAME: &str = "x";
/// Name of the graph output.
pub const OUTPUT_NAME: &str = "probs";
/// First line of a manifest.
pub const MANIFEST_FORMAT: &str = "format troupe-coe-app 1";

/// Version of what `coe gen` trains: bumped whenever one seed starts giving other experts (the
/// class grouping, the training rows, the plan), so an app made by an older troupe is known as
/// one and its accuracy is not reported as this version's. 1: grouping by class affinity.
pub const GENERATOR: u32 = 1;
/// Name of the app file gen writes (see [`super::appfile`]).
pub const APP_FILE: &str = "app.toml";
/// Salt of the single-model baseline's random streams (initial weights, shuffles).
const SINGLE_MODEL_SALT: u64 = 0x0516_1e00_ba5e_0001;
/// Largest manifest accepted, bytes.
const MAX_MANIFEST_BYTES: u64 = 1 << 20;
/// Largest trace accepted, bytes.
pub(crate) const MAX_TRACE_BYTES: u64 = 256 << 20;
/// Widest layer accepted in a manifest.
const MAX_WIDTH: usize = 1 << 16;

/// Which size of application to generate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scale {
    /// Runs in seconds: ~35 experts of 64 KB - 2 MB, about 20 MB in all.
    Ci,
    /// The paper's shape: ~300 experts of 1-40 MB, several GB in all.
    Paper,
}

/// Everything that follows from the scale.
#[derive(Clone, Debug, PartialEq)]
pub struct ScaleConfig {
    /// The scale.
    pub scale: Scale,
    /// Shape and sizes of the expert graph.
    pub model: ModelConfig,
    /// Requests in the trace.
    pub requests: usize,
    /// Digit images requests draw from (the first N of the test split).
    pub image_pool: usize,
    /// How the experts and the single-model baseline are trained.
    pub train: TrainPlan,
    /// Mean gap between arrival events.
    pub mean_gap: Micros,
    /// Probability an arrival event is a burst.
    pub burst_prob: f64,
    /// Largest burst.
    pub burst_max: usize,
    /// Expert memory of the GPU(-stand-in) executor, bytes.
    pub gpu_expert_bytes: u64,
    /// Expert memory of the CPU executor, bytes.
    pub cpu_expert_bytes: u64,
}

impl Scale {
    /// Parse `ci` or `paper`.
    pub fn from_name(name: &str) -> Option<Scale> {
        match name {
            "ci" => Some(Scale::Ci),
            "paper" => Some(Scale::Paper),
            _ => None,
        }
    }

    /// `ci` or `paper`.
    pub fn name(self) -> &'static str {
        match self {
            Scale::Ci => "ci",
            Scale::Paper => "paper",
        }
    }

    /// Default folder of this scale's app: `.cache/coe/<scale>`.
    pub fn default_dir(self) -> PathBuf {
        PathBuf::from(".cache/coe").join(self.name())
    }

    /// The configuration of this scale.
    pub fn config(self) -> ScaleConfig {
        match self {
            Scale::Ci => ScaleConfig {
                scale: self,
                model: ModelConfig {
                    roots: 4,
                    children_per_root: 4,
                    branching_share: 0.5,
                    grandchildren: 2,
                    min_bytes: 64 << 10,
                    max_bytes: 2 << 20,
                    zipf: 1.0,
                    mean_selected: 1.2,
                    host_bytes: 4 << 20,
                },
                requests: 300,
                image_pool: 256,
                train: TrainPlan {
                    epochs: 4,
                    batch: 32,
                    lr: 1e-3,
                    max_rows: usize::MAX,
                    baseline_max_bytes: 256 << 20,
                },
                mean_gap: Micros(500),
                burst_prob: 0.2,
                burst_max: 16,
                gpu_expert_bytes: 4 << 20,
                cpu_expert_bytes: 6 << 20,
            },
            Scale::Paper => ScaleConfig {
                scale: self,
                model: ModelConfig::paper_like(),
                requests: 20_000,
                image_pool: 256,
                // Several GB of experts: one pass over a few rows each, and no single model of
                // that size (over the baseline cap), so generation stays within minutes.
                train: TrainPlan {
                    epochs: 1,
                    batch: 64,
                    lr: 1e-3,
                    max_rows: 256,
                    baseline_max_bytes: 256 << 20,
                },
                mean_gap: Micros(1_000),
                burst_prob: 0.2,
                burst_max: 32,
                gpu_expert_bytes: 256 << 20,
                cpu_expert_bytes: 512 << 20,
            },
        }
    }
}

/// How generation trains: the same optimiser (AdamW), passes and batch for every expert and for
/// the single-model baseline.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TrainPlan {
    /// Passes over the single model's training rows. Every expert trains on as many samples
    /// (`epochs` x the train rows, capped at `max_rows`): one on fewer rows makes more passes,
    /// never fewer than `epochs`, so the CoE's training compute (bytes x samples, summed) is
    /// the same-bytes baseline's.
    pub epochs: usize,
    /// Rows per step.
    pub batch: usize,
    /// AdamW learning rate.
    pub lr: f32,
    /// At most this many training rows per model (bounds training time at paper scale).
    pub max_rows: usize,
    /// No single-model baseline is trained past this many bytes (its accuracy is then NaN).
    pub baseline_max_bytes: u64,
}

/// Knobs of `coe gen` over the scale's defaults (`None` keeps the scale's value).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GenKnobs {
    /// Device (GPU-executor) expert memory, as a fraction of all expert bytes, in (0, 1]. The
    /// CPU executor gets the scale's CPU : GPU ratio of it.
    pub device_budget: Option<f64>,
    /// Bytes of the most used experts homed in host memory, as a fraction of all expert bytes.
    pub host_budget: Option<f64>,
    /// Zipf skew of the mix over entry experts.
    pub zipf: Option<f64>,
    /// Mean arrival rate, requests per second (bursty Poisson).
    pub rate_rps: Option<f64>,
    /// About this many experts (the number of entry experts is scaled to it).
    pub experts: Option<usize>,
    /// Smallest expert, bytes.
    pub min_bytes: Option<u64>,
    /// Largest expert, bytes.
    pub max_bytes: Option<u64>,
    /// Skip training the single-model baseline (its accuracy is then NaN): it costs as much
    /// training as all the experts together, and tests that only serve the app need not pay it.
    pub skip_single_model: bool,
}

impl GenKnobs {
    /// Check every knob given.
    pub fn validate(&self) -> Result<(), KnobError> {
        if let Some(b) = self.device_budget {
            sweep::check_fraction("device_budget", b)?;
        }
        if let Some(b) = self.host_budget {
            sweep::check_fraction("host_budget", b)?;
        }
        if let Some(z) = self.zipf {
            sweep::check_skew(z)?;
        }
        if let Some(r) = self.rate_rps {
            sweep::check_rate(r)?;
        }
        if let Some(n) = self.experts
            && n == 0
        {
            return Err(KnobError::Range { name: "experts", value: 0.0, problem: "must be at least 1" });
        }
        match (self.min_bytes, self.max_bytes) {
            (Some(0), _) | (_, Some(0)) => {
                Err(KnobError::Range { name: "min_bytes", value: 0.0, problem: "sizes must be >= 1 byte" })
            }
            (Some(lo), Some(hi)) if lo > hi => Err(KnobError::Range {
                name: "min_bytes",
                value: lo as f64,
                problem: "must not exceed max_bytes",
            }),
            _ => Ok(()),
        }
    }
}

/// The knobs an app was generated with, resolved (recorded in its manifest's `knobs` line).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Knobs {
    /// Device expert memory over all expert bytes (raised to hold the largest expert).
    pub device_budget: f64,
    /// Host-homed bytes over all expert bytes.
    pub host_budget: f64,
    /// Zipf skew of the root mix.
    pub zipf: f64,
    /// Mean arrival rate, requests/s.
    pub rate_rps: f64,
    /// Experts generated.
    pub experts: usize,
    /// Smallest expert asked for, bytes.
    pub min_bytes: u64,
    /// Largest expert asked for, bytes.
    pub max_bytes: u64,
    /// Expert memory of the GPU(-stand-in) executor, bytes.
    pub gpu_expert_bytes: u64,
    /// Expert memory of the CPU executor, bytes.
    pub cpu_expert_bytes: u64,
}

impl Knobs {
    /// The `knobs ...` line (without newline).
    pub fn to_line(&self) -> String {
        format!(
            "knobs device_budget {} host_budget {} zipf {} rate_rps {} experts {} min_bytes {} max_bytes {} gpu_expert_bytes {} cpu_expert_bytes {}",
            self.device_budget,
            self.host_budget,
            self.zipf,
            self.rate_rps,
            self.experts,
            self.min_bytes,
            self.max_bytes,
            self.gpu_expert_bytes,
            self.cpu_expert_bytes
        )
    }

    fn parse(tokens: &[&str]) -> Result<Knobs, String> {
        let pairs: BTreeMap<&str, &str> = tokens.chunks(2).filter_map(|c| Some((c[0], *c.get(1)?))).collect();
        if tokens.len() != 18 || pairs.len() != 9 {
            return Err("expected nine `name value` pairs after `knobs`".into());
        }
        fn get<T: std::str::FromStr>(pairs: &BTreeMap<&str, &str>, k: &str) -> Result<T, String> {
            pairs.get(k).ok_or(format!("no `{k}`"))?.parse().map_err(|_| format!("bad `{k}`"))
        }
        let k = Knobs {
            device_budget: get(&pairs, "device_budget")?,
            host_budget: get(&pairs, "host_budget")?,
            zipf: get(&pairs, "zipf")?,
            rate_rps: get(&pairs, "rate_rps")?,
            experts: get(&pairs, "experts")?,
            min_bytes: get(&pairs, "min_bytes")?,
            max_bytes: get(&pairs, "max_bytes")?,
            gpu_expert_bytes: get(&pairs, "gpu_expert_bytes")?,
            cpu_expert_bytes: get(&pairs, "cpu_expert_bytes")?,
        };
        sweep::check_fraction("device_budget", k.device_budget).map_err(|e| e.to_string())?;
        if !(k.host_budget.is_finite() && (0.0..=1.0).contains(&k.host_budget)) {
            return Err(format!("host_budget {} is not in [0, 1]", k.host_budget));
        }
        sweep::check_skew(k.zipf).map_err(|e| e.to_string())?;
        sweep::check_rate(k.rate_rps).map_err(|e| e.to_string())?;
        Ok(k)
    }
}

impl ScaleConfig {
    /// This scale's configuration with `knobs` applied (all but the budgets, which need the
    /// generated experts' sizes).
    pub fn with_knobs(mut self, knobs: &GenKnobs) -> ScaleConfig {
        if let Some(z) = knobs.zipf {
            self.model.zipf = z;
        }
        if let Some(r) = knobs.rate_rps {
            self.mean_gap =
                Arrivals { rate_rps: r, burst_prob: self.burst_prob, burst_max: self.burst_max }.mean_gap();
        }
        if let Some(lo) = knobs.min_bytes {
            self.model.min_bytes = lo;
        }
        if let Some(hi) = knobs.max_bytes {
            self.model.max_bytes = hi;
        }
        if let Some(n) = knobs.experts {
            let m = &self.model;
            let c = m.children_per_root as f64;
            let per_root = 1.0 + c + c * m.branching_share * m.grandchildren as f64;
            self.model.roots = ((n as f64 / per_root).round() as usize).max(1);
        }
        self
    }

    /// The mean arrival rate of this configuration, requests/s.
    pub fn rate_rps(&self) -> f64 {
        Arrivals::rate_of_gap(self.mean_gap, self.burst_prob, self.burst_max)
    }
}

/// One expert's file as the manifest records it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertFile {
    /// The expert.
    pub id: ExpertId,
    /// Layer widths, input first (e.g. `64,480,480,4`).
    pub widths: Vec<usize>,
    /// Blob id in the store (`e<id>`).
    pub blob: String,
}

/// The manifest: scale, seed and the experts' files.
#[derive(Clone, Debug, PartialEq)]
pub struct Manifest {
    /// The scale it was generated at.
    pub scale: Scale,
    /// The seed of the generator.
    pub seed: u64,
    /// The knobs it was generated with (absent in apps generated before knobs existed).
    pub knobs: Option<Knobs>,
    /// The [`GENERATOR`] that made it (absent in apps from an app file, or generated before
    /// versions were recorded).
    pub generator: Option<u32>,
    /// One entry per expert, in id order.
    pub experts: Vec<ExpertFile>,
}

impl Manifest {
    /// Text form (`format` line, `scale`, `seed`, `generator`, `knobs`, one
    /// `expert <id> widths <w,..> blob <id>` each).
    pub fn to_text(&self) -> String {
        let mut out = format!("{MANIFEST_FORMAT}\nscale {}\nseed {}\n", self.scale.name(), self.seed);
        if let Some(g) = self.generator {
            let _ = writeln!(out, "generator {g}");
        }
        if let Some(k) = &self.knobs {
            out.push_str(&k.to_line());
            out.push('\n');
        }
        for e in &self.experts {
            let widths: Vec<String> = e.widths.iter().map(usize::to_string).collect();
            let _ = writeln!(out, "expert {} widths {} blob {}", e.id.0, widths.join(","), e.blob);
        }
        out
    }

    /// Parse a manifest (untrusted: every line checked, errors name the line).
    pub fn parse(text: &str, origin: &Path) -> Result<Manifest, CoeError> {
        let bad = |line: usize, problem: String| CoeError::BadFile {
            path: origin.to_path_buf(),
            problem: format!("line {line}: {problem}"),
        };
        let mut lines =
            text.lines().enumerate().map(|(i, l)| (i + 1, l.trim())).filter(|(_, l)| !l.is_empty());
        match lines.next() {
            Some((_, l)) if l == MANIFEST_FORMAT => {}
            _ => return Err(bad(1, format!("expected `{MANIFEST_FORMAT}`"))),
        }
        let (mut scale, mut seed, mut knobs, mut generator, mut experts) =
            (None, None, None, None, Vec::new());
        for (n, line) in lines {
            let t: Vec<&str> = line.split_whitespace().collect();
            match t.as_slice() {
                ["scale", s] => {
                    scale = Some(Scale::from_name(s).ok_or_else(|| bad(n, format!("unknown scale `{s}`")))?)
                }
                ["seed", s] => seed = Some(s.parse::<u64>().map_err(|_| bad(n, format!("bad seed `{s}`")))?),
                ["knobs", rest @ ..] => knobs = Some(Knobs::parse(rest).map_err(|p| bad(n, p))?),
                ["generator", g] => {
                    generator = Some(g.parse::<u32>().map_err(|_| bad(n, format!("bad generator `{g}`")))?)
                }
                ["expert", id, "widths", w, "blob", blob] => {
                    let id: u32 = id.parse().map_err(|_| bad(n, format!("bad expert id `{id}`")))?;
                    if id as usize != experts.len() {
                        return Err(bad(
                            n,
                            format!("expert id {id} out of order (expected {})", experts.len()),
                        ));
                    }
                    let widths = w
                        .split(',')
                        .map(|x| x.parse::<usize>().ok().filter(|&v| (1..=MAX_WIDTH).contains(&v)))
                        .collect::<Option<Vec<usize>>>()
                        .filter(|v| v.len() >= 2 && v[0] == INPUT_WIDTH)
                        .ok_or_else(|| bad(n, format!("bad widths `{w}`")))?;
                    experts.push(ExpertFile { id: ExpertId(id), widths, blob: (*blob).to_string() });
                }
                _ => return Err(bad(n, format!("unrecognised line `{line}`"))),
            }
        }
        Ok(Manifest {
            scale: scale.ok_or_else(|| bad(0, "no `scale` line".into()))?,
            seed: seed.ok_or_else(|| bad(0, "no `seed` line".into()))?,
            knobs,
            generator,
            experts,
        })
    }
}

/// A generated application, opened for serving: manifest, trace, digit images.
#[derive(Debug)]
pub struct App {
    /// The app folder.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
    /// Its trace (the model with pre-assessed probabilities, and the requests).
    pub trace: Trace,
    /// The digit images requests refer to.
    pub digits: Digits,
    /// Per expert: the outputs scoring its children, in the model's children order
    /// (`0..k` for a generated app; what the app file's edges say for `serve --app`).
    pub routes: Vec<Vec<usize>>,
}

/// Read a file with a size cap, naming it on error.
pub fn read_capped(path: &Path, cap: u64) -> Result<String, CoeError> {
    let meta = std::fs::metadata(path).map_err(|e| CoeError::io("reading", path, e))?;
    if meta.len() > cap {
        return Err(CoeError::BadFile {
            path: path.to_path_buf(),
            problem: format!("{} bytes, over the cap of {cap}", meta.len()),
        });
    }
    std::fs::read_to_string(path).map_err(|e| CoeError::io("reading", path, e))
}

impl App {
    /// Open the app in `dir`, reading its trace from `trace` (default `dir/trace.txt`).
    pub fn open(dir: &Path, trace: Option<&Path>) -> Result<App, CoeError> {
        let manifest_path = dir.join("app.txt");
        if !manifest_path.is_file() {
            return Err(CoeError::BadFile {
                path: manifest_path,
                problem: "missing; run `troupe coe gen` first".into(),
            });
        }
        let manifest = Manifest::parse(&read_capped(&manifest_path, MAX_MANIFEST_BYTES)?, &manifest_path)?;
        let trace_path = trace.map_or_else(|| dir.join("trace.txt"), Path::to_path_buf);
        let trace = Trace::parse(&read_capped(&trace_path, MAX_TRACE_BYTES)?)
            .map_err(|e| CoeError::BadFile { path: trace_path.clone(), problem: e.to_string() })?;
        if trace.model.len() != manifest.experts.len() {
            return Err(CoeError::BadFile {
                path: trace_path,
                problem: format!("{} experts, the app has {}", trace.model.len(), manifest.experts.len()),
            });
        }
        let digits = Assets::locate()?.digits()?;
        if let Some(r) = trace.requests.iter().find(|r| r.input as usize >= digits.len()) {
            return Err(CoeError::BadFile {
                path: trace_path,
                problem: format!(
                    "request {} names image {}, the data set has {}",
                    r.id,
                    r.input,
                    digits.len()
                ),
            });
        }
        let routes = trace.model.experts().iter().map(|e| (0..e.children.len()).collect()).collect();
        Ok(App { dir: dir.to_path_buf(), manifest, trace, digits, routes })
    }

    /// The store folder.
    pub fn store_dir(&self) -> PathBuf {
        self.dir.join("store")
    }

    /// The scores of `expert`'s children (model order) in its output row `probs`.
    pub fn child_scores(&self, expert: ExpertId, probs: &[f32]) -> Vec<f32> {
        route_scores(probs, self.routes.get(expert.index()).map_or(&[][..], Vec::as_slice))
    }

    /// Digit image `image` (a request's input) as 64 floats in 0..1.
    pub fn input(&self, image: u64) -> Vec<f32> {
        image_floats(&self.digits, image as usize)
    }
}

/// Image `i` as 64 floats in 0..1 (zeros past the end).
pub fn image_floats(digits: &Digits, i: usize) -> Vec<f32> {
    digits.image(i).map_or_else(
        || vec![0.0; INPUT_WIDTH],
        |px| px.iter().map(|&p| f32::from(p) / f32::from(Digits::MAX_PIXEL)).collect(),
    )
}

/// `row[route[i]]` for each `i`, stopping at the first output `row` lacks.
pub fn route_scores(row: &[f32], route: &[usize]) -> Vec<f32> {
    route.iter().map_while(|&o| row.get(o).copied()).collect()
}

/// Which children a preliminary's output selects: the argmax, plus the runner-up when its
/// probability is at least [`RUNNER_UP_SHARE`] of the best. `probs[i]` scores `children[i]`.
pub fn select_children(probs: &[f32], children: &[ExpertId]) -> Vec<ExpertId> {
    let mut order: Vec<usize> = (0..probs.len().min(children.len())).collect();
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
    let mut out = Vec::new();
    if let Some(&best) = order.first() {
        out.push(children[best]);
        if let Some(&second) = order.get(1)
            && probs[second] >= RUNNER_UP_SHARE * probs[best]
        {
            out.push(children[second]);
        }
    }
    out
}

/// One expert output quantised for comparison across batch sizes (1e-4 steps).
pub fn quantise(probs: &[f32]) -> Vec<i32> {
    probs.iter().map(|p| (p * 10_000.0).round() as i32).collect()
}

/// Digest of a request's outputs: its (expert, quantised output) pairs in expert order.
pub fn output_digest(outputs: &BTreeMap<ExpertId, Vec<i32>>) -> u64 {
    let mut h = blake3::Hasher::new();
    for (e, q) in outputs {
        h.update(&e.0.to_le_bytes());
        for v in q {
            h.update(&v.to_le_bytes());
        }
    }
    let mut eight = [0u8; 8];
    eight.copy_from_slice(&h.finalize().as_bytes()[..8]);
    u64::from_le_bytes(eight)
}

/// Hidden width `h` so that a 64 -> h -> h -> `outputs` MLP has about `bytes` of f32 parameters.
pub fn hidden_width(bytes: u64, outputs: usize) -> usize {
    let target = (bytes / 4) as f64;
    let b = (INPUT_WIDTH + 2 + outputs) as f64;
    let h = (-b + (b * b + 4.0 * target).sqrt()) / 2.0;
    (h.floor() as usize).max(4)
}

/// Per (root, image) walk: the selections each reached preliminary made, in walk order.
pub(crate) type Walks = BTreeMap<(ExpertId, usize), Vec<(ExpertId, Vec<ExpertId>)>>;

/// What generation produced.
#[derive(Clone, Debug, PartialEq)]
pub struct GenReport {
    /// Experts written.
    pub experts: usize,
    /// Bytes of ONNX files in all.
    pub total_bytes: u64,
    /// Smallest and largest expert file.
    pub min_bytes: u64,
    /// Largest expert file.
    pub max_bytes: u64,
    /// Depth of the dependency graph.
    pub depth: u32,
    /// Requests in the trace.
    pub requests: usize,
    /// The trained CoE's and the same-bytes single model's accuracies (also in `accuracy.txt`).
    pub accuracy: Accuracy,
    /// Seconds the generation took.
    pub seconds: f64,
}

/// Generate the app of `scale` into `dir` with `seed` (replacing what is there).
pub fn generate(dir: &Path, scale: Scale, seed: u64) -> Result<GenReport, CoeError> {
    generate_with(dir, scale, seed, &GenKnobs::default())
}

/// One walk reaching an expert: its entry expert, the image, and the product of the routing
/// probabilities along the way.
type Reach = (ExpertId, usize, f32);

/// Run `session` (`outputs` wide) on the images of `walks`, 256 rows a run; the output rows.
fn run_rows(
    session: &mut OnnxSession,
    images: &[Vec<f32>],
    walks: &[usize],
    outputs: usize,
    name: &str,
) -> Result<Vec<f32>, CoeError> {
    let mut rows = Vec::with_capacity(walks.len() * outputs);
    for chunk in walks.chunks(256) {
        let mut x = Vec::with_capacity(chunk.len() * INPUT_WIDTH);
        for &img in chunk {
            x.extend_from_slice(&images[img]);
        }
        let out = session.run(&[NamedTensor::f32(INPUT_NAME, vec![chunk.len(), INPUT_WIDTH], x)])?;
        let probs = out
            .first()
            .and_then(NamedTensor::as_f32)
            .filter(|p| p.len() == chunk.len() * outputs)
            .ok_or_else(|| CoeError::Invalid(format!("{name}: no f32 output of width {outputs}")))?;
        rows.extend_from_slice(probs);
    }
    Ok(rows)
}

/// Train an MLP of `widths` from `rng`'s Glorot draw on the images `rows` against `targets`
/// for about `samples` samples (whole passes, at least the plan's epochs), and serialise it as
/// ONNX.
#[allow(clippy::too_many_arguments)]
fn trained_onnx(
    widths: &[usize],
    images: &[Vec<f32>],
    rows: &[usize],
    targets: &[usize],
    samples: usize,
    plan: &TrainPlan,
    seed: u64,
    rng: &mut SmallRng,
) -> Result<Vec<u8>, CoeError> {
    let mut layers = mlp::glorot_layers(widths, rng);
    if !rows.is_empty() {
        let x: Vec<f32> = rows.iter().flat_map(|&i| images[i].iter().copied()).collect();
        let epochs = samples.div_ceil(rows.len()).max(plan.epochs);
        let cfg = mlp::TrainConfig { epochs, batch: plan.batch, lr: plan.lr, seed };
        mlp::train(&mut layers, &x, targets, &cfg)?;
    }
    mlp_model(&layers, INPUT_NAME, OUTPUT_NAME).map_err(|err| CoeError::Invalid(err.to_string()))
}

/// Index of the largest value (the first on ties); 0 for an empty row.
fn argmax(row: &[f32]) -> usize {
    row.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0
}

/// Generate the app of `scale` with `knobs` applied into `dir` with `seed` (replacing what is
/// there); the manifest records the resolved knobs.
pub fn generate_with(dir: &Path, scale: Scale, seed: u64, knobs: &GenKnobs) -> Result<GenReport, CoeError> {
    knobs.validate().map_err(|e| CoeError::Invalid(e.to_string()))?;
    let start = crate::clock::Clock::start();
    let cfg = scale.config().with_knobs(knobs);
    let plan = cfg.train;
    let digits = Assets::locate()?.digits()?;
    let split = train::split(digits.len(), seed);
    let pool: Vec<usize> = split.test.iter().take(cfg.image_pool).copied().collect();
    let mut rng = SmallRng::seed_from_u64(seed);
    // Topology and target sizes from the policy crate's synthetic generator.
    let shape = synthetic_model(&cfg.model, &mut rng).map_err(|e| CoeError::Invalid(e.to_string()))?;
    // A profile measures one app's experts: a regenerated app makes it stale (set-up steps that
    // key on `profile.txt` then measure again instead of reusing the old app's figures).
    let stale_profile = dir.join("profile.txt");
    if stale_profile.exists() {
        std::fs::remove_file(&stale_profile).map_err(|e| CoeError::io("removing", &stale_profile, e))?;
    }
    let store_dir = dir.join("store");
    if store_dir.exists() {
        std::fs::remove_dir_all(&store_dir).map_err(|e| CoeError::io("clearing", &store_dir, e))?;
    }
    let mut store = WeightStore::open(&store_dir, &Device::Cpu, 0, 0)?;
    let images: Vec<Vec<f32>> = (0..digits.len()).map(|i| image_floats(&digits, i)).collect();
    let labels = &digits.labels;
    let affinity = train::class_affinity(&images, labels, &split.train);
    let groups = train::class_groups(&shape, &affinity, &mut rng);
    // Samples per expert: as many as the single model sees (see `TrainPlan::epochs`).
    let samples = plan.epochs * split.train.len().min(plan.max_rows);
    let mut calibration = vec![false; digits.len()];
    split.calibration.iter().for_each(|&i| calibration[i] = true);
    // reach[e]: the calibration and test walks that reach expert e; selections per walk; the
    // CoE's answer per walk (its reached leaves' outputs weighted by their routing probability).
    let n = shape.len();
    let mut reach: Vec<Vec<Reach>> = vec![Vec::new(); n];
    let mut selections: Walks = BTreeMap::new();
    let mut answers: BTreeMap<(ExpertId, usize), Vec<f32>> = BTreeMap::new();
    let mut files = Vec::with_capacity(n);
    let mut specs = Vec::with_capacity(n);
    let mut sizes = Vec::with_capacity(n);
    for e in shape.experts() {
        let outputs = if e.has_children() { e.children.len() } else { DIGIT_CLASSES };
        let h = hidden_width(e.size_bytes, outputs);
        let widths = vec![INPUT_WIDTH, h, h, outputs];
        let (rows, targets) = if e.has_children() {
            train::preliminary_rows(&groups, e.id, &e.children, &split.train, labels, plan.max_rows)
        } else {
            train::leaf_rows(&groups, e.id, &split.train, labels, plan.max_rows, &affinity, &mut rng)
        };
        let train_seed = seed ^ u64::from(e.id.0).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let bytes = trained_onnx(&widths, &images, &rows, &targets, samples, &plan, train_seed, &mut rng)?;

        let blob = format!("e{}", e.id.0);
        store.put(&blob, &bytes)?;
        write_file(&dir.join(format!("experts/e{}.onnx", e.id.0)), &bytes)?;
        sizes.push(bytes.len() as u64);
        if e.preliminary().is_none() {
            reach[e.id.index()] =
                split.calibration.iter().chain(&split.test).map(|&i| (e.id, i, 1.0)).collect();
        }
        // Run the trained expert on every walk that reaches it.
        let walks = std::mem::take(&mut reach[e.id.index()]);
        if !walks.is_empty() {
            let mut session = OnnxSession::from_bytes(
                &bytes,
                &blob,
                &SessionConfig { intra_threads: 0, ..SessionConfig::default() },
            )?;
            let imgs: Vec<usize> = walks.iter().map(|w| w.1).collect();
            let out = run_rows(&mut session, &images, &imgs, outputs, &blob)?;
            for (&(root, img, path), row) in walks.iter().zip(out.chunks(outputs)) {
                if e.has_children() {
                    let chosen = select_children(row, &e.children);
                    for c in &chosen {
                        let j = e.children.iter().position(|x| x == c).unwrap_or(0);
                        reach[c.index()].push((root, img, path * row[j]));
                    }
                    selections.entry((root, img)).or_default().push((e.id, chosen));
                } else {
                    let answer = answers.entry((root, img)).or_insert_with(|| vec![0.0; DIGIT_CLASSES]);
                    answer.iter_mut().zip(row).for_each(|(a, &p)| *a += path * p);
                }
            }
        }
        reach[e.id.index()] = walks;
        files.push(ExpertFile { id: e.id, widths, blob });
    }
    // Usage probabilities from the calibration walks: share of the parent's that select each child.
    let calibrated = |e: ExpertId| reach[e.index()].iter().filter(|w| calibration[w.1]).count();
    for e in shape.experts() {
        let select_prob = match e.preliminary() {
            None => e.select_prob,
            Some(p) => {
                let parent = calibrated(p);
                if parent == 0 { 0.0 } else { calibrated(e.id) as f64 / parent as f64 }
            }
        };
        specs.push(ExpertSpec {
            size_bytes: sizes[e.id.index()],
            select_prob,
            home: e.home,
            parent: e.preliminary(),
        });
    }
    let expert_bytes: u64 = sizes.iter().sum();
    // The CoE's test accuracy, entry experts weighted by the request mix.
    let (mut right, mut weight) = (0.0, 0.0);
    for root in shape.roots() {
        let hits = split
            .test
            .iter()
            .filter(|&&i| answers.get(&(root.id, i)).is_some_and(|a| argmax(a) == usize::from(labels[i])))
            .count();
        right += root.select_prob * hits as f64 / split.test.len().max(1) as f64;
        weight += root.select_prob;
    }
    let coe_accuracy = if weight > 0.0 { right / weight } else { f64::NAN };
    // Where the CoE loses answers: walks the preliminaries sent to no leaf of the digit's
    // group, against the answers of those they routed right (weighted like the accuracy).
    let routed_walks: std::collections::BTreeSet<(ExpertId, usize)> = shape
        .experts()
        .iter()
        .filter(|e| !e.has_children())
        .flat_map(|e| reach[e.id.index()].iter().filter(|w| groups[e.id.index()].contains(&labels[w.1])))
        .map(|w| (w.0, w.1))
        .collect();
    let (mut routed, mut routed_right) = (0.0, 0.0);
    for root in shape.roots() {
        let (mut n_routed, mut n_right) = (0usize, 0usize);
        for &i in &split.test {
            let label = labels[i];
            if routed_walks.contains(&(root.id, i)) {
                n_routed += 1;
                n_right +=
                    usize::from(answers.get(&(root.id, i)).is_some_and(|a| argmax(a) == usize::from(label)));
            }
        }
        routed += root.select_prob * n_routed as f64 / split.test.len().max(1) as f64;
        routed_right += root.select_prob * if n_routed > 0 { n_right as f64 / n_routed as f64 } else { 0.0 };
    }
    let routed_share = if weight > 0.0 { routed / weight } else { f64::NAN };
    let accuracy_when_routed = if weight > 0.0 { routed_right / weight } else { f64::NAN };
    let (single_model_accuracy, single_model_bytes) = if knobs.skip_single_model {
        (f64::NAN, 0)
    } else {
        single_model(expert_bytes, &images, labels, &split, &plan, seed)?
    };
    let accuracy = Accuracy {
        coe_accuracy,
        single_model_accuracy,
        single_model_bytes,
        expert_bytes,
        train_images: split.train.len(),
        calibration_images: split.calibration.len(),
        test_images: split.test.len(),
        epochs: plan.epochs,
        routed_share,
        accuracy_when_routed,
    };
    let mut model = CoeModel::new(specs).map_err(|e| CoeError::Invalid(e.to_string()))?;
    let total = model.total_bytes().max(1);
    if let Some(h) = knobs.host_budget {
        model = CoeModel::new(sweep::assign_homes(&model, (h * total as f64) as u64))
            .map_err(|e| CoeError::Invalid(e.to_string()))?;
    }
    let host: u64 = model.experts().iter().filter(|e| e.home == Tier::Host).map(|e| e.size_bytes).sum();
    let (gpu_bytes, cpu_bytes, device_budget) = match knobs.device_budget {
        Some(b) => {
            let (gpu, effective) = sweep::budget_bytes(&model, b);
            let ratio = cfg.cpu_expert_bytes as f64 / cfg.gpu_expert_bytes.max(1) as f64;
            (gpu, (gpu as f64 * ratio).round() as u64, effective)
        }
        None => (cfg.gpu_expert_bytes, cfg.cpu_expert_bytes, cfg.gpu_expert_bytes as f64 / total as f64),
    };
    let recorded = Knobs {
        device_budget: device_budget.min(1.0),
        host_budget: host as f64 / total as f64,
        zipf: cfg.model.zipf,
        rate_rps: cfg.rate_rps(),
        experts: n,
        min_bytes: cfg.model.min_bytes,
        max_bytes: cfg.model.max_bytes,
        gpu_expert_bytes: gpu_bytes,
        cpu_expert_bytes: cpu_bytes,
    };
    let trace = build_trace(model, &cfg, &pool, &selections, &mut rng);
    trace.validate().map_err(|e| CoeError::Invalid(e.to_string()))?;
    let manifest =
        Manifest { scale, seed, knobs: Some(recorded), generator: Some(GENERATOR), experts: files };
    write_file(&dir.join("app.txt"), manifest.to_text().as_bytes())?;
    write_file(&dir.join("trace.txt"), trace.to_text().as_bytes())?;
    write_file(&dir.join(ACCURACY_FILE), accuracy.to_text().as_bytes())?;
    let memory = Memory { gpu_expert_bytes: gpu_bytes, cpu_expert_bytes: cpu_bytes };
    let app_file = AppFile::from_model(&trace.model, Some(scale.name()), Some(memory));
    write_file(&dir.join(APP_FILE), app_file.to_toml()?.as_bytes())?;
    Ok(GenReport {
        experts: n,
        total_bytes: expert_bytes,
        min_bytes: sizes.iter().copied().min().unwrap_or(0),
        max_bytes: sizes.iter().copied().max().unwrap_or(0),
        depth: trace.model.depth(),
        requests: trace.requests.len(),
        accuracy,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// The baseline: one 64 -> h -> h -> 10 MLP of about `bytes`, trained like the experts on the
/// whole train split and run with ONNX Runtime on the test split; `(accuracy, its ONNX bytes)`,
/// or `(NaN, 0)` past the plan's baseline cap. Its initial weights come from their own stream
/// of `seed`, so the baseline does not change with the experts' design.
fn single_model(
    bytes: u64,
    images: &[Vec<f32>],
    labels: &[u8],
    split: &train::Split,
    plan: &TrainPlan,
    seed: u64,
) -> Result<(f64, u64), CoeError> {
    let mut rng = SmallRng::seed_from_u64(seed ^ SINGLE_MODEL_SALT);
    if bytes > plan.baseline_max_bytes {
        return Ok((f64::NAN, 0));
    }
    let h = hidden_width(bytes, DIGIT_CLASSES);
    let rows: Vec<usize> = split.train.iter().take(plan.max_rows).copied().collect();
    let targets: Vec<usize> = rows.iter().map(|&i| usize::from(labels[i])).collect();
    let onnx = trained_onnx(
        &[INPUT_WIDTH, h, h, DIGIT_CLASSES],
        images,
        &rows,
        &targets,
        plan.epochs * rows.len(),
        plan,
        seed ^ SINGLE_MODEL_SALT,
        &mut rng,
    )?;
    let mut session = OnnxSession::from_bytes(
        &onnx,
        "single",
        &SessionConfig { intra_threads: 0, ..SessionConfig::default() },
    )?;
    let out = run_rows(&mut session, images, &split.test, DIGIT_CLASSES, "single")?;
    let hits = split
        .test
        .iter()
        .zip(out.chunks(DIGIT_CLASSES))
        .filter(|(i, row)| argmax(row) == usize::from(labels[**i]))
        .count();
    Ok((hits as f64 / split.test.len().max(1) as f64, onnx.len() as u64))
}

/// Write a file, creating its folder.
pub fn write_file(path: &Path, bytes: &[u8]) -> Result<(), CoeError> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| CoeError::io("creating", parent, e))?;
    }
    std::fs::write(path, bytes).map_err(|e| CoeError::io("writing", path, e))
}

/// Bursty Poisson arrivals with a skewed (Zipf) mix over the roots, inputs drawn from the
/// image indices `pool`; each request's selections are the real ones recorded for its
/// (root, image) walk.
pub(crate) fn build_trace(
    model: CoeModel,
    cfg: &ScaleConfig,
    pool: &[usize],
    selections: &Walks,
    rng: &mut SmallRng,
) -> Trace {
    let roots: Vec<(ExpertId, f64)> = model.roots().map(|e| (e.id, e.select_prob)).collect();
    let total: f64 = roots.iter().map(|r| r.1).sum();
    let mut requests = Vec::with_capacity(cfg.requests);
    let mut now = 0u64;
    while requests.len() < cfg.requests {
        let u: f64 = rng.random();
        now += (-(1.0 - u).ln() * cfg.mean_gap.0 as f64).round() as u64;
        let burst =
            if rng.random::<f64>() < cfg.burst_prob { rng.random_range(2..=cfg.burst_max.max(2)) } else { 1 };
        for _ in 0..burst {
            if requests.len() >= cfg.requests {
                break;
            }
            let mut x = rng.random::<f64>() * total;
            let mut root = roots[roots.len() - 1].0;
            for (id, p) in &roots {
                if x < *p {
                    root = *id;
                    break;
                }
                x -= p;
            }
            let image = pool.get(rng.random_range(0..pool.len().max(1))).copied().unwrap_or(0);
            requests.push(TraceRequest {
                id: RequestId(requests.len() as u64),
                arrival: Micros(now),
                input: image as u64,
                root,
                selections: selections.get(&(root, image)).cloned().unwrap_or_default(),
            });
        }
    }
    Trace { model, requests }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn knobs_shape_the_scale_config() {
        let k = GenKnobs { zipf: Some(1.4), rate_rps: Some(800.0), experts: Some(72), ..GenKnobs::default() };
        let c = Scale::Ci.config().with_knobs(&k);
        assert_eq!(c.model.zipf, 1.4);
        assert!((c.rate_rps() / 800.0 - 1.0).abs() < 1e-3, "{}", c.rate_rps());
        assert_eq!(c.model.roots, 8);
        assert!(GenKnobs { device_budget: Some(0.0), ..k }.validate().is_err());
        assert!(GenKnobs { host_budget: Some(1.2), ..k }.validate().is_err());
        assert!(k.validate().is_ok());
    }

    #[test]
    fn hidden_width_hits_the_size() {
        for bytes in [64u64 << 10, 1 << 20, 40 << 20] {
            let h = hidden_width(bytes, 4);
            let params = 64 * h + h + h * h + h + h * 4 + 4;
            let got = params as f64 * 4.0;
            assert!((got / bytes as f64 - 1.0).abs() < 0.02, "{bytes}: {got}");
        }
    }

    #[test]
    fn selection_takes_argmax_and_close_runner_up() {
        let c = [ExpertId(5), ExpertId(6), ExpertId(7)];
        assert_eq!(select_children(&[0.2, 0.5, 0.3], &c), vec![ExpertId(6)]);
        assert_eq!(select_children(&[0.34, 0.31, 0.35], &c), vec![ExpertId(7), ExpertId(5)]);
        assert_eq!(select_children(&[], &c), Vec::<ExpertId>::new());
    }

    #[test]
    fn manifest_round_trips_and_rejects_garbage() {
        let m = Manifest {
            scale: Scale::Ci,
            seed: 7,
            knobs: None,
            generator: None,
            experts: vec![ExpertFile { id: ExpertId(0), widths: vec![64, 10, 10, 3], blob: "e0".into() }],
        };
        let p = Path::new("app.txt");
        assert_eq!(Manifest::parse(&m.to_text(), p).unwrap(), m);
        let knobs = Knobs {
            device_budget: 0.1,
            host_budget: 0.25,
            zipf: 1.4,
            rate_rps: 2_500.5,
            experts: 36,
            min_bytes: 1 << 16,
            max_bytes: 1 << 21,
            gpu_expert_bytes: 123_456,
            cpu_expert_bytes: 185_184,
        };
        let with = Manifest { knobs: Some(knobs), generator: Some(GENERATOR), ..m.clone() };
        assert_eq!(Manifest::parse(&with.to_text(), p).unwrap(), with);
        let bad = with.to_text().replace("device_budget 0.1", "device_budget 1.5");
        let err = Manifest::parse(&bad, p).unwrap_err().to_string();
        assert!(err.contains("line 5") && err.contains("(0, 1]"), "{err}");
        let bad = with.to_text().replace(&format!("generator {GENERATOR}"), "generator new");
        let err = Manifest::parse(&bad, p).unwrap_err().to_string();
        assert!(err.contains("line 4") && err.contains("bad generator `new`"), "{err}");
        let err =
            Manifest::parse("format troupe-coe-app 1\nscale ci\nseed 1\nexpert 0 widths 3,4 blob e0\n", p)
                .unwrap_err()
                .to_string();
        assert!(err.contains("app.txt") && err.contains("line 4"), "{err}");
    }
}

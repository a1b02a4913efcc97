//! The per-device profile the scheduler reads: how batch latency grows with batch size per
//! expert size class, the max useful batch, load bandwidth per tier, and the split of each
//! executor's memory between expert storage and batch intermediates.
//!
//! The offline profiler (in the shell) measures a machine once and writes this as a line-based
//! text file. The file is untrusted input: [`Profile::parse`] caps sizes, validates every value
//! and names line and field on error. A profile carries the fingerprint of the hardware it was
//! taken on; [`Profile::load`] refuses one taken on other hardware.
//!
//! ```text
//! format troupe-coe-profile 1
//! hardware_fingerprint <free text, up to 256 chars>
//! executor <name>                 # starts a block; the keys below belong to it
//! kind gpu|cpu
//! memory_bytes <u64>              # memory this executor may use in all
//! expert_memory_bytes <u64>       # the part kept for resident experts; the rest is intermediates
//! max_batch <u32>                 # largest useful batch (fits the intermediates)
//! bandwidth host|ssd <bytes/s>    # effective load bandwidth from that tier (one line per tier)
//! size_class <max_expert_bytes> <batch>:<micros> ...   # one line per class, ascending
//! ```

use std::fmt::Write as _;

use super::model::Tier;
use super::text::{self, Line, ParseError};
use crate::Micros;

/// First line of every profile file.
pub const FORMAT_LINE: &str = "format troupe-coe-profile 1";
/// Largest profile text accepted, in bytes.
pub const MAX_PROFILE_BYTES: usize = 1 << 20;
/// Most executors in one profile.
pub const MAX_EXECUTORS: usize = 64;
/// Most size classes per executor.
pub const MAX_SIZE_CLASSES: usize = 64;
/// Most latency points per size class.
pub const MAX_POINTS: usize = 64;
/// Largest batch size a profile may name.
pub const MAX_BATCH: u32 = 65_536;
/// Longest hardware fingerprint, in bytes.
pub const MAX_FINGERPRINT_BYTES: usize = 256;
/// Longest executor name, in bytes.
pub const MAX_NAME_BYTES: usize = 64;
/// Largest byte count (memory, expert size class, bandwidth) accepted: 1 PiB.
pub const MAX_BYTES: u64 = 1 << 50;
/// Largest latency accepted: about 11.5 days in microseconds.
pub const MAX_LATENCY_US: u64 = 1_000_000_000_000;

/// The kind of processor behind an executor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExecutorKind {
    /// A CPU thread pool.
    Cpu,
    /// A GPU.
    Gpu,
}

impl ExecutorKind {
    /// The name used in the text format.
    pub fn name(self) -> &'static str {
        match self {
            ExecutorKind::Cpu => "cpu",
            ExecutorKind::Gpu => "gpu",
        }
    }
}

/// One measured point: running a batch of `batch` requests took `latency`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LatencyPoint {
    /// Batch size.
    pub batch: u32,
    /// Measured latency of one batch of that size.
    pub latency: Micros,
}

/// Batch latency curve for experts up to `max_expert_bytes` (and above the previous class).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SizeClass {
    /// Upper bound of expert sizes in this class, in bytes.
    pub max_expert_bytes: u64,
    /// Points with strictly increasing batch sizes, the first at batch 1.
    pub points: Vec<LatencyPoint>,
}

/// What the profiler measured for one executor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExecutorProfile {
    /// Short name (`[A-Za-z0-9_.-]`), e.g. `gpu0`.
    pub name: String,
    /// CPU or GPU.
    pub kind: ExecutorKind,
    /// Memory this executor may use in all, in bytes.
    pub memory_bytes: u64,
    /// Part of `memory_bytes` kept for resident experts; the rest holds batch intermediates.
    pub expert_memory_bytes: u64,
    /// Largest useful batch size.
    pub max_batch: u32,
    /// Effective load bandwidth from host memory, bytes per second.
    pub host_bandwidth: u64,
    /// Effective load bandwidth from SSD, bytes per second.
    pub ssd_bandwidth: u64,
    /// Latency curves by expert size class, ascending `max_expert_bytes`.
    pub size_classes: Vec<SizeClass>,
}

impl ExecutorProfile {
    /// Bytes left for batch intermediates.
    pub fn intermediate_bytes(&self) -> u64 {
        self.memory_bytes.saturating_sub(self.expert_memory_bytes)
    }

    /// Load bandwidth from `tier`, bytes per second.
    pub fn bandwidth(&self, tier: Tier) -> u64 {
        match tier {
            Tier::Host => self.host_bandwidth,
            Tier::Ssd => self.ssd_bandwidth,
        }
    }
}

/// A device profile: the hardware it was taken on and one entry per executor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Profile {
    /// Identifies the hardware the profile was measured on (compared on load).
    pub hardware_fingerprint: String,
    /// Executors in a fixed order; `ExecutorId(i)` is the i-th.
    pub executors: Vec<ExecutorProfile>,
}

/// Why a profile was refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ProfileError {
    /// Malformed or out-of-range text.
    #[error("profile: {0}")]
    Parse(#[from] ParseError),
    /// The profile was taken on other hardware.
    #[error(
        "profile was taken on hardware `{profiled}` but this machine is `{current}`; \
         re-run the profiler on this machine"
    )]
    HardwareMismatch {
        /// Fingerprint stored in the profile.
        profiled: String,
        /// Fingerprint of the machine asking.
        current: String,
    },
}

fn invalid(line: usize, field: &str, problem: impl Into<String>) -> ProfileError {
    ProfileError::Parse(ParseError::new(line, field, problem))
}

impl Profile {
    /// Parse a profile file and check it was taken on the hardware named by `fingerprint`.
    pub fn load(text: &str, fingerprint: &str) -> Result<Profile, ProfileError> {
        let profile = Profile::parse(text)?;
        profile.check_hardware(fingerprint)?;
        Ok(profile)
    }

    /// Refuse the profile unless it was taken on the hardware named by `fingerprint`.
    pub fn check_hardware(&self, fingerprint: &str) -> Result<(), ProfileError> {
        if self.hardware_fingerprint == fingerprint {
            Ok(())
        } else {
            Err(ProfileError::HardwareMismatch {
                profiled: self.hardware_fingerprint.clone(),
                current: fingerprint.to_string(),
            })
        }
    }

    /// Parse and validate a profile file (without the hardware check; see [`Profile::load`]).
    pub fn parse(text: &str) -> Result<Profile, ProfileError> {
        text::check_size(text, MAX_PROFILE_BYTES)?;
        let max_lines = 8 + MAX_EXECUTORS * (8 + MAX_SIZE_CLASSES);
        let lines = text::lines(text, max_lines)?;
        let mut iter = lines.iter();
        let first = iter.next().ok_or_else(|| invalid(0, "format", "the file is empty"))?;
        if first.tokens.join(" ") != FORMAT_LINE {
            return Err(invalid(first.number, "format", format!("expected `{FORMAT_LINE}`")));
        }
        let mut fingerprint: Option<String> = None;
        let mut executors: Vec<ExecutorProfile> = Vec::new();
        let mut current: Option<Builder> = None;
        for line in iter {
            match line.key() {
                "hardware_fingerprint" => {
                    if fingerprint.is_some() {
                        return Err(invalid(line.number, "hardware_fingerprint", "given twice"));
                    }
                    if current.is_some() || !executors.is_empty() {
                        return Err(invalid(
                            line.number,
                            "hardware_fingerprint",
                            "must come before the first executor",
                        ));
                    }
                    fingerprint = Some(parse_fingerprint(line)?);
                }
                "executor" => {
                    if let Some(done) = current.take() {
                        executors.push(done.finish()?);
                    }
                    if executors.len() >= MAX_EXECUTORS {
                        return Err(invalid(
                            line.number,
                            "executor",
                            format!("more than {MAX_EXECUTORS} executors"),
                        ));
                    }
                    line.expect_len(2)?;
                    let name = parse_name(line)?;
                    if executors.iter().any(|e| e.name == name) {
                        return Err(invalid(line.number, "executor", format!("`{name}` repeats")));
                    }
                    current = Some(Builder::new(line.number, name));
                }
                key => {
                    let builder = current
                        .as_mut()
                        .ok_or_else(|| invalid(line.number, key, "must come after an `executor` line"))?;
                    builder.apply(line)?;
                }
            }
        }
        if let Some(done) = current.take() {
            executors.push(done.finish()?);
        }
        let hardware_fingerprint =
            fingerprint.ok_or_else(|| invalid(0, "hardware_fingerprint", "missing from the profile"))?;
        if executors.is_empty() {
            return Err(invalid(0, "executor", "the profile names no executor"));
        }
        let profile = Profile { hardware_fingerprint, executors };
        profile.validate()?;
        Ok(profile)
    }

    /// Check the invariants the parser guarantees (also for profiles built in code).
    pub fn validate(&self) -> Result<(), ProfileError> {
        check_fingerprint(&self.hardware_fingerprint, 0)?;
        if self.executors.is_empty() || self.executors.len() > MAX_EXECUTORS {
            return Err(invalid(0, "executor", format!("need 1..={MAX_EXECUTORS} executors")));
        }
        for e in &self.executors {
            validate_executor(e, 0)?;
        }
        Ok(())
    }

    /// Write the profile in the text format [`Profile::parse`] reads.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        out.push_str(FORMAT_LINE);
        out.push('\n');
        let _ = writeln!(out, "hardware_fingerprint {}", self.hardware_fingerprint);
        for e in &self.executors {
            let _ = writeln!(out, "executor {}", e.name);
            let _ = writeln!(out, "kind {}", e.kind.name());
            let _ = writeln!(out, "memory_bytes {}", e.memory_bytes);
            let _ = writeln!(out, "expert_memory_bytes {}", e.expert_memory_bytes);
            let _ = writeln!(out, "max_batch {}", e.max_batch);
            let _ = writeln!(out, "bandwidth host {}", e.host_bandwidth);
            let _ = writeln!(out, "bandwidth ssd {}", e.ssd_bandwidth);
            for class in &e.size_classes {
                let _ = write!(out, "size_class {}", class.max_expert_bytes);
                for p in &class.points {
                    let _ = write!(out, " {}:{}", p.batch, p.latency.0);
                }
                out.push('\n');
            }
        }
        out
    }
}

/// How the profiler splits an executor's memory (see [`split_memory`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemorySplit {
    /// Bytes for resident experts.
    pub expert_bytes: u64,
    /// Bytes for batch intermediates.
    pub intermediate_bytes: u64,
    /// Largest batch the intermediates hold.
    pub max_batch: u32,
}

/// The smallest profiled batch size whose per-request latency is within `tolerance` (0.05 =
/// 5%) of the best per-request latency among `points`: a bigger batch buys almost no speed but
/// costs intermediate memory that could hold experts. 1 when `points` is empty.
pub fn max_useful_batch(points: &[LatencyPoint], tolerance: f64) -> u32 {
    let per_request = |p: &LatencyPoint| p.latency.0 as f64 / f64::from(p.batch.max(1));
    let best = points.iter().map(per_request).fold(f64::INFINITY, f64::min);
    points.iter().find(|p| per_request(p) <= best * (1.0 + tolerance.max(0.0))).map_or(1, |p| p.batch)
}

/// Split `memory_bytes` between batch intermediates for up to `useful_batch` requests of
/// `bytes_per_request` each and expert storage, shrinking the batch until at least
/// `min_expert_bytes` (e.g. the largest expert) is left for experts. `None` when even a batch
/// of one does not leave that much.
pub fn split_memory(
    memory_bytes: u64,
    bytes_per_request: u64,
    useful_batch: u32,
    min_expert_bytes: u64,
) -> Option<MemorySplit> {
    let room = memory_bytes.checked_sub(min_expert_bytes)?;
    let fits = room.checked_div(bytes_per_request).unwrap_or(u64::MAX);
    let max_batch = u32::try_from(fits).unwrap_or(u32::MAX).min(useful_batch.max(1));
    if max_batch == 0 {
        return None;
    }
    let intermediate_bytes = bytes_per_request.saturating_mul(u64::from(max_batch));
    Some(MemorySplit { expert_bytes: memory_bytes - intermediate_bytes, intermediate_bytes, max_batch })
}

/// An expert as the memory-split search sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SplitExpert {
    /// Weights size in bytes.
    pub size_bytes: u64,
    /// Chance a request uses it.
    pub usage_prob: f64,
    /// Time to load it onto the executor, microseconds (from its home tier's bandwidth).
    pub load_us: f64,
}

/// Modelled time per request of running batches of `batch` with `expert_bytes` for experts:
/// the most used experts per byte are kept resident (greedily, while they fit), and every use
/// of an expert costs the batch's latency per request plus, when it is not resident, its load
/// shared by the batch.
fn modelled_us_per_request(latency_us: f64, batch: u32, expert_bytes: u64, experts: &[SplitExpert]) -> f64 {
    let mut order: Vec<&SplitExpert> = experts.iter().collect();
    order.sort_by(|a, b| {
        let density = |e: &SplitExpert| e.usage_prob / e.size_bytes.max(1) as f64;
        density(b).total_cmp(&density(a))
    });
    let (mut used, mut cost) = (0u64, 0.0);
    let b = f64::from(batch.max(1));
    for e in order {
        let resident = used.checked_add(e.size_bytes).is_some_and(|t| t <= expert_bytes);
        if resident {
            used += e.size_bytes;
        }
        cost += e.usage_prob * (latency_us / b + if resident { 0.0 } else { e.load_us / b });
    }
    cost
}

/// Split `memory_bytes` between batch intermediates (`bytes_per_request` each) and experts by
/// search: every profiled batch size in `points` whose intermediates leave room for the
/// largest expert is a candidate, and the one with the lowest modelled time per request
/// (latency per request from `points`, misses of the experts that no longer fit charged their
/// load time, see [`SplitExpert`]) wins; ties go to the smaller batch (more expert memory).
/// `None` when no candidate leaves room for the largest expert.
pub fn search_split(
    memory_bytes: u64,
    bytes_per_request: u64,
    points: &[LatencyPoint],
    experts: &[SplitExpert],
) -> Option<MemorySplit> {
    let largest = experts.iter().map(|e| e.size_bytes).max().unwrap_or(0);
    let mut best: Option<(f64, MemorySplit)> = None;
    for p in points {
        let Some(intermediate_bytes) = bytes_per_request.checked_mul(u64::from(p.batch)) else { continue };
        let Some(expert_bytes) = memory_bytes.checked_sub(intermediate_bytes) else { continue };
        if expert_bytes < largest || p.batch == 0 {
            continue;
        }
        let cost = modelled_us_per_request(p.latency.0 as f64, p.batch, expert_bytes, experts);
        if best.as_ref().is_none_or(|(c, _)| cost < *c) {
            best = Some((cost, MemorySplit { expert_bytes, intermediate_bytes, max_batch: p.batch }));
        }
    }
    best.map(|(_, s)| s)
}

fn check_fingerprint(fp: &str, line: usize) -> Result<(), ProfileError> {
    if fp.is_empty() || fp.len() > MAX_FINGERPRINT_BYTES {
        return Err(invalid(
            line,
            "hardware_fingerprint",
            format!("must be 1..={MAX_FINGERPRINT_BYTES} bytes"),
        ));
    }
    if fp.chars().any(|c| c.is_control()) || fp.trim() != fp {
        return Err(invalid(
            line,
            "hardware_fingerprint",
            "must be printable text without leading or trailing spaces",
        ));
    }
    Ok(())
}

fn parse_fingerprint(line: &Line<'_>) -> Result<String, ProfileError> {
    if line.tokens.len() < 2 {
        return Err(invalid(line.number, "hardware_fingerprint", "missing value"));
    }
    // Tokens were split on whitespace; the fingerprint is the rest of the line, single-spaced.
    let fp = line.tokens[1..].join(" ");
    check_fingerprint(&fp, line.number)?;
    Ok(fp)
}

fn parse_name(line: &Line<'_>) -> Result<String, ProfileError> {
    let name = line.token(1, "executor")?;
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_BYTES
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if !ok {
        return Err(invalid(
            line.number,
            "executor",
            format!("name must be 1..={MAX_NAME_BYTES} chars of [A-Za-z0-9_.-]"),
        ));
    }
    Ok(name.to_string())
}

fn validate_executor(e: &ExecutorProfile, line: usize) -> Result<(), ProfileError> {
    let name = &e.name;
    let bad = |field: &str, problem: String| invalid(line, field, format!("executor {name}: {problem}"));
    if e.memory_bytes == 0 || e.memory_bytes > MAX_BYTES {
        return Err(bad("memory_bytes", format!("must be within 1..={MAX_BYTES}")));
    }
    if e.expert_memory_bytes == 0 || e.expert_memory_bytes > e.memory_bytes {
        return Err(bad(
            "expert_memory_bytes",
            format!("must be within 1..=memory_bytes ({})", e.memory_bytes),
        ));
    }
    if e.max_batch == 0 || e.max_batch > MAX_BATCH {
        return Err(bad("max_batch", format!("must be within 1..={MAX_BATCH}")));
    }
    for (field, bw) in [("bandwidth host", e.host_bandwidth), ("bandwidth ssd", e.ssd_bandwidth)] {
        if bw == 0 || bw > MAX_BYTES {
            return Err(bad(field, format!("must be within 1..={MAX_BYTES} bytes/s")));
        }
    }
    if e.size_classes.is_empty() || e.size_classes.len() > MAX_SIZE_CLASSES {
        return Err(bad("size_class", format!("need 1..={MAX_SIZE_CLASSES} size classes")));
    }
    let mut previous_max = 0u64;
    for class in &e.size_classes {
        if class.max_expert_bytes <= previous_max || class.max_expert_bytes > MAX_BYTES {
            return Err(bad(
                "size_class",
                "size classes must have ascending max_expert_bytes within 1..=1 PiB".to_string(),
            ));
        }
        previous_max = class.max_expert_bytes;
        if class.points.is_empty() || class.points.len() > MAX_POINTS {
            return Err(bad("size_class", format!("need 1..={MAX_POINTS} latency points")));
        }
        if class.points[0].batch != 1 {
            return Err(bad("size_class", "the first latency point must be at batch 1".into()));
        }
        let mut previous_batch = 0u32;
        for p in &class.points {
            if p.batch <= previous_batch || p.batch > MAX_BATCH {
                return Err(bad(
                    "size_class",
                    "batch sizes must be strictly ascending and at most 65536".into(),
                ));
            }
            previous_batch = p.batch;
            if p.latency.0 == 0 || p.latency.0 > MAX_LATENCY_US {
                return Err(bad("size_class", format!("latency must be within 1..={MAX_LATENCY_US} us")));
            }
        }
    }
    Ok(())
}

/// Collects one `executor` block's keys, refusing repeats.
struct Builder {
    line: usize,
    name: String,
    kind: Option<ExecutorKind>,
    memory_bytes: Option<u64>,
    expert_memory_bytes: Option<u64>,
    max_batch: Option<u32>,
    host_bandwidth: Option<u64>,
    ssd_bandwidth: Option<u64>,
    size_classes: Vec<SizeClass>,
}

fn set_once<T>(slot: &mut Option<T>, value: T, line: usize, field: &str) -> Result<(), ProfileError> {
    if slot.is_some() {
        return Err(invalid(line, field, "given twice for this executor"));
    }
    *slot = Some(value);
    Ok(())
}

impl Builder {
    fn new(line: usize, name: String) -> Self {
        Builder {
            line,
            name,
            kind: None,
            memory_bytes: None,
            expert_memory_bytes: None,
            max_batch: None,
            host_bandwidth: None,
            ssd_bandwidth: None,
            size_classes: Vec::new(),
        }
    }

    fn apply(&mut self, line: &Line<'_>) -> Result<(), ProfileError> {
        let n = line.number;
        match line.key() {
            "kind" => {
                line.expect_len(2)?;
                let kind = match line.token(1, "kind")? {
                    "cpu" => ExecutorKind::Cpu,
                    "gpu" => ExecutorKind::Gpu,
                    other => {
                        return Err(invalid(n, "kind", format!("`{other}` is not cpu or gpu")));
                    }
                };
                set_once(&mut self.kind, kind, n, "kind")
            }
            "memory_bytes" => {
                line.expect_len(2)?;
                let v = line.number(1, "memory_bytes", 1, MAX_BYTES)?;
                set_once(&mut self.memory_bytes, v, n, "memory_bytes")
            }
            "expert_memory_bytes" => {
                line.expect_len(2)?;
                let v = line.number(1, "expert_memory_bytes", 1, MAX_BYTES)?;
                set_once(&mut self.expert_memory_bytes, v, n, "expert_memory_bytes")
            }
            "max_batch" => {
                line.expect_len(2)?;
                let v = line.number(1, "max_batch", 1, MAX_BATCH)?;
                set_once(&mut self.max_batch, v, n, "max_batch")
            }
            "bandwidth" => {
                line.expect_len(3)?;
                let tier_name = line.token(1, "bandwidth")?;
                let tier = Tier::from_name(tier_name).ok_or_else(|| {
                    invalid(n, "bandwidth", format!("`{tier_name}` is not a tier (host or ssd)"))
                })?;
                let v = line.number(2, "bandwidth", 1, MAX_BYTES)?;
                match tier {
                    Tier::Host => set_once(&mut self.host_bandwidth, v, n, "bandwidth host"),
                    Tier::Ssd => set_once(&mut self.ssd_bandwidth, v, n, "bandwidth ssd"),
                }
            }
            "size_class" => {
                if self.size_classes.len() >= MAX_SIZE_CLASSES {
                    return Err(invalid(n, "size_class", format!("more than {MAX_SIZE_CLASSES}")));
                }
                if line.tokens.len() < 3 || line.tokens.len() > 2 + MAX_POINTS {
                    return Err(invalid(
                        n,
                        "size_class",
                        format!("expected a max size and 1..={MAX_POINTS} batch:micros points"),
                    ));
                }
                let max_expert_bytes = line.number(1, "size_class", 1, MAX_BYTES)?;
                let mut points = Vec::with_capacity(line.tokens.len() - 2);
                for token in &line.tokens[2..] {
                    let (b, l) = token
                        .split_once(':')
                        .ok_or_else(|| invalid(n, "size_class", format!("`{token}` is not batch:micros")))?;
                    let batch = text::parse_number(b, n, "size_class batch", 1, MAX_BATCH)?;
                    let latency = text::parse_number(l, n, "size_class latency", 1, MAX_LATENCY_US)?;
                    points.push(LatencyPoint { batch, latency: Micros(latency) });
                }
                self.size_classes.push(SizeClass { max_expert_bytes, points });
                Ok(())
            }
            other => Err(invalid(n, other, "unknown key")),
        }
    }

    fn finish(self) -> Result<ExecutorProfile, ProfileError> {
        let line = self.line;
        let missing = |field: &str| invalid(line, field, format!("missing for executor {}", self.name));
        let profile = ExecutorProfile {
            kind: self.kind.ok_or_else(|| missing("kind"))?,
            memory_bytes: self.memory_bytes.ok_or_else(|| missing("memory_bytes"))?,
            expert_memory_bytes: self.expert_memory_bytes.ok_or_else(|| missing("expert_memory_bytes"))?,
            max_batch: self.max_batch.ok_or_else(|| missing("max_batch"))?,
            host_bandwidth: self.host_bandwidth.ok_or_else(|| missing("bandwidth host"))?,
            ssd_bandwidth: self.ssd_bandwidth.ok_or_else(|| missing("bandwidth ssd"))?,
            size_classes: self.size_classes,
            name: self.name,
        };
        validate_executor(&profile, line)?;
        Ok(profile)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
# measured by hand
format troupe-coe-profile 1
hardware_fingerprint cpu=test-cpu gpu=test gpu
executor gpu0
kind gpu
memory_bytes 1000
expert_memory_bytes 800
max_batch 8
bandwidth host 4000
bandwidth ssd 1000
size_class 100 1:10 4:20 8:30
size_class 400 1:40 8:120
executor cpu0
kind cpu
memory_bytes 5000
expert_memory_bytes 4000
max_batch 4
bandwidth host 2000
bandwidth ssd 1000
size_class 400 1:100 4:400
";

    #[test]
    fn parses_and_round_trips() {
        let p = Profile::parse(SAMPLE).unwrap();
        assert_eq!(p.hardware_fingerprint, "cpu=test-cpu gpu=test gpu");
        assert_eq!(p.executors.len(), 2);
        let gpu = &p.executors[0];
        assert_eq!(gpu.kind, ExecutorKind::Gpu);
        assert_eq!(gpu.intermediate_bytes(), 200);
        assert_eq!(gpu.bandwidth(Tier::Ssd), 1000);
        assert_eq!(gpu.size_classes[0].points[1], LatencyPoint { batch: 4, latency: Micros(20) });
        assert_eq!(Profile::parse(&p.to_text()).unwrap(), p);
    }

    #[test]
    fn refuses_other_hardware_with_a_clear_message() {
        let err = Profile::load(SAMPLE, "cpu=other").unwrap_err();
        assert!(matches!(err, ProfileError::HardwareMismatch { .. }));
        let msg = err.to_string();
        assert!(msg.contains("cpu=test-cpu gpu=test gpu"), "{msg}");
        assert!(msg.contains("cpu=other"), "{msg}");
        assert!(msg.contains("re-run the profiler"), "{msg}");
        assert!(Profile::load(SAMPLE, "cpu=test-cpu gpu=test gpu").is_ok());
    }

    fn error_of(text: &str) -> ParseError {
        match Profile::parse(text) {
            Err(ProfileError::Parse(e)) => e,
            other => panic!("expected a parse error, got {other:?}"),
        }
    }

    #[test]
    fn errors_name_line_and_field() {
        let e = error_of(&SAMPLE.replace("max_batch 8", "max_batch 0"));
        assert_eq!((e.line, e.field.as_str()), (8, "max_batch"));
        let e = error_of(
            &SAMPLE.replace("bandwidth ssd 1000\nsize_class 100", "bandwidth ssd x\nsize_class 100"),
        );
        assert_eq!((e.line, e.field.as_str()), (10, "bandwidth"));
        let e = error_of(&SAMPLE.replace("1:10 4:20", "1:10 4-20"));
        assert_eq!((e.line, e.field.as_str()), (11, "size_class"));
        let e = error_of(&SAMPLE.replace("1:10 4:20", "2:10 4:20"));
        assert_eq!(e.field, "size_class");
        assert!(e.problem.contains("batch 1"), "{e}");
        let e = error_of(&SAMPLE.replace("kind cpu", "kind tpu"));
        assert_eq!((e.line, e.field.as_str()), (14, "kind"));
        let e = error_of(&SAMPLE.replace("expert_memory_bytes 800", "expert_memory_bytes 1200"));
        assert_eq!(e.field, "expert_memory_bytes");
        let e = error_of(&SAMPLE.replace("kind gpu\n", "kind gpu\nkind gpu\n"));
        assert_eq!((e.line, e.field.as_str()), (6, "kind"));
        let e = error_of(&SAMPLE.replace("max_batch 4\n", ""));
        assert_eq!((e.line, e.field.as_str()), (13, "max_batch"));
        let e = error_of(&SAMPLE.replace("executor cpu0", "executor gpu0"));
        assert_eq!(e.field, "executor");
        let e = error_of("format troupe-coe-profile 2\n");
        assert_eq!((e.line, e.field.as_str()), (1, "format"));
        let e = error_of(
            &SAMPLE.replace("format troupe-coe-profile 1\n", "format troupe-coe-profile 1\nbogus 1\n"),
        );
        assert_eq!((e.line, e.field.as_str()), (3, "bogus"));
        let e = error_of(&SAMPLE.replace("hardware_fingerprint cpu=test-cpu gpu=test gpu\n", ""));
        assert_eq!(e.field, "hardware_fingerprint");
    }

    #[test]
    fn max_useful_batch_stops_where_batching_stops_paying() {
        let pts = |v: &[(u32, u64)]| -> Vec<LatencyPoint> {
            v.iter().map(|&(batch, l)| LatencyPoint { batch, latency: Micros(l) }).collect()
        };
        // Per request: 100, 30, 13.75, 13.3: batch 16 is within 5% of batch 32's 13.3.
        let curve = pts(&[(1, 100), (4, 120), (16, 220), (32, 425)]);
        assert_eq!(max_useful_batch(&curve, 0.05), 16);
        assert_eq!(max_useful_batch(&curve, 0.0), 32);
        assert_eq!(max_useful_batch(&[], 0.05), 1);
    }

    #[test]
    fn searched_split_trades_batch_size_against_misses() {
        let pts: Vec<LatencyPoint> = [(1, 100), (2, 120), (4, 160), (8, 300)]
            .iter()
            .map(|&(batch, us)| LatencyPoint { batch, latency: Micros(us) })
            .collect();
        let two = |load_us| {
            [
                SplitExpert { size_bytes: 300, usage_prob: 0.9, load_us },
                SplitExpert { size_bytes: 300, usage_prob: 0.9, load_us },
            ]
        };
        // Batch 8 leaves 200 bytes (< the largest expert); batch 4 keeps both hot experts.
        let s = search_split(1000, 100, &pts, &two(10_000.0)).unwrap();
        assert_eq!((s.max_batch, s.expert_bytes, s.intermediate_bytes), (4, 600, 400));
        // The shrink-until-it-fits split takes the biggest batch instead and holds one expert.
        assert_eq!(split_memory(1000, 100, 8, 300).unwrap().max_batch, 7);
        // With 1200 bytes batch 8 holds one: worth it only when a miss is cheap.
        assert_eq!(search_split(1200, 100, &pts, &two(10_000.0)).unwrap().max_batch, 4);
        assert_eq!(search_split(1200, 100, &pts, &two(8.0)).unwrap().max_batch, 8);
        assert_eq!(search_split(250, 100, &pts, &two(8.0)), None, "no room for the largest expert");
    }

    #[test]
    fn split_memory_leaves_room_for_the_largest_expert() {
        // 1000 bytes, 50 per request, useful batch 16 (800 bytes) would leave 200: enough for
        // a 200-byte expert.
        let s = split_memory(1000, 50, 16, 200).unwrap();
        assert_eq!((s.expert_bytes, s.intermediate_bytes, s.max_batch), (200, 800, 16));
        // A 400-byte expert needs the batch cut to 12 (600 bytes).
        let s = split_memory(1000, 50, 16, 400).unwrap();
        assert_eq!((s.expert_bytes, s.intermediate_bytes, s.max_batch), (400, 600, 12));
        assert_eq!(split_memory(1000, 50, 16, 960), None);
        assert_eq!(split_memory(100, 50, 16, 200), None);
    }

    #[test]
    fn caps_hold_before_parsing() {
        let huge = "#".repeat(MAX_PROFILE_BYTES + 1);
        assert_eq!(error_of(&huge).field, "file");
        let many_points: String = (1..=MAX_POINTS as u32 + 1).map(|b| format!(" {b}:{b}")).collect();
        let text = SAMPLE.replace("size_class 100 1:10 4:20 8:30", &format!("size_class 100{many_points}"));
        assert_eq!(error_of(&text).field, "size_class");
    }
}

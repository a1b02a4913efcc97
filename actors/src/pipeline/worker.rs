//! The pipeline worker: a phone-class stage runner holding at most one live ONNX session.
//!
//! It is a typed actor ([`PipelineWorker`], named [`worker_name`]`(NODE)` on its node) that
//! answers the foreman's messages one at a time ([`Join`], [`Fetch`], [`Load`], [`Unload`],
//! [`Run`], [`GetTelemetry`], [`GetStats`], each with its reply type; only the `scheduler`
//! role may send them): stage files are pulled by hash from the foreman and kept in a disk
//! cache (`<sha256>.onnx`, checked against the hash on every load); a `Load` is refused while a
//! session is live, so the foreman must `Unload` first (single-partition residency). Every
//! session is counted process-wide ([`LiveSession`]) and the worker reports the most ever live
//! at once, so the invariant is checked from the worker's own report, not assumed.
//! On a simulated cluster ([`WorkerSettings::sim`]) the same actor runs its stages on the
//! deterministic stand-in [`SimStage`] instead of ONNX Runtime, reads nothing of the OS, and
//! reports a fresh incarnation number in place of its pid.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use rkyv::{Archive, Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tracing::{info, warn};
use troupe_kernels::cpu_time::thread_cpu_seconds;
use troupe_kernels::onnx::{OnnxSession, SessionConfig, peak_resident_bytes, resident_bytes};
use troupe_transport::{Link, NodeId, NodeLink, Role, off_the_runtime};

use super::sim_stage::SimStage;
use super::telemetry::{DeviceModel, MemoryLimit, Sampler, Straggler, apply_cpu_quota, apply_memory_limit};
use super::wire::{
    BY_REFERENCE_ABOVE, BlobShelf, Coding, EncodeTally, Fetch, Fetched, GetStats, GetTelemetry, Join, Joined,
    Load, Loaded, MAX_MESSAGE_DECODED_BYTES, Moved, Ran, Run, RunReply, RunTimes, TelemetrySample,
    TensorBody, Unload, WireError, WorkerStats, decode_tensors_from, encode_tensors_above,
};
use crate::clock::Clock;
use crate::service::Allow;
use crate::typed::{ActorContext, ActorFailure, Handles, Protocol, TypedActor};
use troupe_transport::codec::DecodeBudget;

/// Largest stage file a worker accepts.
pub const MAX_STAGE_BYTES: u64 = 1 << 30;
/// Most cached files listed in a join report.
pub const MAX_CACHED_LISTED: usize = 1024;
/// Typed-actor names of workers are this prefix plus the worker's node name ([`worker_name`]).
pub const WORKER_PREFIX: &str = "pipeline-worker/";
/// Who may send a worker each of its messages: the `scheduler` role (the foreman) only.
pub const SENDER: Role = Role::Scheduler;

/// The typed-actor name of the worker on node `node`.
pub fn worker_name(node: &str) -> String {
    format!("{WORKER_PREFIX}{node}")
}

static LIVE: AtomicU32 = AtomicU32::new(0);
static MAX_LIVE: AtomicU32 = AtomicU32::new(0);

/// What a live session runs: an ONNX Runtime session, or the simulation's stand-in.
enum StageSession {
    Onnx(OnnxSession),
    Sim(SimStage),
}

/// A session counted in the process-wide live count while it exists.
pub struct LiveSession {
    session: StageSession,
    stage: u32,
    sha256: String,
}

impl LiveSession {
    fn new(session: StageSession, stage: u32, sha256: String) -> Self {
        let now = LIVE.fetch_add(1, Ordering::SeqCst) + 1;
        MAX_LIVE.fetch_max(now, Ordering::SeqCst);
        LiveSession { session, stage, sha256 }
    }
}

impl Drop for LiveSession {
    fn drop(&mut self) {
        LIVE.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Most sessions ever live at once in this process.
pub fn max_live_sessions() -> u32 {
    MAX_LIVE.load(Ordering::SeqCst)
}

/// Settings of a worker (from its node config); its start arguments, so they travel as rkyv.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct WorkerSettings {
    /// This node's name.
    pub node: String,
    /// RAM budget for its sessions, bytes (reported; the foreman keeps stages that do not fit away).
    pub ram_budget_bytes: u64,
    /// CPU speed in percent of one CPU (100 = full speed).
    pub cpu_quota_pct: u32,
    /// Simulated battery and temperature.
    pub device: DeviceModel,
    /// Enforce the RAM budget with a cgroup memory limit, v2 or v1 (over it, the OS kills the worker).
    pub enforce_ram_budget: bool,
    /// Disk cache of stage files (a path).
    pub cache_dir: String,
    /// ONNX Runtime intra-op threads.
    pub intra_threads: u32,
    /// Run stages on the deterministic stand-in [`SimStage`] (simulation only): no ONNX
    /// Runtime, cgroup or OS telemetry.
    pub sim: bool,
}

impl WorkerSettings {
    fn cache_dir(&self) -> PathBuf {
        PathBuf::from(&self.cache_dir)
    }
}

/// The worker actor: its settings, the node's link and blob shelf, and at most one live session.
pub struct PipelineWorker {
    settings: WorkerSettings,
    link: NodeLink,
    shelf: BlobShelf,
    session: Option<LiveSession>,
    straggler: Straggler,
    memory: MemoryLimit,
    sampler: Sampler,
    stats: WorkerStats,
    /// The pid it reports: the process's, or a simulated worker's fresh incarnation number.
    pid: u32,
}

impl TypedActor for PipelineWorker {
    const KIND: &'static str = "pipeline-worker";
    type Args = WorkerSettings;

    fn protocol(p: &mut Protocol<Self>) {
        p.request::<Join>(Allow::role(SENDER))
            .request::<Fetch>(Allow::role(SENDER))
            .request::<Load>(Allow::role(SENDER))
            .request::<Unload>(Allow::role(SENDER))
            .request::<Run>(Allow::role(SENDER))
            .request::<GetTelemetry>(Allow::role(SENDER))
            .request::<GetStats>(Allow::role(SENDER));
    }

    /// Makes the cache folder, applies the CPU quota and memory limit, and installs a fresh
    /// blob shelf as the node's blob server (a restarted worker holds nothing).
    async fn start(settings: WorkerSettings, ctx: &ActorContext) -> Result<Self, ActorFailure> {
        std::fs::create_dir_all(settings.cache_dir())?;
        crate::allocator::fix_thresholds();
        // a simulated worker shares its process with the whole cluster: no cgroup is its own
        let (straggler, memory) = if settings.sim {
            (Straggler::None, MemoryLimit::Advisory)
        } else {
            (
                apply_cpu_quota(&settings.node, settings.cpu_quota_pct),
                apply_memory_limit(&settings.node, settings.ram_budget_bytes, settings.enforce_ram_budget),
            )
        };
        info!(
            node = %settings.node,
            straggler = %straggler.describe(),
            memory = %memory.describe(),
            cache = %settings.cache_dir,
            "pipeline worker up"
        );
        // ONNX Runtime loaded now, not at the first stage: the idle worker (and the floor its join
        // reports) is the one that serves, and a missing library shows at start
        if !settings.sim
            && let Err(e) = tokio::task::spawn_blocking(troupe_kernels::onnx::runtime).await?
        {
            warn!(node = %settings.node, error = %e, "ONNX Runtime not loaded; stages will not load");
        }
        let (sampler, pid) = if settings.sim {
            // one process holds every simulated node: a restarted worker is told by its number
            let n = crate::typed::fresh_incarnation();
            (Sampler::simulated(settings.device, settings.ram_budget_bytes), (n as u32) | 1)
        } else {
            (Sampler::new(settings.device, settings.ram_budget_bytes), std::process::id())
        };
        let link = ctx.actors.link().clone();
        let shelf = BlobShelf::default();
        link.set_blob_server(Arc::new(shelf.clone()));
        // a (re)started worker holds no session until the foreman loads one
        crate::live::set_stage(&settings.node, None);
        Ok(PipelineWorker {
            settings,
            link,
            shelf,
            session: None,
            straggler,
            memory,
            sampler,
            stats: WorkerStats::default(),
            pid,
        })
    }
}

impl PipelineWorker {
    /// A telemetry sample, with the pid this worker reports.
    fn sample(&mut self) -> TelemetrySample {
        TelemetrySample { pid: self.pid, ..self.sampler.sample() }
    }

    /// Publishes the stage held now, and logs and converts a failure.
    fn answer<T>(&self, out: Result<T, String>) -> Result<T, ActorFailure> {
        crate::live::set_stage(&self.settings.node, self.session.as_ref().map(|l| l.stage));
        out.map_err(|e| {
            warn!(node = %self.settings.node, error = %e, "request failed");
            ActorFailure::msg(e)
        })
    }
}

impl Handles<Join> for PipelineWorker {
    async fn handle(&mut self, _: Join, _: &ActorContext) -> Result<Joined, ActorFailure> {
        let telemetry = self.sample();
        let s = &self.settings;
        Ok(Joined {
            node: s.node.clone(),
            pid: self.pid,
            cached: list_cached(&s.cache_dir()),
            live: self.session.as_ref().map(|l| l.sha256.clone()),
            straggler: format!("{}; {}", self.straggler.describe(), self.memory.describe()),
            telemetry,
        })
    }
}

impl Handles<GetTelemetry> for PipelineWorker {
    async fn handle(&mut self, _: GetTelemetry, _: &ActorContext) -> Result<TelemetrySample, ActorFailure> {
        Ok(self.sample())
    }
}

impl Handles<GetStats> for PipelineWorker {
    async fn handle(&mut self, _: GetStats, _: &ActorContext) -> Result<WorkerStats, ActorFailure> {
        let mut stats = self.stats;
        stats.max_live_sessions = max_live_sessions();
        stats.peak_rss_bytes = if self.settings.sim { 0 } else { peak_resident_bytes().unwrap_or(0) };
        stats.pid = self.pid;
        Ok(stats)
    }
}

impl Handles<Fetch> for PipelineWorker {
    async fn handle(&mut self, m: Fetch, _: &ActorContext) -> Result<Fetched, ActorFailure> {
        let out = self.fetch(m).await;
        self.answer(out)
    }
}

impl Handles<Load> for PipelineWorker {
    async fn handle(&mut self, m: Load, _: &ActorContext) -> Result<Loaded, ActorFailure> {
        let out = self.load(m.stage, m.sha256).await;
        self.answer(out)
    }
}

impl Handles<Unload> for PipelineWorker {
    async fn handle(&mut self, _: Unload, _: &ActorContext) -> Result<(), ActorFailure> {
        if let Some(live) = self.session.take() {
            self.stats.unloads += 1;
            // Dropping a session and trimming the heap is CPU work that grows with the stage,
            // several times longer under a phone's quota: kept off the runtime's threads, which
            // also carry the node's heartbeats.
            off_the_runtime(move || {
                drop(live);
                crate::allocator::release_free_memory();
            });
        }
        self.answer(Ok(()))
    }
}

impl Handles<Run> for PipelineWorker {
    async fn handle(&mut self, m: Run, _: &ActorContext) -> Result<RunReply, ActorFailure> {
        let taken = Clock::start();
        let Run { input, stage, tensors, from, lossy_bf16, compress, keep_outputs } = m;
        let times = RunTimes { request_micros: micros(taken.elapsed()), ..RunTimes::default() };
        let task = RunTask { input, stage, from, coding: Coding { lossy_bf16, compress }, keep_outputs };
        let out = self.run(task, tensors, taken, times).await;
        self.answer(out)
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// CPU seconds read on a thread clock, as whole microseconds (never negative).
fn cpu_micros(cpu_s: f64) -> u64 {
    (cpu_s.max(0.0) * 1e6).round() as u64
}

/// Path of a stage file in the cache.
pub fn cached_path(dir: &Path, sha256: &str) -> PathBuf {
    dir.join(format!("{sha256}.onnx"))
}

/// SHA-256 hashes (hex) of the stage files in a cache folder.
pub fn list_cached(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten().take(MAX_CACHED_LISTED * 4) {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(h) = name.strip_suffix(".onnx")
                && troupe_policy::pipeline::chain::is_sha256_hex(h)
            {
                out.push(h.to_owned());
            }
        }
    }
    out.sort();
    out.truncate(MAX_CACHED_LISTED);
    out
}

/// Bytes per `write` call when a stage file is written ([`write_in_chunks`]).
pub const WRITE_CHUNK_BYTES: usize = 1 << 20;

/// Writes `bytes` to a new file at `path`, [`WRITE_CHUNK_BYTES`] per system call. Under a CPU
/// quota (a phone's share, a CFS quota here) one `write` of a whole stage is a single stretch of
/// kernel time (110 MB: ~0.37 s of copying into the page cache) that the quota cannot cut short:
/// the node runs past its share and then the whole process, heartbeats included, sits throttled
/// until the debt is paid (2.5 s at 15 %, longer than the 2 s failure detector). In chunks the
/// quota takes effect between calls and the write is spread over the periods.
pub fn write_in_chunks(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let mut file = std::fs::File::create(path)?;
    for chunk in bytes.chunks(WRITE_CHUNK_BYTES) {
        file.write_all(chunk)?;
    }
    file.flush()
}

/// Puts a written and verified stage file (`tmp`) in the cache at `path`, as a pull leaves it:
/// renamed into place, then (`mapped`, every real worker) the rewrite a mapped load reads
/// (`<file>.mapped/`) made beside it, once, so that every load of the stage is a warm one (made
/// at the first load instead, it added 0.3-0.8 s at a 13 % quota to whichever job loaded first).
pub fn install_stage_file(tmp: &Path, path: &Path, mapped: bool) -> Result<(), String> {
    std::fs::rename(tmp, path).map_err(|e| format!("renaming into {}: {e}", path.display()))?;
    if mapped {
        troupe_kernels::onnx::mapped::externalized_beside(path).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// SHA-256 of a file read in 1 MiB chunks (size-capped), lower-case hex.
pub fn sha256_file(path: &Path) -> Result<String, String> {
    use std::io::Read;
    let err = |e: std::io::Error| format!("{}: {e}", path.display());
    let len = std::fs::metadata(path).map_err(err)?.len();
    if len > MAX_STAGE_BYTES {
        return Err(format!("{}: {len} bytes is above the {MAX_STAGE_BYTES}-byte cap", path.display()));
    }
    let mut file = std::fs::File::open(path).map_err(err)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(err)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// SHA-256 of bytes, lower-case hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

impl PipelineWorker {
    async fn fetch(&mut self, m: Fetch) -> Result<Fetched, String> {
        let Fetch { stage, sha256, blob, size, from } = m;
        if !troupe_policy::pipeline::chain::is_sha256_hex(&sha256) {
            return Err(format!("stage {stage}: {sha256:?} is not a SHA-256"));
        }
        if size > MAX_STAGE_BYTES {
            return Err(format!("stage {stage}: {size} bytes is above the {MAX_STAGE_BYTES}-byte cap"));
        }
        let path = cached_path(&self.settings.cache_dir(), &sha256);
        if path.is_file() {
            return Ok(Fetched { cached: true, micros: 0 });
        }
        self.stats.largest_stage_bytes = self.stats.largest_stage_bytes.max(size);
        let start = Clock::start();
        let cap = u32::try_from(size).map_err(|_| format!("stage {stage}: size {size} too large"))?;
        let tmp = path.with_extension(format!("part{}", std::process::id()));
        // written from the frame it arrived in: one copy of the stage in memory, not two
        // (the transport runs it off the runtime's threads, so the hashing holds up no task there;
        // the write goes in chunks, so the CPU quota can take effect between them: see
        // `write_in_chunks`)
        let keep = |bytes: &[u8]| -> Result<(), String> {
            let got = sha256_hex(bytes);
            if got != sha256 {
                return Err(format!("stage {stage} from {from}: SHA-256 {got} does not match {sha256}"));
            }
            write_in_chunks(&tmp, bytes).map_err(|e| format!("writing {}: {e}", tmp.display()))
        };
        let pulled = self.link.fetch_blob_with(&NodeId::new(&from), blob, cap, keep).await;
        off_the_runtime(crate::allocator::release_free_memory);
        pulled.map_err(|e| format!("pulling stage {stage} from {from}: {e}"))??;
        let mapped = !self.settings.sim;
        off_the_runtime(|| install_stage_file(&tmp, &path, mapped))
            .map_err(|e| format!("stage {stage} from {from}: {e}"))?;
        self.stats.pulls += 1;
        Ok(Fetched { cached: false, micros: micros(start.elapsed()) })
    }

    async fn load(&mut self, stage: u32, sha256: String) -> Result<Loaded, String> {
        if let Some(live) = &self.session {
            self.stats.refused_loads += 1;
            return Err(format!(
                "residency: stage {} is live; unload it before loading stage {stage}",
                live.stage
            ));
        }
        if !troupe_policy::pipeline::chain::is_sha256_hex(&sha256) {
            return Err(format!("stage {stage}: {sha256:?} is not a SHA-256"));
        }
        let path = cached_path(&self.settings.cache_dir(), &sha256);
        let file_bytes = std::fs::metadata(&path).map_or(0, |m| m.len());
        let threads = self.settings.intra_threads as usize;
        let start = Clock::start();
        let hash = sha256.clone();
        if self.settings.sim {
            let stage_sim = load_sim(&path, &sha256)?;
            tokio::time::sleep(stage_sim.load_time()).await;
            self.session = Some(LiveSession::new(StageSession::Sim(stage_sim), stage, hash));
            self.stats.loads += 1;
            self.stats.largest_stage_bytes = self.stats.largest_stage_bytes.max(file_bytes);
            return Ok(Loaded { micros: micros(start.elapsed()), rss_bytes: 0, cpu_micros: 0 });
        }
        let (session, cpu_s) = tokio::task::spawn_blocking(move || -> Result<(OnnxSession, f64), String> {
            let cpu0 = thread_cpu_seconds();
            // Hash the file as it streams (no copy of it stays in memory), then let ONNX Runtime
            // read it: the process then holds what one session needs, nothing more.
            let got = sha256_file(&path)?;
            if got != sha256 {
                let _ = std::fs::remove_file(&path);
                return Err(format!("{}: cached file has SHA-256 {got}; removed it", path.display()));
            }
            // Large initializers memory-mapped: a stage holding the word-embedding table keeps
            // only the rows its inputs touch resident (see `troupe_kernels::onnx::mapped`).
            let session = OnnxSession::from_file_mapped(&path, &SessionConfig::lean(threads))
                .map_err(|e| e.to_string())?;
            Ok((session, thread_cpu_seconds() - cpu0))
        })
        .await
        .map_err(|e| format!("load task: {e}"))??;
        self.session = Some(LiveSession::new(StageSession::Onnx(session), stage, hash));
        self.stats.loads += 1;
        self.stats.largest_stage_bytes = self.stats.largest_stage_bytes.max(file_bytes);
        Ok(Loaded {
            micros: micros(start.elapsed()),
            rss_bytes: resident_bytes().unwrap_or(0),
            cpu_micros: cpu_micros(cpu_s),
        })
    }

    async fn run(
        &mut self,
        task: RunTask,
        tensors: Vec<super::wire::WireNamed>,
        taken: Clock,
        mut times: RunTimes,
    ) -> Result<RunReply, String> {
        let RunTask { input, stage, from, coding, keep_outputs } = task;
        let live =
            self.session.take().ok_or_else(|| format!("task i{input}/s{stage}: no session is live"))?;
        if live.stage != stage {
            let msg = format!("task i{input}/s{stage}: the live session is stage {}", live.stage);
            self.session = Some(live);
            return Err(msg);
        }
        let mut budget = DecodeBudget::new(MAX_MESSAGE_DECODED_BYTES);
        let mut moved = Moved::default();
        let fetched = Clock::start();
        let decoded =
            decode_tensors_from(tensors, &self.link, &from, Some(&self.shelf), &mut budget, &mut moved).await;
        let inputs = match decoded {
            Ok(t) => t,
            Err(e) => {
                self.session = Some(live);
                return match e {
                    WireError::Pull { ref from, .. } if from != self.link.local_id().as_str() => {
                        Ok(RunReply::PullFailed { node: from.clone(), detail: e.to_string() })
                    }
                    e => Err(e.to_string()),
                };
            }
        };
        times.inputs_micros = micros(fetched.elapsed());
        times.pulled_bytes = moved.pulled;
        times.local_bytes = moved.local;
        times.inline_f32_bytes = moved.inline_f32;
        let (live, result, compute) = match live.session {
            StageSession::Sim(ref sim) => {
                // the stand-in: its modelled time on tokio's clock, then its outputs
                let start = Clock::start();
                tokio::time::sleep(sim.run_time()).await;
                let r = sim.run(&inputs);
                (live, r, start.elapsed())
            }
            StageSession::Onnx(_) => {
                let (live, r, wall, cpu_s) = tokio::task::spawn_blocking(move || {
                    let mut live = live;
                    let start = Clock::start();
                    let cpu0 = thread_cpu_seconds();
                    let r = match &mut live.session {
                        StageSession::Onnx(s) => s.run(&inputs).map_err(|e| e.to_string()),
                        StageSession::Sim(s) => s.run(&inputs),
                    };
                    (live, r, start.elapsed(), thread_cpu_seconds() - cpu0)
                })
                .await
                .map_err(|e| format!("run task: {e}"))?;
                times.compute_cpu_micros = cpu_micros(cpu_s);
                (live, r, wall)
            }
        };
        self.session = Some(live);
        let outputs = result?;
        let pace = self.straggler.pacing_for(compute);
        if !pace.is_zero() {
            tokio::time::sleep(pace).await;
        }
        let encoding = Clock::start();
        let mut tally = EncodeTally::default();
        // An intermediate stage's outputs stay here (every one by reference, with this node as
        // its holder): the next stage's worker pulls them, the foreman only passes the reference.
        let by_reference_above = if keep_outputs { 0 } else { BY_REFERENCE_ABOVE };
        let mut tensors = encode_tensors_above(&outputs, coding, &self.shelf, &mut tally, by_reference_above)
            .map_err(|e| e.to_string())?;
        if keep_outputs {
            let me = self.link.local_id().as_str().to_owned();
            for t in &mut tensors {
                if let TensorBody::ByRef { blob, len } = t.body {
                    t.body = TensorBody::At { node: me.clone(), blob, len };
                }
            }
        }
        times.encode_micros = micros(encoding.elapsed());
        self.stats.runs += 1;
        times.handled_micros = micros(taken.elapsed());
        Ok(RunReply::Ran(Ran {
            tensors,
            compute_micros: micros(compute),
            paced_micros: micros(pace),
            raw_f32_bytes: tally.raw,
            wire_f32_bytes: tally.wire,
            max_abs_error: tally.max_abs_error,
            times,
        }))
    }
}

/// A cached simulated stage file, checked against its hash (a bad one is removed, as a bad
/// ONNX file is).
fn load_sim(path: &Path, sha256: &str) -> Result<SimStage, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let got = sha256_hex(&bytes);
    if got != sha256 {
        let _ = std::fs::remove_file(path);
        return Err(format!("{}: cached file has SHA-256 {got}; removed it", path.display()));
    }
    SimStage::from_file(&bytes).map_err(|e| format!("{}: {e}", path.display()))
}

/// What a `Run` request asks, besides its tensors.
struct RunTask {
    input: u32,
    stage: u32,
    from: String,
    coding: Coding,
    keep_outputs: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_scheduler_role_may_call_a_worker() {
        let p = Protocol::<PipelineWorker>::of();
        assert!(p.problems().is_empty(), "{:?}", p.problems());
        let rules: Vec<_> = p.rules().collect();
        assert_eq!(rules.len(), 7, "{rules:?}");
        assert!(rules.iter().all(|(_, allow)| *allow == Allow::role(Role::Scheduler)), "{rules:?}");
        assert_eq!(worker_name("w1"), "pipeline-worker/w1");
        crate::typed::validate_name(&worker_name("w1")).unwrap();
    }

    #[test]
    fn cache_listing_keeps_only_hash_named_files() {
        let d = std::env::temp_dir().join(format!("troupe-cache-list-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let h = sha256_hex(b"stage");
        std::fs::write(cached_path(&d, &h), b"stage").unwrap();
        std::fs::write(d.join("notes.onnx"), b"x").unwrap();
        std::fs::write(d.join(format!("{h}.part1")), b"x").unwrap();
        assert_eq!(list_cached(&d), vec![h.clone()]);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn sha256_of_abc_is_the_standard_vector() {
        assert_eq!(sha256_hex(b"abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        let f = std::env::temp_dir().join(format!("troupe-sha-{}", std::process::id()));
        std::fs::write(&f, b"abc").unwrap();
        assert_eq!(sha256_file(&f).unwrap(), sha256_hex(b"abc"));
        std::fs::remove_file(&f).unwrap();
    }

    /// A stage file written in chunks holds exactly the bytes, across a partial last chunk, and
    /// replaces a longer file of the same name.
    #[test]
    fn a_file_written_in_chunks_holds_exactly_the_bytes() {
        let f = std::env::temp_dir().join(format!("troupe-chunks-{}", std::process::id()));
        std::fs::write(&f, vec![7u8; 3 * WRITE_CHUNK_BYTES]).unwrap();
        let bytes: Vec<u8> = (0..2 * WRITE_CHUNK_BYTES + 3).map(|i| (i % 251) as u8).collect();
        write_in_chunks(&f, &bytes).unwrap();
        assert_eq!(std::fs::read(&f).unwrap(), bytes);
        std::fs::remove_file(&f).unwrap();
    }
}

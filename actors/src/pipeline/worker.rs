//! The pipeline worker: a phone-class stage runner holding at most one live ONNX session.
//!
//! It answers the foreman's [`Request`]s one at a time (one ractor_cluster RPC each): stage files
//! are pulled by hash from the foreman and kept in a disk cache (`<sha256>.onnx`, checked against
//! the hash on every load); a `Load` is refused while a session is live, so the foreman must
//! `Unload` first (single-partition residency). Every session is counted process-wide
//! ([`LiveSession`]) and the worker reports the most ever live at once, so the invariant is
//! checked from the worker's own report, not assumed.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use ractor_cluster::RactorMessage;
use sha2::{Digest, Sha256};
use tracing::{info, warn};
use troupe_kernels::onnx::{OnnxSession, SessionConfig, peak_resident_bytes, resident_bytes};
use troupe_transport::{Link, NodeId, QuicNode, Role};

use super::telemetry::{DeviceModel, MemoryLimit, Sampler, Straggler, apply_cpu_quota, apply_memory_limit};
use super::wire::{
    BY_REFERENCE_ABOVE, BlobShelf, Coding, EncodeTally, MAX_MESSAGE_DECODED_BYTES, Moved, Request, Response,
    RunTimes, TensorBody, WireError, WorkerStats, decode_tensors_from, encode_tensors_above,
    request_from_bytes, to_bytes,
};
use crate::mailbox::{CountedSend, Queued};
use crate::service::{Allow, Handler, ServiceSpec, Services};
use troupe_transport::codec::DecodeBudget;

/// Process group every pipeline worker joins (visible cluster-wide).
pub const WORKERS_GROUP: &str = "pipeline-workers";
/// Largest stage file a worker accepts.
pub const MAX_STAGE_BYTES: u64 = 1 << 30;
/// Most cached files listed in a join report.
pub const MAX_CACHED_LISTED: usize = 1024;

static LIVE: AtomicU32 = AtomicU32::new(0);
static MAX_LIVE: AtomicU32 = AtomicU32::new(0);

/// A session counted in the process-wide live count while it exists.
pub struct LiveSession {
    session: OnnxSession,
    stage: u32,
    sha256: String,
}

impl LiveSession {
    fn new(session: OnnxSession, stage: u32, sha256: String) -> Self {
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

/// The worker's one message: an rkyv [`Request`] in, an rkyv [`Response`] out (local: the
/// foreman reaches it through the worker's service handler).
#[derive(RactorMessage)]
pub enum PipelineWorkerMsg {
    /// A request from the foreman, counted in the actor's mailbox depth ([`crate::mailbox`]).
    Call(Vec<u8>, Queued, RpcReplyPort<Vec<u8>>),
}

/// Service names of workers are this prefix plus the worker's node name.
pub const SERVICE_PREFIX: &str = "pipeline-worker/";
/// The worker service's one method: an rkyv [`Request`], answered with an rkyv [`Response`].
pub const CALL: &str = "call";

/// Who may call a worker: the `scheduler` role (the foreman) only.
pub fn spec() -> ServiceSpec {
    ServiceSpec::new().method(CALL, Allow::role(Role::Scheduler))
}

fn handler(actor: ActorRef<PipelineWorkerMsg>) -> Handler {
    Arc::new(move |_caller, _method, body| {
        let actor = actor.clone();
        Box::pin(async move {
            actor
                .call_counted(|queued, reply| PipelineWorkerMsg::Call(body, queued, reply))
                .await
                .map_err(|e| format!("the pipeline worker actor is not running: {e}"))
        })
    })
}

/// Settings of a worker (from its node config).
#[derive(Clone, Debug)]
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
    /// Disk cache of stage files.
    pub cache_dir: PathBuf,
    /// ONNX Runtime intra-op threads.
    pub intra_threads: usize,
}

/// Start arguments: settings plus the node's link and blob shelf.
#[derive(Clone)]
pub struct WorkerArgs {
    /// Settings.
    pub settings: WorkerSettings,
    /// The node's QUIC link (stage and tensor pulls).
    pub link: QuicNode,
    /// What this node serves to peers (large output tensors).
    pub shelf: BlobShelf,
    /// The node's service router (the worker serves `pipeline-worker/NODE` there).
    pub services: Services,
}

/// The worker actor.
pub struct PipelineWorker;

/// Its state.
pub struct WorkerState {
    args: WorkerArgs,
    session: Option<LiveSession>,
    straggler: Straggler,
    memory: MemoryLimit,
    sampler: Sampler,
    stats: WorkerStats,
}

impl Actor for PipelineWorker {
    type Msg = PipelineWorkerMsg;
    type State = WorkerState;
    type Arguments = WorkerArgs;

    async fn pre_start(
        &self,
        me: ActorRef<Self::Msg>,
        args: WorkerArgs,
    ) -> Result<WorkerState, ActorProcessingErr> {
        crate::mailbox::track(&me);
        std::fs::create_dir_all(&args.settings.cache_dir)?;
        crate::allocator::fix_thresholds();
        let straggler = apply_cpu_quota(&args.settings.node, args.settings.cpu_quota_pct);
        let memory = apply_memory_limit(
            &args.settings.node,
            args.settings.ram_budget_bytes,
            args.settings.enforce_ram_budget,
        );
        info!(
            node = %args.settings.node,
            straggler = %straggler.describe(),
            memory = %memory.describe(),
            cache = %args.settings.cache_dir.display(),
            "pipeline worker up"
        );
        let sampler = Sampler::new(args.settings.device, args.settings.ram_budget_bytes);
        ractor::pg::join(WORKERS_GROUP.to_string(), vec![me.get_cell()]);
        let service = format!("{SERVICE_PREFIX}{}", args.settings.node);
        args.services.register(&service, spec(), handler(me.clone()));
        // a (re)started worker holds no session until the foreman loads one
        crate::live::set_stage(&args.settings.node, None);
        Ok(WorkerState { args, session: None, straggler, memory, sampler, stats: WorkerStats::default() })
    }

    async fn handle(
        &self,
        _me: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut WorkerState,
    ) -> Result<(), ActorProcessingErr> {
        let PipelineWorkerMsg::Call(bytes, queued, reply) = msg;
        queued.taken();
        let taken = Instant::now();
        let response = match request_from_bytes(&bytes) {
            Ok(req) => state.serve(req, taken).await.unwrap_or_else(Response::Error),
            Err(e) => Response::Error(e.to_string()),
        };
        crate::live::set_stage(&state.args.settings.node, state.session.as_ref().map(|l| l.stage));
        if let Response::Error(e) = &response {
            warn!(node = %state.args.settings.node, error = %e, "request failed");
        }
        let encoded = to_bytes("response", &response)
            .or_else(|e| to_bytes("response", &Response::Error(e.to_string())))?;
        let _ = reply.send(encoded);
        Ok(())
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
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

impl WorkerState {
    /// Answers one request, taken from the mailbox at `taken`.
    async fn serve(&mut self, req: Request, taken: Instant) -> Result<Response, String> {
        let s = &self.args.settings;
        match req {
            Request::Join => Ok(Response::Joined {
                node: s.node.clone(),
                pid: std::process::id(),
                cached: list_cached(&s.cache_dir),
                live: self.session.as_ref().map(|l| l.sha256.clone()),
                straggler: format!("{}; {}", self.straggler.describe(), self.memory.describe()),
                telemetry: self.sampler.sample(),
            }),
            Request::Telemetry => Ok(Response::Telemetry(self.sampler.sample())),
            Request::Stats => {
                let mut stats = self.stats;
                stats.max_live_sessions = max_live_sessions();
                stats.peak_rss_bytes = peak_resident_bytes().unwrap_or(0);
                Ok(Response::Stats(stats))
            }
            Request::Fetch { stage, sha256, blob, size, from } => {
                self.fetch(stage, sha256, blob, size, from).await
            }
            Request::Load { stage, sha256 } => self.load(stage, sha256).await,
            Request::Unload => {
                if self.session.take().is_some() {
                    self.stats.unloads += 1;
                    crate::allocator::release_free_memory();
                }
                Ok(Response::Unloaded)
            }
            Request::Run { input, stage, tensors, from, lossy_bf16, compress, keep_outputs } => {
                let times = RunTimes { request_micros: micros(taken.elapsed()), ..RunTimes::default() };
                let task =
                    RunTask { input, stage, from, coding: Coding { lossy_bf16, compress }, keep_outputs };
                self.run(task, tensors, taken, times).await
            }
        }
    }

    async fn fetch(
        &mut self,
        stage: u32,
        sha256: String,
        blob: [u8; 32],
        size: u64,
        from: String,
    ) -> Result<Response, String> {
        if !troupe_policy::pipeline::chain::is_sha256_hex(&sha256) {
            return Err(format!("stage {stage}: {sha256:?} is not a SHA-256"));
        }
        if size > MAX_STAGE_BYTES {
            return Err(format!("stage {stage}: {size} bytes is above the {MAX_STAGE_BYTES}-byte cap"));
        }
        let path = cached_path(&self.args.settings.cache_dir, &sha256);
        if path.is_file() {
            return Ok(Response::Fetched { cached: true, micros: 0 });
        }
        let start = Instant::now();
        let cap = u32::try_from(size).map_err(|_| format!("stage {stage}: size {size} too large"))?;
        let bytes = self
            .args
            .link
            .fetch_blob(&NodeId::new(&from), blob, cap)
            .await
            .map_err(|e| format!("pulling stage {stage} from {from}: {e}"))?;
        let got = sha256_hex(&bytes);
        if got != sha256 {
            return Err(format!("stage {stage} from {from}: SHA-256 {got} does not match {sha256}"));
        }
        let tmp = path.with_extension(format!("part{}", std::process::id()));
        std::fs::write(&tmp, &bytes).map_err(|e| format!("writing {}: {e}", tmp.display()))?;
        std::fs::rename(&tmp, &path).map_err(|e| format!("renaming into {}: {e}", path.display()))?;
        drop(bytes);
        crate::allocator::release_free_memory();
        self.stats.pulls += 1;
        Ok(Response::Fetched { cached: false, micros: micros(start.elapsed()) })
    }

    async fn load(&mut self, stage: u32, sha256: String) -> Result<Response, String> {
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
        let path = cached_path(&self.args.settings.cache_dir, &sha256);
        let threads = self.args.settings.intra_threads;
        let start = Instant::now();
        let hash = sha256.clone();
        let session = tokio::task::spawn_blocking(move || -> Result<OnnxSession, String> {
            // Hash the file as it streams (no copy of it stays in memory), then let ONNX Runtime
            // read it: the process then holds what one session needs, nothing more.
            let got = sha256_file(&path)?;
            if got != sha256 {
                let _ = std::fs::remove_file(&path);
                return Err(format!("{}: cached file has SHA-256 {got}; removed it", path.display()));
            }
            // Large initializers memory-mapped: a stage holding the word-embedding table keeps
            // only the rows its inputs touch resident (see `troupe_kernels::onnx::mapped`).
            OnnxSession::from_file_mapped(&path, &SessionConfig { intra_threads: threads })
                .map_err(|e| e.to_string())
        })
        .await
        .map_err(|e| format!("load task: {e}"))??;
        self.session = Some(LiveSession::new(session, stage, hash));
        self.stats.loads += 1;
        Ok(Response::Loaded { micros: micros(start.elapsed()), rss_bytes: resident_bytes().unwrap_or(0) })
    }

    async fn run(
        &mut self,
        task: RunTask,
        tensors: Vec<super::wire::WireNamed>,
        taken: Instant,
        mut times: RunTimes,
    ) -> Result<Response, String> {
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
        let fetched = Instant::now();
        let decoded = decode_tensors_from(
            tensors,
            &self.args.link,
            &from,
            Some(&self.args.shelf),
            &mut budget,
            &mut moved,
        )
        .await;
        let inputs = match decoded {
            Ok(t) => t,
            Err(e) => {
                self.session = Some(live);
                return match e {
                    WireError::Pull { ref from, .. } if from != self.args.link.local_id().as_str() => {
                        Ok(Response::PullFailed { node: from.clone(), detail: e.to_string() })
                    }
                    e => Err(e.to_string()),
                };
            }
        };
        times.inputs_micros = micros(fetched.elapsed());
        times.pulled_bytes = moved.pulled;
        times.local_bytes = moved.local;
        times.inline_f32_bytes = moved.inline_f32;
        let (live, result, compute) = tokio::task::spawn_blocking(move || {
            let mut live = live;
            let start = Instant::now();
            let r = live.session.run(&inputs);
            (live, r, start.elapsed())
        })
        .await
        .map_err(|e| format!("run task: {e}"))?;
        self.session = Some(live);
        let outputs = result.map_err(|e| e.to_string())?;
        let pace = self.straggler.pacing_for(compute);
        if !pace.is_zero() {
            tokio::time::sleep(pace).await;
        }
        let encoding = Instant::now();
        let mut tally = EncodeTally::default();
        // An intermediate stage's outputs stay here (every one by reference, with this node as
        // its holder): the next stage's worker pulls them, the foreman only passes the reference.
        let by_reference_above = if keep_outputs { 0 } else { BY_REFERENCE_ABOVE };
        let mut tensors =
            encode_tensors_above(&outputs, coding, &self.args.shelf, &mut tally, by_reference_above)
                .map_err(|e| e.to_string())?;
        if keep_outputs {
            let me = self.args.link.local_id().as_str().to_owned();
            for t in &mut tensors {
                if let TensorBody::ByRef { blob, len } = t.body {
                    t.body = TensorBody::At { node: me.clone(), blob, len };
                }
            }
        }
        times.encode_micros = micros(encoding.elapsed());
        self.stats.runs += 1;
        times.handled_micros = micros(taken.elapsed());
        Ok(Response::Ran {
            tensors,
            compute_micros: micros(compute),
            paced_micros: micros(pace),
            raw_f32_bytes: tally.raw,
            wire_f32_bytes: tally.wire,
            max_abs_error: tally.max_abs_error,
            times,
        })
    }
}

/// What a `Run` request asks, besides its tensors.
struct RunTask {
    input: u32,
    stage: u32,
    from: String,
    coding: Coding,
    keep_outputs: bool,
}

/// Builds the start arguments and installs the shelf as the node's blob server.
pub fn worker_args(settings: WorkerSettings, link: &QuicNode, services: &Services) -> WorkerArgs {
    let shelf = BlobShelf::default();
    link.set_blob_server(Arc::new(shelf.clone()));
    WorkerArgs { settings, link: link.clone(), shelf, services: services.clone() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_scheduler_role_may_call_a_worker() {
        assert_eq!(spec().allow(CALL), Some(Allow::role(Role::Scheduler)));
        assert_eq!(spec().allow("load"), None);
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
}

//! The distributed shells: a `coe-executor` actor on each executor node, reached over the
//! cluster (ractor_cluster RPC over QUIC), and the links the scheduler node drives them through.
//!
//! One RPC, [`CoeExecMsg::Call`], carries an encoded [`Cmd`] and returns an encoded result, so the
//! wire payload is two byte vectors whose layout this module owns and parses defensively (length
//! caps before allocation, errors that name the problem). A failed or timed-out call, or the
//! executor's node going down in the membership view, becomes [`Event::Lost`]: the scheduler
//! requeues that executor's queued and in-flight work on the survivors.

use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, RpcReplyPort};
use ractor_cluster::RactorClusterMessage;
use troupe_kernels::assets::Digits;
use troupe_policy::coe::{BatchId, ExpertId, LatencyModel, RequestId};

use super::CoeError;
use super::app::App;
use super::executor::ExpertExecutor;
use super::profiler::load_profile;
use super::runner::{Cmd, Event, execute};

/// Process group the executor actors join (visible cluster-wide).
pub const EXECUTORS_GROUP: &str = "coe-executors";
/// Most requests one batch message may carry.
pub const MAX_BATCH_WIRE: usize = 65_536;
/// Widest output row accepted back.
pub const MAX_ROW_WIRE: usize = 65_536;

/// Messages of a `coe-executor` actor (serialisable: they cross nodes).
#[derive(RactorClusterMessage)]
pub enum CoeExecMsg {
    /// Who are you: replies `<executor name> <node name>`.
    #[rpc]
    Hello(String, RpcReplyPort<String>),
    /// Carry out an encoded [`Cmd`]; replies with an encoded outcome.
    #[rpc]
    Call(Vec<u8>, RpcReplyPort<Vec<u8>>),
}

/// Arguments of the executor actor.
#[derive(Clone, Debug)]
pub struct ExecutorArgs {
    /// The app folder (manifest, store, trace, profile).
    pub dir: PathBuf,
    /// The executor's name in the profile.
    pub executor: String,
    /// This node's name.
    pub node: String,
}

/// State of a running executor actor.
pub struct ExecutorState {
    args: ExecutorArgs,
    executor: ExpertExecutor,
    digits: Digits,
}

/// The executor actor: owns an [`ExpertExecutor`] and serves [`CoeExecMsg`].
pub struct CoeExecutorActor;

/// Open the app and the executor named `args.executor` with the profile's budget.
pub fn open_executor(args: &ExecutorArgs) -> Result<ExecutorState, CoeError> {
    let app = App::open(&args.dir, None)?;
    let profile = load_profile(&args.dir.join("profile.txt"))?;
    let latency = LatencyModel::from_profile(&profile).map_err(|e| CoeError::Invalid(e.to_string()))?;
    let index = (0..latency.executors())
        .find(|&i| latency.name(i) == args.executor)
        .ok_or_else(|| CoeError::Invalid(format!("executor {} is not in the profile", args.executor)))?;
    let executor = ExpertExecutor::open(
        &args.executor,
        &app.store_dir(),
        &app.manifest,
        &app.trace.model,
        latency.expert_budget(index),
    )?;
    Ok(ExecutorState { args: args.clone(), executor, digits: app.digits })
}

impl Actor for CoeExecutorActor {
    type Msg = CoeExecMsg;
    type State = ExecutorState;
    type Arguments = ExecutorArgs;

    async fn pre_start(
        &self,
        me: ActorRef<Self::Msg>,
        args: ExecutorArgs,
    ) -> Result<ExecutorState, ActorProcessingErr> {
        let state = tokio::task::block_in_place(|| open_executor(&args))?;
        ractor::pg::join(EXECUTORS_GROUP.to_string(), vec![me.get_cell()]);
        tracing::info!(executor = %args.executor, node = %args.node, "coe executor ready");
        Ok(state)
    }

    async fn handle(
        &self,
        _me: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut ExecutorState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            CoeExecMsg::Hello(_, reply) => {
                let _ = reply.send(format!("{} {}", state.args.executor, state.args.node));
            }
            CoeExecMsg::Call(bytes, reply) => {
                let outcome = tokio::task::block_in_place(|| {
                    let cmd = decode_cmd(&bytes)?;
                    execute(0, &mut state.executor, &state.digits, cmd)
                });
                let _ = reply.send(encode_outcome(&outcome));
                if let Err(e) = outcome {
                    tracing::error!(executor = %state.args.executor, "{e}");
                }
            }
        }
        Ok(())
    }
}

// ---- wire format -------------------------------------------------------------------------

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// A cursor over untrusted bytes.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], CoeError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len()).ok_or_else(|| {
            CoeError::Invalid(format!(
                "coe wire: truncated at {what} (offset {}, {} bytes)",
                self.at,
                self.bytes.len()
            ))
        })?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self, what: &str) -> Result<u8, CoeError> {
        Ok(self.take(1, what)?[0])
    }
    fn u64(&mut self, what: &str) -> Result<u64, CoeError> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8, what)?);
        Ok(u64::from_le_bytes(b))
    }
    fn count(&mut self, cap: usize, what: &str) -> Result<usize, CoeError> {
        let n = self.u64(what)?;
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= cap)
            .ok_or_else(|| CoeError::Invalid(format!("coe wire: {what} {n} over the cap of {cap}")))
    }
}

/// Encode a command: tag (0 load, 1 evict, 2 run), expert, then for a run the batch id and
/// (request, image) pairs.
pub fn encode_cmd(cmd: &Cmd) -> Vec<u8> {
    let mut out = Vec::new();
    match cmd {
        Cmd::Load(e) => {
            out.push(0);
            put_u64(&mut out, u64::from(e.0));
        }
        Cmd::Evict(e) => {
            out.push(1);
            put_u64(&mut out, u64::from(e.0));
        }
        Cmd::Reset => {
            out.push(3);
            put_u64(&mut out, 0);
        }
        Cmd::Run { batch, expert, requests } => {
            out.push(2);
            put_u64(&mut out, u64::from(expert.0));
            put_u64(&mut out, batch.0);
            put_u64(&mut out, requests.len() as u64);
            for (r, img) in requests {
                put_u64(&mut out, r.0);
                put_u64(&mut out, *img);
            }
        }
    }
    out
}

/// Decode a command (untrusted bytes).
pub fn decode_cmd(bytes: &[u8]) -> Result<Cmd, CoeError> {
    let mut r = Reader { bytes, at: 0 };
    let tag = r.u8("tag")?;
    let expert = u32::try_from(r.u64("expert")?)
        .map_err(|_| CoeError::Invalid("coe wire: expert id over u32".into()))?;
    let expert = ExpertId(expert);
    let cmd = match tag {
        0 => Cmd::Load(expert),
        1 => Cmd::Evict(expert),
        3 => Cmd::Reset,
        2 => {
            let batch = BatchId(r.u64("batch")?);
            let n = r.count(MAX_BATCH_WIRE, "batch size")?;
            let mut requests = Vec::with_capacity(n);
            for _ in 0..n {
                requests.push((RequestId(r.u64("request")?), r.u64("image")?));
            }
            Cmd::Run { batch, expert, requests }
        }
        t => return Err(CoeError::Invalid(format!("coe wire: unknown command tag {t}"))),
    };
    if r.at != bytes.len() {
        return Err(CoeError::Invalid(format!("coe wire: {} trailing bytes", bytes.len() - r.at)));
    }
    Ok(cmd)
}

/// Encode an outcome: 0 = error (utf-8 message), 1 = done (eviction), 2 = loaded (seconds,
/// resident bytes), 3 = ran (seconds, rows).
pub fn encode_outcome(outcome: &Result<Option<Event>, CoeError>) -> Vec<u8> {
    let mut out = Vec::new();
    match outcome {
        Err(e) => {
            out.push(0);
            out.extend_from_slice(e.to_string().as_bytes());
        }
        Ok(None) | Ok(Some(Event::Lost { .. } | Event::Failed(_))) => out.push(1),
        Ok(Some(Event::Loaded { seconds, resident, .. })) => {
            out.push(2);
            put_u64(&mut out, seconds.to_bits());
            put_u64(&mut out, *resident);
        }
        Ok(Some(Event::Reset { evicted, .. })) => {
            out.push(4);
            put_u64(&mut out, *evicted as u64);
        }
        Ok(Some(Event::Ran { rows, seconds, .. })) => {
            out.push(3);
            put_u64(&mut out, seconds.to_bits());
            put_u64(&mut out, rows.len() as u64);
            for (r, row) in rows {
                put_u64(&mut out, r.0);
                put_u64(&mut out, row.len() as u64);
                for v in row {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
        }
    }
    out
}

/// Decode an outcome for the command `cmd` sent to executor `exec` (untrusted bytes).
pub fn decode_outcome(exec: usize, cmd: &Cmd, bytes: &[u8]) -> Result<Option<Event>, CoeError> {
    let mut r = Reader { bytes, at: 0 };
    let ev = match (r.u8("outcome")?, cmd) {
        (0, _) => {
            return Err(CoeError::Invalid(format!(
                "remote executor: {}",
                String::from_utf8_lossy(&bytes[1..])
            )));
        }
        (1, Cmd::Evict(_)) => None,
        (4, Cmd::Reset) => Some(Event::Reset { exec, evicted: r.count(usize::MAX, "evicted")? }),
        (2, Cmd::Load(expert)) => Some(Event::Loaded {
            exec,
            expert: *expert,
            seconds: f64::from_bits(r.u64("seconds")?),
            resident: r.u64("resident")?,
        }),
        (3, Cmd::Run { batch, expert, requests }) => {
            let seconds = f64::from_bits(r.u64("seconds")?);
            let n = r.count(MAX_BATCH_WIRE, "rows")?;
            if n != requests.len() {
                return Err(CoeError::Invalid(format!(
                    "remote executor: {n} rows for {} requests",
                    requests.len()
                )));
            }
            let mut rows = Vec::with_capacity(n);
            for _ in 0..n {
                let id = RequestId(r.u64("request")?);
                let w = r.count(MAX_ROW_WIRE, "row width")?;
                let raw = r.take(w * 4, "row")?;
                let row = raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
                rows.push((id, row));
            }
            Some(Event::Ran { exec, batch: *batch, expert: *expert, rows, seconds })
        }
        (tag, _) => {
            return Err(CoeError::Invalid(format!("coe wire: outcome tag {tag} does not answer {cmd:?}")));
        }
    };
    if r.at != bytes.len() {
        return Err(CoeError::Invalid(format!("coe wire: {} trailing bytes", bytes.len() - r.at)));
    }
    Ok(ev)
}

// ---- scheduler side ----------------------------------------------------------------------

/// A remote executor the scheduler found: its profile name, its node, its actor.
#[derive(Clone, Debug)]
pub struct RemoteExecutor {
    /// Name in the profile.
    pub name: String,
    /// Node it runs on.
    pub node: String,
    /// Its actor.
    pub cell: ActorCell,
}

/// Wait until every executor in `names` has joined the group and said hello.
pub async fn find_executors(names: &[String], deadline: Instant) -> Result<Vec<RemoteExecutor>, CoeError> {
    loop {
        let mut found: Vec<Option<RemoteExecutor>> = vec![None; names.len()];
        for cell in ractor::pg::get_members(&EXECUTORS_GROUP.to_string()) {
            let actor: ActorRef<CoeExecMsg> = cell.clone().into();
            if let Ok(hello) = ractor::call_t!(actor, CoeExecMsg::Hello, 2_000, String::new()) {
                let mut parts = hello.split_whitespace();
                if let (Some(name), Some(node)) = (parts.next(), parts.next())
                    && let Some(i) = names.iter().position(|n| n == name)
                {
                    found[i] = Some(RemoteExecutor { name: name.to_string(), node: node.to_string(), cell });
                }
            }
        }
        if found.iter().all(Option::is_some) {
            return Ok(found.into_iter().flatten().collect());
        }
        if Instant::now() > deadline {
            let missing: Vec<&String> =
                names.iter().zip(&found).filter(|(_, f)| f.is_none()).map(|(n, _)| n).collect();
            return Err(CoeError::Invalid(format!("executors {missing:?} did not join within the deadline")));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Start one link task per executor: commands go out in order as RPCs; results, failures and
/// timeouts come back as events. Returns the senders the driver uses.
pub fn spawn_links(
    executors: &[RemoteExecutor],
    events: mpsc::Sender<Event>,
    call_timeout: Duration,
) -> Vec<tokio::sync::mpsc::UnboundedSender<Cmd>> {
    let mut senders = Vec::with_capacity(executors.len());
    for (exec, x) in executors.iter().enumerate() {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Cmd>();
        let actor: ActorRef<CoeExecMsg> = x.cell.clone().into();
        let events = events.clone();
        let ms = u64::try_from(call_timeout.as_millis()).unwrap_or(u64::MAX);
        tokio::spawn(async move {
            while let Some(cmd) = rx.recv().await {
                let outcome = match ractor::call_t!(actor, CoeExecMsg::Call, ms, encode_cmd(&cmd)) {
                    Ok(bytes) => decode_outcome(exec, &cmd, &bytes),
                    Err(e) => {
                        let _ = events.send(Event::Lost { exec, why: format!("call failed: {e}") });
                        return;
                    }
                };
                let sent = match outcome {
                    Ok(Some(ev)) => events.send(ev),
                    Ok(None) => Ok(()),
                    Err(e) => events.send(Event::Failed(e)),
                };
                if sent.is_err() {
                    return;
                }
            }
        });
        senders.push(tx);
    }
    senders
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_round_trip_and_garbage_is_refused() {
        let cmds = [
            Cmd::Load(ExpertId(7)),
            Cmd::Evict(ExpertId(0)),
            Cmd::Run {
                batch: BatchId(9),
                expert: ExpertId(3),
                requests: vec![(RequestId(1), 5), (RequestId(2), 6)],
            },
        ];
        for c in &cmds {
            assert_eq!(&decode_cmd(&encode_cmd(c)).unwrap(), c);
        }
        let run = encode_cmd(&cmds[2]);
        let err = decode_cmd(&run[..run.len() - 3]).unwrap_err().to_string();
        assert!(err.contains("truncated"), "{err}");
        let mut huge = vec![2u8];
        huge.extend_from_slice(&3u64.to_le_bytes());
        huge.extend_from_slice(&9u64.to_le_bytes());
        huge.extend_from_slice(&u64::MAX.to_le_bytes());
        let err = decode_cmd(&huge).unwrap_err().to_string();
        assert!(err.contains("over the cap"), "{err}");
        assert!(decode_cmd(&[9, 0, 0, 0, 0, 0, 0, 0, 0]).is_err());
    }

    #[test]
    fn outcomes_round_trip_for_their_command() {
        let run = Cmd::Run { batch: BatchId(4), expert: ExpertId(2), requests: vec![(RequestId(8), 1)] };
        let ev = Event::Ran {
            exec: 1,
            batch: BatchId(4),
            expert: ExpertId(2),
            rows: vec![(RequestId(8), vec![0.25, 0.75])],
            seconds: 0.5,
        };
        match decode_outcome(1, &run, &encode_outcome(&Ok(Some(ev)))).unwrap() {
            Some(Event::Ran { rows, seconds, .. }) => {
                assert_eq!(rows, vec![(RequestId(8), vec![0.25, 0.75])]);
                assert_eq!(seconds, 0.5);
            }
            other => panic!("{other:?}"),
        }
        let load = Cmd::Load(ExpertId(2));
        let ev = Event::Loaded { exec: 0, expert: ExpertId(2), seconds: 0.1, resident: 4096 };
        assert!(matches!(
            decode_outcome(0, &load, &encode_outcome(&Ok(Some(ev)))).unwrap(),
            Some(Event::Loaded { resident: 4096, .. })
        ));
        // An answer that does not fit the question is refused; a remote error is passed on.
        let ev = Event::Loaded { exec: 0, expert: ExpertId(2), seconds: 0.1, resident: 1 };
        assert!(decode_outcome(0, &run, &encode_outcome(&Ok(Some(ev)))).is_err());
        let err = decode_outcome(0, &load, &encode_outcome(&Err(CoeError::Invalid("disk on fire".into()))))
            .unwrap_err()
            .to_string();
        assert!(err.contains("disk on fire"), "{err}");
    }
}

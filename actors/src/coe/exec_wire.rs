//! The wire form of the CoE executor actor: its messages, who may send them, and the rkyv
//! types of commands and replies, with the bounds a receiver checks on each (see
//! [`check_run`], [`event_of`]).

use troupe_policy::coe::{BatchId, ExpertId, RequestId};
use troupe_transport::Role;

use super::CoeError;
use super::app::INPUT_WIDTH;
use super::runner::{Cmd, Event};
use crate::service::Allow;
use crate::typed::RemoteMessage;

/// Executors are named this prefix plus their profile name.
pub const NAME_PREFIX: &str = "coe-executor/";
/// Message name: load an expert.
pub const LOAD: &str = "load";
/// Message name: evict an expert.
pub const EVICT: &str = "evict";
/// Message name: run a batch.
pub const RUN: &str = "run";
/// Message name: evict everything.
pub const RESET: &str = "reset";
/// Message name: who are you.
pub const HELLO: &str = "hello";
/// Most requests one batch may carry.
pub const MAX_BATCH_WIRE: usize = 65_536;
/// Most host-resident experts a reset may report.
pub const MAX_HOST_WIRE: usize = 65_536;
/// Widest output row accepted back.
pub const MAX_ROW_WIRE: usize = 65_536;

/// The actor name of executor `executor`.
pub fn actor_name(executor: &str) -> String {
    format!("{NAME_PREFIX}{executor}")
}

/// Who may send what: load, evict, run and reset only the `scheduler` role; hello any member.
pub fn allow(message: &str) -> Allow {
    if message == HELLO { Allow::AnyMember } else { Allow::role(Role::Scheduler) }
}

/// Loads an expert; answered with [`WireLoaded`].
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct Load {
    /// The expert.
    pub expert: u32,
}

impl RemoteMessage for Load {
    const NAME: &'static str = LOAD;
    type Reply = WireLoaded;
}

/// Evicts an expert.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct Evict {
    /// The expert.
    pub expert: u32,
}

impl RemoteMessage for Evict {
    const NAME: &'static str = EVICT;
    type Reply = ();
}

/// Evicts everything (a restarted scheduler starts from empty executors); answered with
/// [`WireReset`].
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reset;

impl RemoteMessage for Reset {
    const NAME: &'static str = RESET;
    type Reply = WireReset;
}

/// Asks an executor who it is; answered with [`HelloReply`].
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello;

impl RemoteMessage for Hello {
    const NAME: &'static str = HELLO;
    type Reply = HelloReply;
}

impl RemoteMessage for WireRun {
    const NAME: &'static str = RUN;
    type Reply = WireRan;
}

/// One request of a batch.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub struct WireRequest {
    /// Request id.
    pub request: u64,
    /// Its input: exactly [`INPUT_WIDTH`] floats.
    pub pixels: Vec<f32>,
}

/// Runs a batch; answered with [`WireRan`].
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub struct WireRun {
    /// The batch.
    pub batch: u64,
    /// The expert.
    pub expert: u32,
    /// The requests.
    pub requests: Vec<WireRequest>,
}

/// One output row.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub struct WireRow {
    /// Request id.
    pub request: u64,
    /// The expert's output for it.
    pub values: Vec<f32>,
}

/// A finished load.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Copy, Debug, PartialEq)]
pub struct WireLoaded {
    /// Time it took.
    pub seconds: f64,
    /// Bytes of experts the executor holds now.
    pub resident: u64,
}

/// A finished batch.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub struct WireRan {
    /// Time it took.
    pub seconds: f64,
    /// One row per request.
    pub rows: Vec<WireRow>,
}

/// What a reset left: how many experts it evicted and what the host tier holds now.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct WireReset {
    /// Experts evicted from the device.
    pub evicted: u64,
    /// The host tier's budget, bytes.
    pub host_budget: u64,
    /// Experts in the host tier afterwards, by id.
    pub host: Vec<u32>,
}

/// Answer to [`HELLO`].
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct HelloReply {
    /// The executor's profile name.
    pub executor: String,
    /// Its node.
    pub node: String,
}

/// Checks a batch from a peer against the caps and the input width; the command it asks for.
pub fn check_run(run: WireRun) -> Result<Cmd, String> {
    if run.requests.len() > MAX_BATCH_WIRE {
        return Err(format!("batch of {} requests exceeds the cap of {MAX_BATCH_WIRE}", run.requests.len()));
    }
    if let Some(r) = run.requests.iter().find(|r| r.pixels.len() != INPUT_WIDTH) {
        return Err(format!(
            "request {} carries {} input floats, not {INPUT_WIDTH}",
            r.request,
            r.pixels.len()
        ));
    }
    Ok(Cmd::Run {
        batch: BatchId(run.batch),
        expert: ExpertId(run.expert),
        requests: run.requests.into_iter().map(|r| (RequestId(r.request), r.pixels)).collect(),
    })
}

/// The batch that carries `cmd`'s requests.
pub fn run_of(batch: BatchId, expert: ExpertId, requests: &[(RequestId, Vec<f32>)]) -> WireRun {
    WireRun {
        batch: batch.0,
        expert: expert.0,
        requests: requests.iter().map(|(r, px)| WireRequest { request: r.0, pixels: px.clone() }).collect(),
    }
}

/// A reply from executor `exec` (untrusted) as the event it stands for: the answer must fit the
/// question and the caps.
pub fn event_of(exec: usize, cmd: &Cmd, reply: Reply) -> Result<Option<Event>, CoeError> {
    let bad = |e: String| CoeError::Invalid(format!("remote executor {exec}: {e}"));
    match (reply, cmd) {
        (Reply::Evicted, Cmd::Evict(_)) => Ok(None),
        (Reply::Reset(r), Cmd::Reset) => {
            if r.host.len() > MAX_HOST_WIRE {
                return Err(bad(format!(
                    "a reset reports {} host experts, over the cap of {MAX_HOST_WIRE}",
                    r.host.len()
                )));
            }
            Ok(Some(Event::Reset {
                exec,
                evicted: usize::try_from(r.evicted).unwrap_or(usize::MAX),
                host_budget: r.host_budget,
                host: r.host.into_iter().map(ExpertId).collect(),
            }))
        }
        (Reply::Loaded(l), Cmd::Load(expert)) => {
            Ok(Some(Event::Loaded { exec, expert: *expert, seconds: l.seconds, resident: l.resident }))
        }
        (Reply::Ran(ran), Cmd::Run { batch, expert, requests }) => {
            if ran.rows.len() != requests.len() {
                return Err(bad(format!("{} rows for {} requests", ran.rows.len(), requests.len())));
            }
            if let Some(w) = ran.rows.iter().map(|r| r.values.len()).find(|w| *w > MAX_ROW_WIRE) {
                return Err(bad(format!("row of width {w} exceeds the cap of {MAX_ROW_WIRE}")));
            }
            let rows = ran.rows.into_iter().map(|r| (RequestId(r.request), r.values)).collect();
            Ok(Some(Event::Ran { exec, batch: *batch, expert: *expert, rows, seconds: ran.seconds }))
        }
        (_, cmd) => Err(bad(format!("the reply does not answer {cmd:?}"))),
    }
}

/// A reply of any of the executor's commands.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// To [`Evict`].
    Evicted,
    /// To [`Load`].
    Loaded(WireLoaded),
    /// To a [`WireRun`].
    Ran(WireRan),
    /// To [`Reset`].
    Reset(WireReset),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_is_checked_against_its_caps_and_the_input_width() {
        let ok = run_of(BatchId(9), ExpertId(3), &[(RequestId(1), vec![0.5; INPUT_WIDTH])]);
        assert!(matches!(check_run(ok), Ok(Cmd::Run { batch: BatchId(9), .. })));
        let huge = WireRun {
            batch: 1,
            expert: 1,
            requests: vec![WireRequest { request: 0, pixels: Vec::new() }; MAX_BATCH_WIRE + 1],
        };
        assert!(check_run(huge).unwrap_err().contains("exceeds the cap"));
        let narrow = WireRun {
            batch: 1,
            expert: 1,
            requests: vec![WireRequest { request: 3, pixels: vec![0.0; 63] }],
        };
        let err = check_run(narrow).unwrap_err();
        assert!(err.contains("request 3 carries 63 input floats, not 64"), "{err}");
    }

    #[test]
    fn only_the_scheduler_role_may_command_an_executor() {
        for m in [LOAD, EVICT, RUN, RESET] {
            assert_eq!(allow(m), Allow::role(Role::Scheduler), "{m}");
        }
        assert_eq!(allow(HELLO), Allow::AnyMember);
    }

    #[test]
    fn replies_must_answer_their_command() {
        let run = Cmd::Run {
            batch: BatchId(4),
            expert: ExpertId(2),
            requests: vec![(RequestId(8), vec![0.0; INPUT_WIDTH])],
        };
        let ran = Reply::Ran(WireRan {
            seconds: 0.5,
            rows: vec![WireRow { request: 8, values: vec![0.25, 0.75] }],
        });
        match event_of(1, &run, ran).unwrap() {
            Some(Event::Ran { rows, seconds, .. }) => {
                assert_eq!(rows, vec![(RequestId(8), vec![0.25, 0.75])]);
                assert_eq!(seconds, 0.5);
            }
            other => panic!("{other:?}"),
        }
        let load = Cmd::Load(ExpertId(2));
        let loaded = Reply::Loaded(WireLoaded { seconds: 0.1, resident: 4096 });
        assert!(matches!(
            event_of(0, &load, loaded.clone()).unwrap(),
            Some(Event::Loaded { resident: 4096, .. })
        ));
        let err = event_of(0, &run, loaded).unwrap_err().to_string();
        assert!(err.contains("does not answer"), "{err}");
        let two_rows = Reply::Ran(WireRan { seconds: 0.1, rows: vec![] });
        assert!(event_of(0, &run, two_rows).unwrap_err().to_string().contains("0 rows for 1 requests"));
        let reset = Reply::Reset(WireReset { evicted: 3, host_budget: 77, host: vec![4, 9] });
        match event_of(2, &Cmd::Reset, reset).unwrap() {
            Some(Event::Reset { exec: 2, evicted: 3, host_budget: 77, host }) => {
                assert_eq!(host, vec![ExpertId(4), ExpertId(9)])
            }
            other => panic!("{other:?}"),
        }
        let flood = Reply::Reset(WireReset { evicted: 0, host_budget: 0, host: vec![0; MAX_HOST_WIRE + 1] });
        assert!(event_of(2, &Cmd::Reset, flood).unwrap_err().to_string().contains("over the cap"));
    }
}

//! The wire form of the CoE executor service: its name, methods, who may call them, and the
//! rkyv types of command bodies and outcomes (checked access, bounds checked on the archived
//! form before anything is copied out).

use troupe_policy::coe::{BatchId, ExpertId, RequestId};
use troupe_transport::Role;

use super::CoeError;
use super::app::INPUT_WIDTH;
use super::runner::{Cmd, Event};
use crate::service::{Allow, ServiceSpec, to_body, with_archived};

/// Service names of executors are this prefix plus the executor's profile name.
pub const SERVICE_PREFIX: &str = "coe-executor/";
/// Method: load an expert (body [`WireExpert`]).
pub const LOAD: &str = "load";
/// Method: evict an expert (body [`WireExpert`]).
pub const EVICT: &str = "evict";
/// Method: run a batch (body [`WireRun`]).
pub const RUN: &str = "run";
/// Method: evict everything (empty body; answers [`WireOutcome::Reset`]).
pub const RESET: &str = "reset";
/// Method: who are you (empty body, answers [`HelloReply`]).
pub const HELLO: &str = "hello";
/// Most requests one batch may carry.
pub const MAX_BATCH_WIRE: usize = 65_536;
/// Most host-resident experts a reset may report.
pub const MAX_HOST_WIRE: usize = 65_536;
/// Widest output row accepted back.
pub const MAX_ROW_WIRE: usize = 65_536;

/// The service name of executor `executor`.
pub fn service_name(executor: &str) -> String {
    format!("{SERVICE_PREFIX}{executor}")
}

/// Who may call what: load, evict and run only the `scheduler` role; hello any member.
pub fn spec() -> ServiceSpec {
    let scheduler = Allow::role(Role::Scheduler);
    ServiceSpec::new()
        .method(LOAD, scheduler)
        .method(EVICT, scheduler)
        .method(RUN, scheduler)
        .method(RESET, scheduler)
        .method(HELLO, Allow::AnyMember)
}

/// Body of [`LOAD`] and [`EVICT`].
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct WireExpert {
    /// The expert.
    pub expert: u32,
}

/// One request of a batch.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub struct WireRequest {
    /// Request id.
    pub request: u64,
    /// Its input: exactly [`INPUT_WIDTH`] floats.
    pub pixels: Vec<f32>,
}

/// Body of [`RUN`].
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

/// What a command did.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub enum WireOutcome {
    /// An eviction finished.
    Done,
    /// A load finished.
    Loaded(WireLoaded),
    /// A batch finished.
    Ran(WireRan),
    /// A reset finished.
    Reset(WireReset),
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

/// The method and body that carry `cmd`.
pub fn request(cmd: &Cmd) -> Result<(&'static str, Vec<u8>), String> {
    Ok(match cmd {
        Cmd::Load(e) => (LOAD, to_body(&WireExpert { expert: e.0 })?),
        Cmd::Evict(e) => (EVICT, to_body(&WireExpert { expert: e.0 })?),
        Cmd::Reset => (RESET, Vec::new()),
        Cmd::Run { batch, expert, requests } => {
            let requests =
                requests.iter().map(|(r, px)| WireRequest { request: r.0, pixels: px.clone() }).collect();
            (RUN, to_body(&WireRun { batch: batch.0, expert: expert.0, requests })?)
        }
    })
}

/// The command `method` with `body` asks for (untrusted bytes).
pub fn decode_cmd(method: &str, body: &[u8]) -> Result<Cmd, String> {
    match method {
        LOAD => with_archived::<WireExpert, _>(body, |a| Ok(Cmd::Load(ExpertId(a.expert.to_native())))),
        EVICT => with_archived::<WireExpert, _>(body, |a| Ok(Cmd::Evict(ExpertId(a.expert.to_native())))),
        RESET if body.is_empty() => Ok(Cmd::Reset),
        RESET => Err(format!("a reset carries no body, got {} bytes", body.len())),
        RUN => with_archived::<WireRun, _>(body, |a| {
            if a.requests.len() > MAX_BATCH_WIRE {
                return Err(format!(
                    "batch of {} requests exceeds the cap of {MAX_BATCH_WIRE}",
                    a.requests.len()
                ));
            }
            if let Some(r) = a.requests.iter().find(|r| r.pixels.len() != INPUT_WIDTH) {
                return Err(format!(
                    "request {} carries {} input floats, not {INPUT_WIDTH}",
                    r.request.to_native(),
                    r.pixels.len()
                ));
            }
            Ok(Cmd::Run {
                batch: BatchId(a.batch.to_native()),
                expert: ExpertId(a.expert.to_native()),
                requests: a
                    .requests
                    .iter()
                    .map(|r| {
                        (RequestId(r.request.to_native()), r.pixels.iter().map(|v| v.to_native()).collect())
                    })
                    .collect(),
            })
        }),
        other => Err(format!("{other:?} is not an executor command")),
    }
}

/// The outcome an executor reports for an event (none for an eviction).
pub fn outcome(event: Option<Event>) -> WireOutcome {
    match event {
        None | Some(Event::Lost { .. } | Event::Failed(_)) => WireOutcome::Done,
        Some(Event::Loaded { seconds, resident, .. }) => {
            WireOutcome::Loaded(WireLoaded { seconds, resident })
        }
        Some(Event::Reset { evicted, host_budget, host, .. }) => WireOutcome::Reset(WireReset {
            evicted: evicted as u64,
            host_budget,
            host: host.iter().map(|e| e.0).collect(),
        }),
        Some(Event::Ran { rows, seconds, .. }) => WireOutcome::Ran(WireRan {
            seconds,
            rows: rows.into_iter().map(|(r, values)| WireRow { request: r.0, values }).collect(),
        }),
    }
}

/// The event an outcome for `cmd`, sent to executor `exec`, stands for (untrusted bytes): the
/// answer must fit the question.
pub fn decode_outcome(exec: usize, cmd: &Cmd, body: &[u8]) -> Result<Option<Event>, CoeError> {
    let bad = |e: String| CoeError::Invalid(format!("remote executor {exec}: {e}"));
    with_archived::<WireOutcome, _>(body, |a| match (a, cmd) {
        (ArchivedWireOutcome::Done, Cmd::Evict(_)) => Ok(None),
        (ArchivedWireOutcome::Reset(r), Cmd::Reset) => {
            if r.host.len() > MAX_HOST_WIRE {
                return Err(format!(
                    "a reset reports {} host experts, over the cap of {MAX_HOST_WIRE}",
                    r.host.len()
                ));
            }
            Ok(Some(Event::Reset {
                exec,
                evicted: usize::try_from(r.evicted.to_native()).unwrap_or(usize::MAX),
                host_budget: r.host_budget.to_native(),
                host: r.host.iter().map(|e| ExpertId(e.to_native())).collect(),
            }))
        }
        (ArchivedWireOutcome::Loaded(l), Cmd::Load(expert)) => Ok(Some(Event::Loaded {
            exec,
            expert: *expert,
            seconds: l.seconds.to_native(),
            resident: l.resident.to_native(),
        })),
        (ArchivedWireOutcome::Ran(ran), Cmd::Run { batch, expert, requests }) => {
            let (seconds, rows) = (&ran.seconds, &ran.rows);
            if rows.len() != requests.len() {
                return Err(format!("{} rows for {} requests", rows.len(), requests.len()));
            }
            if let Some(w) = rows.iter().map(|r| r.values.len()).find(|w| *w > MAX_ROW_WIRE) {
                return Err(format!("row of width {w} exceeds the cap of {MAX_ROW_WIRE}"));
            }
            let rows = rows
                .iter()
                .map(|r| (RequestId(r.request.to_native()), r.values.iter().map(|v| v.to_native()).collect()))
                .collect();
            Ok(Some(Event::Ran { exec, batch: *batch, expert: *expert, rows, seconds: seconds.to_native() }))
        }
        (_, cmd) => Err(format!("the outcome does not answer {cmd:?}")),
    })
    .map_err(bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_round_trip_and_garbage_is_refused() {
        let cmds = [
            Cmd::Load(ExpertId(7)),
            Cmd::Evict(ExpertId(0)),
            Cmd::Reset,
            Cmd::Run {
                batch: BatchId(9),
                expert: ExpertId(3),
                requests: vec![
                    (RequestId(1), vec![0.5; INPUT_WIDTH]),
                    (RequestId(2), vec![0.25; INPUT_WIDTH]),
                ],
            },
        ];
        for c in &cmds {
            let (method, body) = request(c).unwrap();
            assert_eq!(&decode_cmd(method, &body).unwrap(), c);
        }
        let (_, body) = request(&cmds[3]).unwrap();
        let err = decode_cmd(RUN, &body[..body.len() - 3]).unwrap_err();
        assert!(err.contains("invalid"), "{err}");
        let err = decode_cmd("explode", &body).unwrap_err();
        assert!(err.contains("explode"), "{err}");
        let huge = WireRun {
            batch: 1,
            expert: 1,
            requests: vec![WireRequest { request: 0, pixels: Vec::new() }; MAX_BATCH_WIRE + 1],
        };
        let err = decode_cmd(RUN, &to_body(&huge).unwrap()).unwrap_err();
        assert!(err.contains("exceeds the cap"), "{err}");
        let narrow = WireRun {
            batch: 1,
            expert: 1,
            requests: vec![WireRequest { request: 3, pixels: vec![0.0; 63] }],
        };
        let err = decode_cmd(RUN, &to_body(&narrow).unwrap()).unwrap_err();
        assert!(err.contains("request 3 carries 63 input floats, not 64"), "{err}");
    }

    #[test]
    fn only_the_scheduler_role_may_command_an_executor() {
        let s = spec();
        for m in [LOAD, EVICT, RUN] {
            assert_eq!(s.allow(m), Some(Allow::role(Role::Scheduler)), "{m}");
        }
        assert_eq!(s.allow(HELLO), Some(Allow::AnyMember));
        assert_eq!(s.allow("explode"), None);
    }

    #[test]
    fn outcomes_must_answer_their_command() {
        let run = Cmd::Run {
            batch: BatchId(4),
            expert: ExpertId(2),
            requests: vec![(RequestId(8), vec![0.0; INPUT_WIDTH])],
        };
        let ev = Event::Ran {
            exec: 1,
            batch: BatchId(4),
            expert: ExpertId(2),
            rows: vec![(RequestId(8), vec![0.25, 0.75])],
            seconds: 0.5,
        };
        let body = to_body(&outcome(Some(ev))).unwrap();
        match decode_outcome(1, &run, &body).unwrap() {
            Some(Event::Ran { rows, seconds, .. }) => {
                assert_eq!(rows, vec![(RequestId(8), vec![0.25, 0.75])]);
                assert_eq!(seconds, 0.5);
            }
            other => panic!("{other:?}"),
        }
        let load = Cmd::Load(ExpertId(2));
        let loaded = to_body(&WireOutcome::Loaded(WireLoaded { seconds: 0.1, resident: 4096 })).unwrap();
        assert!(matches!(
            decode_outcome(0, &load, &loaded).unwrap(),
            Some(Event::Loaded { resident: 4096, .. })
        ));
        let err = decode_outcome(0, &run, &loaded).unwrap_err().to_string();
        assert!(err.contains("does not answer"), "{err}");
        let reset =
            Event::Reset { exec: 2, evicted: 3, host_budget: 77, host: vec![ExpertId(4), ExpertId(9)] };
        let body = to_body(&outcome(Some(reset))).unwrap();
        match decode_outcome(2, &Cmd::Reset, &body).unwrap() {
            Some(Event::Reset { exec: 2, evicted: 3, host_budget: 77, host }) => {
                assert_eq!(host, vec![ExpertId(4), ExpertId(9)])
            }
            other => panic!("{other:?}"),
        }
        let flood =
            WireOutcome::Reset(WireReset { evicted: 0, host_budget: 0, host: vec![0; MAX_HOST_WIRE + 1] });
        let err = decode_outcome(2, &Cmd::Reset, &to_body(&flood).unwrap()).unwrap_err().to_string();
        assert!(err.contains("over the cap"), "{err}");
        assert!(decode_outcome(0, &load, &[1, 2, 3]).is_err());
    }
}

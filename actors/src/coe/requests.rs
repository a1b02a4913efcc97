//! The coe scheduler as a service: a node running the `coe` job with `serve = true` keeps its
//! scheduler and executors and answers clients' requests over QUIC ([`REQUEST_SERVICE`],
//! method [`REQUEST`], client role only), each with the routed experts' outputs.
//!
//! - **What travels.** A [`WireCoeRequest`]: an entry expert (or none: the app's first) and
//!   [`INPUT_WIDTH`] floats. Both are checked on the archived form (checked rkyv access, the
//!   length before anything is copied) and again by [`CoeShared::submit`].
//! - **Durable acceptance.** [`CoeShared::submit`] journals the request (fsynced) before the
//!   scheduler hears of it; its answer is journaled before it is sent.
//! - **Backpressure.** At most `per_node` requests outstanding on the node and `per_peer` from
//!   one client ([`troupe_policy::coe::admission::admit`]); past either the answer is `busy`,
//!   and nothing is queued.
//! - **Client.** [`CoeClient`]: its own QUIC endpoint (not a cluster member), like the
//!   pipeline's `ForemanClient`.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rkyv::{Archive, Deserialize, Serialize};
use troupe_policy::coe::ExpertId;
use troupe_policy::coe::admission::{Admission, AdmissionLimits, admit};
use troupe_transport::service::FaultKind;
use troupe_transport::{NodeId, QuicNode, Role};

use super::app::INPUT_WIDTH;
use super::serve::{ClientAnswer, CoeShared};
use crate::service::{Allow, CallError, Handler, ServiceSpec, Services, to_body, with_archived};

/// The service a serving coe scheduler node offers.
pub const REQUEST_SERVICE: &str = "coe-requests";
/// Its one method: run one request, answer with its outputs.
pub const REQUEST: &str = "request";
/// Widest expert output accepted back by a client.
pub const MAX_OUTPUT_WIDTH: usize = 65_536;
/// Most experts one answer may name.
pub const MAX_ANSWER_EXPERTS: usize = 4096;

/// A request as a client sends it.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct WireCoeRequest {
    /// The entry (preliminary) expert; `None` takes the app's first.
    pub root: Option<u32>,
    /// The input: [`INPUT_WIDTH`] floats.
    pub pixels: Vec<f32>,
}

/// One expert's output in an answer.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct WireExpertOutput {
    /// The expert.
    pub expert: u32,
    /// Its output, quantised (1e-4 steps).
    pub output: Vec<i32>,
}

/// What the scheduler answers a request with.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct WireCoeAnswer {
    /// The request's id in the job.
    pub request: u64,
    /// Digest of its outputs (as `troupe coe run --out` writes it).
    pub digest: u64,
    /// The experts it ran, in id order, with their outputs.
    pub outputs: Vec<WireExpertOutput>,
}

/// Why a request got no answer, on the client's side.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// The scheduler is full (per node or for this client): try again later.
    #[error("busy: {0}")]
    Busy(String),
    /// The scheduler refused or failed the request, or could not be reached.
    #[error(transparent)]
    Call(#[from] CallError),
    /// The request could not be encoded or the answer decoded.
    #[error("{0}")]
    Wire(String),
    /// No connection to the scheduler's node.
    #[error("connecting to the scheduler: {0}")]
    Connect(String),
}

/// Counts of outstanding requests, node-wide and per client.
#[derive(Default)]
struct Outstanding {
    total: usize,
    per_peer: HashMap<NodeId, usize>,
}

/// The request service's state shared by its calls.
struct Server {
    shared: Arc<CoeShared>,
    limits: AdmissionLimits,
    answer_timeout: Duration,
    outstanding: Arc<Mutex<Outstanding>>,
}

/// One admitted request's slot; given back when dropped (answered, refused by the scheduler,
/// or, for a request whose client stopped waiting, once the scheduler answers it).
struct Slot {
    outstanding: Arc<Mutex<Outstanding>>,
    peer: NodeId,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut o = self.outstanding.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        o.total = o.total.saturating_sub(1);
        crate::live::set_queue("coe", "admitted", o.total as u64);
        if let Some(n) = o.per_peer.get_mut(&self.peer) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                o.per_peer.remove(&self.peer);
            }
        }
    }
}

impl Server {
    /// Takes a slot for `peer`, or says why it is busy.
    fn admit(&self, peer: &NodeId) -> Result<Slot, String> {
        let mut o = self.outstanding.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mine = o.per_peer.get(peer).copied().unwrap_or(0);
        match admit(self.limits, o.total, mine) {
            Admission::Accept => {
                o.total += 1;
                crate::live::set_queue("coe", "admitted", o.total as u64);
                *o.per_peer.entry(peer.clone()).or_default() += 1;
                Ok(Slot { outstanding: self.outstanding.clone(), peer: peer.clone() })
            }
            Admission::BusyNode => Err(format!(
                "busy: {} requests are outstanding on this scheduler, its bound; send again later",
                self.limits.per_node
            )),
            Admission::BusyPeer => Err(format!(
                "busy: {} of your requests are outstanding, the bound per client; send again later",
                self.limits.per_peer
            )),
        }
    }

    /// Admits, checks and accepts one request from `peer`, then waits for its answer.
    async fn request(&self, peer: &NodeId, body: &[u8]) -> Result<Vec<u8>, String> {
        let (root, pixels) = with_archived::<WireCoeRequest, _>(body, |a| {
            if a.pixels.len() != INPUT_WIDTH {
                return Err(format!("an input has {INPUT_WIDTH} floats, this one has {}", a.pixels.len()));
            }
            let root = a.root.as_ref().map(|r| r.to_native());
            Ok((root, a.pixels.iter().map(|v| v.to_native()).collect::<Vec<f32>>()))
        })?;
        let root = match root {
            Some(r) => ExpertId(r),
            None => self.shared.default_root().ok_or("this app has no entry expert")?,
        };
        let slot = self.admit(peer)?;
        let (id, mut answer) = self.shared.submit(root, pixels).map_err(|e| e.to_string())?;
        tracing::debug!(%peer, request = id, %root, "coe request accepted");
        let answer = match tokio::time::timeout(self.answer_timeout, &mut answer).await {
            Ok(Ok(a)) => a,
            Ok(Err(_)) => return Err(format!("request {id}: the scheduler dropped it unanswered")),
            Err(_) => {
                // still in the scheduler's queue: its slot stays taken until it is answered, so
                // clients that give up cannot pile up work past the bound
                tokio::spawn(async move {
                    let _ = answer.await;
                    drop(slot);
                });
                return Err(format!("request {id}: not answered within {:?}", self.answer_timeout));
            }
        };
        drop(slot);
        to_body(&wire_answer(&answer))
    }
}

/// The wire form of an answer.
fn wire_answer(a: &ClientAnswer) -> WireCoeAnswer {
    WireCoeAnswer {
        request: a.request,
        digest: a.digest,
        outputs: a.outputs.iter().map(|(e, q)| WireExpertOutput { expert: e.0, output: q.clone() }).collect(),
    }
}

/// Who may call what: requests only the client role (`troupe keys node NAME --role client`),
/// which commands no executor and never joins as a member.
pub fn spec() -> ServiceSpec {
    ServiceSpec::new().method(REQUEST, Allow::role(Role::Client))
}

/// Serves [`REQUEST_SERVICE`] on `services` for the job `shared`, under `limits`; each request
/// waits at most `answer_timeout` for its answer.
pub fn serve_requests(
    services: &Services,
    shared: Arc<CoeShared>,
    limits: AdmissionLimits,
    answer_timeout: Duration,
) {
    let server = Arc::new(Server {
        shared,
        limits,
        answer_timeout,
        outstanding: Arc::new(Mutex::new(Outstanding::default())),
    });
    let handler: Handler = Arc::new(move |caller, _method, body| {
        let server = server.clone();
        Box::pin(async move { server.request(&caller.node, &body).await })
    });
    services.register(REQUEST_SERVICE, spec(), handler);
}

/// A client's answer, decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CoeAnswer {
    /// The request's id in the job.
    pub request: u64,
    /// Digest of its outputs.
    pub digest: u64,
    /// Each expert it ran and its quantised output.
    pub outputs: BTreeMap<ExpertId, Vec<i32>>,
}

/// Decodes an answer body (untrusted: checked access, sizes capped before copying).
pub fn decode_answer(body: &[u8]) -> Result<CoeAnswer, String> {
    with_archived::<WireCoeAnswer, _>(body, |a| {
        if a.outputs.len() > MAX_ANSWER_EXPERTS {
            return Err(format!(
                "{} experts in one answer, above the cap of {MAX_ANSWER_EXPERTS}",
                a.outputs.len()
            ));
        }
        let mut outputs = BTreeMap::new();
        for o in a.outputs.iter() {
            if o.output.len() > MAX_OUTPUT_WIDTH {
                return Err(format!(
                    "an output of width {}, above the cap of {MAX_OUTPUT_WIDTH}",
                    o.output.len()
                ));
            }
            let expert = ExpertId(o.expert.to_native());
            if outputs.insert(expert, o.output.iter().map(|v| v.to_native()).collect()).is_some() {
                return Err(format!("expert {expert} answered twice"));
            }
        }
        Ok(CoeAnswer { request: a.request.to_native(), digest: a.digest.to_native(), outputs })
    })
}

/// A client of a serving coe scheduler: its own QUIC endpoint (not a cluster member) and a
/// service router for the answers.
pub struct CoeClient {
    link: QuicNode,
    services: Services,
    scheduler: NodeId,
}

impl CoeClient {
    /// Connects to the scheduler's node at `addr` as `identity` (a certificate of the cluster
    /// with the client role).
    pub async fn connect(
        identity: &troupe_transport::NodeIdentity,
        addr: std::net::SocketAddr,
    ) -> Result<Self, RequestError> {
        let client = crate::service::ServiceClient::connect(identity, addr, None)
            .await
            .map_err(|e| RequestError::Connect(e.to_string()))?;
        let crate::service::ServiceClient { link, services, server: scheduler } = client;
        Ok(CoeClient { link, services, scheduler })
    }

    /// The scheduler's node.
    pub fn scheduler(&self) -> &NodeId {
        &self.scheduler
    }

    /// Sends one request (entry expert `root`, or the app's first; `pixels` the input) and waits
    /// at most `timeout` for its answer. A full scheduler answers [`RequestError::Busy`].
    pub async fn request(
        &self,
        root: Option<ExpertId>,
        pixels: &[f32],
        timeout: Duration,
    ) -> Result<CoeAnswer, RequestError> {
        let req = WireCoeRequest { root: root.map(|r| r.0), pixels: pixels.to_vec() };
        let body = to_body(&req).map_err(RequestError::Wire)?;
        match self.services.call(&self.scheduler, REQUEST_SERVICE, REQUEST, body, timeout).await {
            Ok(answer) => decode_answer(&answer).map_err(RequestError::Wire),
            Err(e) if is_busy(&e) => Err(RequestError::Busy(e.to_string())),
            Err(e) => Err(e.into()),
        }
    }

    /// Closes the connection.
    pub async fn close(self) {
        self.link.shutdown().await;
    }
}

/// A refusal for lack of room: the router's own (too many calls) or the scheduler's bound.
fn is_busy(e: &CallError) -> bool {
    match e {
        CallError::Remote { kind: FaultKind::Busy, .. } => true,
        CallError::Remote { message, .. } => message.starts_with("busy:"),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_round_trip_and_oversized_ones_are_refused() {
        let a = WireCoeAnswer {
            request: 7,
            digest: 0xdead_beef,
            outputs: vec![
                WireExpertOutput { expert: 1, output: vec![1, 2, 3] },
                WireExpertOutput { expert: 4, output: vec![5] },
            ],
        };
        let got = decode_answer(&to_body(&a).unwrap()).unwrap();
        assert_eq!(got.request, 7);
        assert_eq!(got.digest, 0xdead_beef);
        assert_eq!(got.outputs.get(&ExpertId(4)), Some(&vec![5]));
        let twice = WireCoeAnswer { outputs: vec![a.outputs[0].clone(), a.outputs[0].clone()], ..a.clone() };
        assert!(decode_answer(&to_body(&twice).unwrap()).unwrap_err().contains("answered twice"));
        let wide = WireCoeAnswer {
            outputs: vec![WireExpertOutput { expert: 0, output: vec![0; MAX_OUTPUT_WIDTH + 1] }],
            ..a.clone()
        };
        assert!(decode_answer(&to_body(&wide).unwrap()).unwrap_err().contains("above the cap"));
        let body = to_body(&a).unwrap();
        assert!(decode_answer(&body[..body.len() - 2]).unwrap_err().contains("invalid"));
    }

    #[test]
    fn only_the_client_role_may_send_requests() {
        assert_eq!(spec().allow(REQUEST), Some(Allow::role(Role::Client)));
        assert_eq!(spec().allow("admin"), None);
    }
}

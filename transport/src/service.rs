//! The service-call envelope: request/response messages of role-checked workload RPC, carried
//! in [`FrameKind::Service`] frames on the data channel.
//!
//! This module is the pure codec: [`encode`] and one [`decode`] with one error type. The
//! receiver learns who sent a request from the authenticated QUIC connection it arrived on (so
//! from the sender's certificate and its roles), never from the envelope; the router that
//! checks roles and runs handlers lives in the actors crate.
//!
//! Untrusted bytes: the body length is checked against [`ServiceLimits::max_message`] before
//! anything is decoded or allocated, access is checked rkyv, and service and method names are
//! bounded by [`MAX_NAME`] before they are copied.

use rkyv::{Archive, Deserialize, Serialize, rancor};

use crate::frame::{Frame, FrameKind};

/// Longest service or method name accepted.
pub const MAX_NAME: usize = 64;
/// The correlation id of a one-way request: the callee runs it and sends no response.
pub const ONE_WAY: u64 = 0;
/// Default cap on one envelope (encoded, so also on what decoding it allocates).
pub const DEFAULT_MAX_MESSAGE: usize = 16 << 20;

/// One service-call message.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub enum Envelope {
    /// A call: run `method` of `service` on `body`.
    Request(Request),
    /// The answer to the request with the same id.
    Response(Response),
}

/// A call.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Request {
    /// Correlation id, unique among the caller's outstanding calls; [`ONE_WAY`] for a request
    /// that wants no answer (a tell).
    pub id: u64,
    /// Service name (an actor kind, possibly with an instance: `coe-executor/cpu0`).
    pub service: String,
    /// Method name.
    pub method: String,
    /// Method-specific body (its own rkyv archive).
    pub body: Vec<u8>,
}

/// The answer to a [`Request`].
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Response {
    /// The request's correlation id.
    pub id: u64,
    /// What happened.
    pub outcome: Outcome,
}

/// A call's result.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub enum Outcome {
    /// The method's answer.
    Ok(Vec<u8>),
    /// Why there is none.
    Err(Fault),
}

/// A refused or failed call, as the callee reports it.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Fault {
    /// The class of failure.
    pub kind: FaultKind,
    /// A message naming the problem (role and method for a refusal).
    pub message: String,
}

/// Classes of [`Fault`].
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub enum FaultKind {
    /// The caller's roles do not allow this method.
    Forbidden,
    /// No such service on the callee.
    UnknownService,
    /// The service has no such method.
    UnknownMethod,
    /// The callee has too many calls in progress.
    Busy,
    /// The request body was invalid.
    BadRequest,
    /// The handler failed.
    Failed,
    /// The addressed incarnation of an actor is gone (it restarted or moved): the caller
    /// resolves the name again and re-sends if it wants to.
    Gone,
}

/// Limits applied to every envelope decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServiceLimits {
    /// Largest envelope accepted, in bytes.
    pub max_message: usize,
}

impl Default for ServiceLimits {
    fn default() -> Self {
        Self { max_message: DEFAULT_MAX_MESSAGE }
    }
}

/// Why an envelope could not be encoded or decoded.
#[derive(Debug, thiserror::Error)]
pub enum ServiceWireError {
    /// The frame is not a service frame.
    #[error("expected a service frame, got {0:?}")]
    WrongKind(FrameKind),
    /// The envelope is larger than the cap.
    #[error("service message of {len} bytes exceeds the cap of {max} bytes")]
    TooLarge {
        /// Its size.
        len: usize,
        /// The cap.
        max: usize,
    },
    /// A service or method name is longer than [`MAX_NAME`].
    #[error("{what} name of {len} bytes exceeds {MAX_NAME} bytes")]
    NameTooLong {
        /// "service" or "method".
        what: &'static str,
        /// Its length.
        len: usize,
    },
    /// Checked access or deserialisation failed.
    #[error("invalid service message: {0}")]
    Invalid(String),
    /// Serialisation failed.
    #[error("encoding a service message: {0}")]
    Encode(String),
}

/// The frame carrying `envelope`.
pub fn encode(envelope: &Envelope) -> Result<Frame, ServiceWireError> {
    if let Envelope::Request(r) = envelope {
        check_names(r.service.len(), r.method.len())?;
    }
    Frame::encode(FrameKind::Service, envelope).map_err(|e| ServiceWireError::Encode(e.to_string()))
}

fn check_names(service: usize, method: usize) -> Result<(), ServiceWireError> {
    if service > MAX_NAME {
        return Err(ServiceWireError::NameTooLong { what: "service", len: service });
    }
    if method > MAX_NAME {
        return Err(ServiceWireError::NameTooLong { what: "method", len: method });
    }
    Ok(())
}

/// Decodes a service frame from a peer: size cap first, then checked access, then name
/// bounds, and only then are the fields copied out.
pub fn decode(frame: &Frame, limits: &ServiceLimits) -> Result<Envelope, ServiceWireError> {
    if frame.kind != FrameKind::Service {
        return Err(ServiceWireError::WrongKind(frame.kind));
    }
    if frame.body.len() > limits.max_message {
        return Err(ServiceWireError::TooLarge { len: frame.body.len(), max: limits.max_message });
    }
    let archived = rkyv::access::<ArchivedEnvelope, rancor::Error>(&frame.body)
        .map_err(|e| ServiceWireError::Invalid(e.to_string()))?;
    if let ArchivedEnvelope::Request(r) = archived {
        check_names(r.service.len(), r.method.len())?;
    }
    rkyv::deserialize::<Envelope, rancor::Error>(archived)
        .map_err(|e| ServiceWireError::Invalid(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(service: &str, body: Vec<u8>) -> Envelope {
        Envelope::Request(Request { id: 7, service: service.into(), method: "load".into(), body })
    }

    #[test]
    fn envelopes_round_trip() {
        let limits = ServiceLimits::default();
        for env in [
            request("coe-executor/cpu0", vec![1, 2, 3]),
            Envelope::Response(Response { id: 7, outcome: Outcome::Ok(vec![9; 1000]) }),
            Envelope::Response(Response {
                id: 8,
                outcome: Outcome::Err(Fault { kind: FaultKind::Forbidden, message: "no".into() }),
            }),
        ] {
            assert_eq!(decode(&encode(&env).unwrap(), &limits).unwrap(), env);
        }
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_and_mutated_bytes_never_panic(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512),
            flip in proptest::prelude::any::<(usize, u8)>(),
        ) {
            let limits = ServiceLimits { max_message: 4096 };
            let _ = decode(&Frame::from_bytes(FrameKind::Service, 0, &bytes), &limits);
            let mut valid = encode(&request("svc", bytes.clone())).unwrap().body.to_vec();
            let i = flip.0 % valid.len();
            valid[i] ^= flip.1;
            if let Ok(Envelope::Request(r)) = decode(&Frame::from_bytes(FrameKind::Service, 0, &valid), &limits) {
                proptest::prop_assert!(r.service.len() <= MAX_NAME && r.method.len() <= MAX_NAME);
                proptest::prop_assert!(r.body.len() <= valid.len());
            }
        }
    }

    #[test]
    fn oversized_garbage_and_long_names_are_refused_by_name() {
        let frame = encode(&request("s", vec![0; 4096])).unwrap();
        let e = decode(&frame, &ServiceLimits { max_message: 1024 }).unwrap_err();
        assert!(matches!(e, ServiceWireError::TooLarge { max: 1024, .. }), "{e}");
        let garbage = Frame::from_bytes(FrameKind::Service, 0, &[0xff; 64]);
        let e = decode(&garbage, &ServiceLimits::default()).unwrap_err();
        assert!(e.to_string().contains("invalid service message"), "{e}");
        let e =
            decode(&Frame::from_bytes(FrameKind::Message, 0, &[]), &ServiceLimits::default()).unwrap_err();
        assert!(matches!(e, ServiceWireError::WrongKind(FrameKind::Message)));
        let long = "x".repeat(MAX_NAME + 1);
        assert!(matches!(encode(&request(&long, vec![])), Err(ServiceWireError::NameTooLong { .. })));
        // a peer that skips our encoder is caught by decode
        let raw = Frame::encode(FrameKind::Service, &request(&long, vec![])).unwrap();
        let e = decode(&raw, &ServiceLimits::default()).unwrap_err();
        assert!(matches!(e, ServiceWireError::NameTooLong { what: "service", .. }), "{e}");
    }
}

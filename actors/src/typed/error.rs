//! The one error a typed actor call returns, and the failure a handler reports.

use std::time::Duration;

/// Why a call or tell to a typed actor produced no reply. Every variant names the actor; the
/// ones that came from a peer name what the peer said.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ActorError {
    /// No node serves an actor of this name (within the wait, for `wait_for`).
    #[error("no actor named {name:?}{}", within.map(|d| format!(" appeared within {d:?}")).unwrap_or_default())]
    UnknownActor {
        /// The name looked up.
        name: String,
        /// How long it was waited for, if at all.
        within: Option<Duration>,
    },
    /// An actor of that name exists, but of another kind than the handle's.
    #[error("actor {name:?} is a {found}, not a {expected}")]
    WrongKind {
        /// The name.
        name: String,
        /// The handle's kind.
        expected: &'static str,
        /// The kind it has.
        found: String,
    },
    /// The caller's certificate roles may not send this message.
    #[error("actor {actor:?}: {detail}")]
    Forbidden {
        /// The actor.
        actor: String,
        /// The message refused.
        message: &'static str,
        /// The callee's explanation (names the caller's role and the role needed).
        detail: String,
    },
    /// No reply within the caller's timeout (the actor may still carry the message out).
    #[error("actor {actor:?}: {message} got no reply within {timeout:?}")]
    Timeout {
        /// The actor.
        actor: String,
        /// The message.
        message: &'static str,
        /// The timeout.
        timeout: Duration,
    },
    /// The incarnation the handle addressed is gone: its node left or was declared down, or the
    /// actor stopped or restarted. The message may or may not have been carried out; the
    /// handle resolves the name again on its next call, and nothing is re-sent for the caller.
    #[error("actor {actor:?}: peer lost ({reason})")]
    PeerLost {
        /// The actor.
        actor: String,
        /// What happened.
        reason: String,
    },
    /// The actor (or its node) is at its queue bound: back off and retry.
    #[error("actor {actor:?} is busy: {detail}")]
    Busy {
        /// The actor.
        actor: String,
        /// Which bound was full.
        detail: String,
    },
    /// The message or its reply was refused by the checked decoder, or could not be encoded.
    #[error("actor {actor:?}: bad message {message}: {detail}")]
    BadMessage {
        /// The actor.
        actor: String,
        /// The message type.
        message: &'static str,
        /// What the decoder said.
        detail: String,
    },
    /// The actor's handler returned a failure.
    #[error("actor {actor:?} failed handling {message}: {detail}")]
    Failed {
        /// The actor.
        actor: String,
        /// The message.
        message: &'static str,
        /// The handler's failure.
        detail: String,
    },
}

impl ActorError {
    /// True when the addressed incarnation is gone and a re-resolved handle may succeed.
    pub fn is_lost(&self) -> bool {
        matches!(self, ActorError::PeerLost { .. })
    }
}

/// A handler's failure: any error converts into it with `?`, or make one from a message with
/// [`ActorFailure::msg`]. The caller receives it as [`ActorError::Failed`]; the actor goes on.
/// (A panic in a handler is a crash instead: its supervisor restarts the actor.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActorFailure(String);

impl ActorFailure {
    /// A failure described by `message`.
    pub fn msg(message: impl std::fmt::Display) -> Self {
        Self(message.to_string())
    }

    /// The description.
    pub fn message(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for ActorFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl<E: std::error::Error + Send + Sync + 'static> From<E> for ActorFailure {
    fn from(e: E) -> Self {
        Self(e.to_string())
    }
}

//! Same-host streams: the frames of one channel to a peer on this host travel over a Unix-domain
//! stream instead of the QUIC stream, so a small message costs two socket calls and no
//! encryption, packetisation or QUIC driver hops (the round trip of a service ask is what this
//! is for; large bodies still go through [`crate::shm`] segments, whose references ride here).
//!
//! # How a stream is opened (per direction, per channel, per connection)
//! 1. The same-host handshake of [`crate::shm`] (over the authenticated QUIC connection) proves
//!    that both nodes share the host; the receiver's answer carries, besides the segment token,
//!    the abstract name of its listener (`troupe-<pid>-<32 hex>`, Linux's abstract namespace:
//!    no file, gone with the process).
//! 2. Before the first frame of a channel, the sender dials that name and writes a fixed
//!    [`HELLO_LEN`]-byte hello: [`HELLO_MAGIC`], the token the receiver issued *to this peer*,
//!    and the channel byte. Every later frame of that channel on that connection goes on this
//!    stream, so a channel never switches roads and its frames keep their order.
//! 3. The receiver checks that the dialer runs under its own uid (`SO_PEERCRED`), reads the
//!    hello within the hello timeout, finds the peer by the token (compared in constant time),
//!    and reads frames exactly as from that peer's QUIC streams: the same frame limits, the
//!    same per-connection [`ConnBudget`](crate::budget::ConnBudget), the same delivery. The
//!    stream is cut when the peer's QUIC connection ends (over budget, refused, replaced).
//!
//! # Why a local attacker gains nothing
//! Anyone on the host may connect to an abstract name. Without the token (32 random bytes sent
//! only inside the peer's mutually authenticated TLS connection) the stream is dropped after its
//! hello; a process of another uid is dropped before it. A peer with a valid certificate that
//! uses its token is held to its connection's budget and stream cap, as on QUIC.

use std::io;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::SocketAddr as UnixAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};

use crate::link::Channel;

/// First bytes of a local stream's hello.
pub const HELLO_MAGIC: [u8; 8] = *b"TRPLOC01";
/// Length of the hello: magic, token, purpose byte.
pub const HELLO_LEN: usize = HELLO_MAGIC.len() + 32 + 1;
/// Purpose byte of a stream that pulls one blob (a channel's stream carries the channel's byte).
pub const PURPOSE_BLOB_PULL: u8 = 0x42;
/// Purpose byte of the control-plane stream (ractor_cluster's session; one per connection).
pub const PURPOSE_CONTROL: u8 = 0x43;

/// What a local stream is for, from its hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    /// Every frame of one channel from the dialer, for the connection's life.
    Channel(Channel),
    /// One blob pull: a request frame from the dialer, one answer frame back.
    BlobPull,
    /// The control-plane session, both ways, for the connection's life.
    Control,
}

impl Purpose {
    fn to_u8(self) -> u8 {
        match self {
            Self::Channel(c) => c as u8,
            Self::BlobPull => PURPOSE_BLOB_PULL,
            Self::Control => PURPOSE_CONTROL,
        }
    }

    fn from_u8(b: u8) -> Option<Self> {
        match b {
            PURPOSE_BLOB_PULL => Some(Self::BlobPull),
            PURPOSE_CONTROL => Some(Self::Control),
            b => Channel::from_u8(b).map(Self::Channel),
        }
    }
}
/// Every listener name starts with this.
const NAME_PREFIX: &str = "troupe-";
/// Longest name accepted (prefix, up to 10 pid digits, a dash, 32 hex characters).
const MAX_NAME_LEN: usize = NAME_PREFIX.len() + 10 + 1 + 32;

/// Why a local stream could not be opened or was refused; every variant names the problem.
#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    /// A listener name that is not of the one accepted form.
    #[error("bad local stream name {name:?}: {reason}")]
    BadName {
        /// The name as received (clipped).
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A socket call failed.
    #[error("local stream: {op}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The underlying error.
        source: io::Error,
    },
    /// The other end runs under another user.
    #[error("local stream from uid {0}, not ours")]
    ForeignUid(u32),
    /// The hello was malformed or named no peer we issued a token to.
    #[error("local stream hello refused: {0}")]
    Hello(&'static str),
}

fn io_err(op: &'static str) -> impl FnOnce(io::Error) -> LocalError {
    move |source| LocalError::Io { op, source }
}

/// Checks a listener name received from a peer: the one form `listen` makes, nothing else.
pub fn validate_name(name: &str) -> Result<(), LocalError> {
    let bad = |reason| LocalError::BadName { name: name.chars().take(80).collect(), reason };
    if name.len() > MAX_NAME_LEN {
        return Err(bad("too long"));
    }
    let rest = name.strip_prefix(NAME_PREFIX).ok_or_else(|| bad("wrong prefix"))?;
    let (pid, random) = rest.split_once('-').ok_or_else(|| bad("no separator"))?;
    if pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad("process id is not decimal"));
    }
    if random.len() != 32 || !random.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(bad("random part is not 32 hex digits"));
    }
    Ok(())
}

/// Binds a listener on a fresh abstract name; returns it with the name peers dial.
pub(crate) fn listen() -> Result<(UnixListener, String), LocalError> {
    let mut random = [0u8; 16];
    crate::shm::random_bytes(&mut random)
        .map_err(|e| LocalError::Io { op: "random name", source: io::Error::other(e.to_string()) })?;
    let hex: String = random.iter().map(|b| format!("{b:02x}")).collect();
    let name = format!("{NAME_PREFIX}{}-{hex}", std::process::id());
    let addr = UnixAddr::from_abstract_name(name.as_bytes()).map_err(io_err("abstract name"))?;
    let std_listener = std::os::unix::net::UnixListener::bind_addr(&addr).map_err(io_err("bind"))?;
    std_listener.set_nonblocking(true).map_err(io_err("non-blocking"))?;
    Ok((UnixListener::from_std(std_listener).map_err(io_err("register listener"))?, name))
}

/// The hello a dialer writes first on a stream for `purpose`.
fn hello_bytes(token: &[u8; 32], purpose: Purpose) -> [u8; HELLO_LEN] {
    let mut h = [0u8; HELLO_LEN];
    h[..8].copy_from_slice(&HELLO_MAGIC);
    h[8..40].copy_from_slice(token);
    h[40] = purpose.to_u8();
    h
}

/// Fails unless the process at the other end of `stream` runs under our uid.
fn check_uid(stream: &UnixStream) -> Result<(), LocalError> {
    let cred = stream.peer_cred().map_err(io_err("peer credentials"))?;
    if cred.uid() != crate::shm::own_uid() {
        return Err(LocalError::ForeignUid(cred.uid()));
    }
    Ok(())
}

/// Dials the listener `name` (as a peer's same-host answer gave it) and writes the hello for
/// `purpose` with the `token` that peer issued us.
pub(crate) async fn dial(name: &str, token: &[u8; 32], purpose: Purpose) -> Result<UnixStream, LocalError> {
    validate_name(name)?;
    let addr = UnixAddr::from_abstract_name(name.as_bytes()).map_err(io_err("abstract name"))?;
    // connecting to a local listener does not block: it succeeds or fails at once
    let std_stream = std::os::unix::net::UnixStream::connect_addr(&addr).map_err(io_err("connect"))?;
    std_stream.set_nonblocking(true).map_err(io_err("non-blocking"))?;
    let mut stream = UnixStream::from_std(std_stream).map_err(io_err("register stream"))?;
    check_uid(&stream)?;
    stream.write_all(&hello_bytes(token, purpose)).await.map_err(io_err("write hello"))?;
    Ok(stream)
}

/// Reads and checks an accepted stream's hello: who may speak on it is decided by `token_owner`
/// (the peer a token was issued to). Returns that peer's answer and the stream's purpose.
pub(crate) async fn read_hello<P>(
    stream: &mut UnixStream,
    token_owner: impl FnOnce(&[u8; 32]) -> Option<P>,
) -> Result<(P, Purpose), LocalError> {
    check_uid(stream)?;
    let mut h = [0u8; HELLO_LEN];
    stream.read_exact(&mut h).await.map_err(io_err("read hello"))?;
    if h[..8] != HELLO_MAGIC {
        return Err(LocalError::Hello("wrong magic"));
    }
    let purpose = Purpose::from_u8(h[40]).ok_or(LocalError::Hello("unknown purpose"))?;
    let mut token = [0u8; 32];
    token.copy_from_slice(&h[8..40]);
    let peer = token_owner(&token).ok_or(LocalError::Hello("the token was issued to no connected peer"))?;
    Ok((peer, purpose))
}

/// Compares two tokens in time independent of where they differ.
pub(crate) fn same_token(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Counters of the same-host streams.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LocalStats {
    /// Streams this node opened to peers (one per channel and connection used).
    pub opened: u64,
    /// Streams peers opened to this node that passed the hello.
    pub accepted: u64,
    /// Streams refused (foreign uid, bad hello, unknown token, over the stream cap).
    pub refused: u64,
    /// Frames received on accepted streams.
    pub frames_received: u64,
    /// Blob pulls this node made over local streams.
    pub blob_pulls: u64,
    /// Control-plane streams (ractor_cluster sessions) opened or accepted on this road.
    pub control: u64,
}

/// The live counters behind [`LocalStats`].
#[derive(Debug, Default)]
pub(crate) struct LocalCounters {
    pub(crate) opened: AtomicU64,
    pub(crate) accepted: AtomicU64,
    pub(crate) refused: AtomicU64,
    pub(crate) frames_received: AtomicU64,
    pub(crate) blob_pulls: AtomicU64,
    pub(crate) control: AtomicU64,
}

impl LocalCounters {
    pub(crate) fn snapshot(&self) -> LocalStats {
        LocalStats {
            opened: self.opened.load(Ordering::Relaxed),
            accepted: self.accepted.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
            frames_received: self.frames_received.load(Ordering::Relaxed),
            blob_pulls: self.blob_pulls.load(Ordering::Relaxed),
            control: self.control.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_strictly() {
        assert!(validate_name("troupe-123-0123456789abcdef0123456789abcdef").is_ok());
        for bad in [
            "troupe--0123456789abcdef0123456789abcdef",
            "other-123-0123456789abcdef0123456789abcdef",
            "troupe-12a-0123456789abcdef0123456789abcdef",
            "troupe-123-0123456789abcdef",
            "troupe-123-0123456789abcdef0123456789abcdeg",
            "troupe-12345678901-0123456789abcdef0123456789abcdef",
        ] {
            assert!(validate_name(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn tokens_compare_by_every_byte() {
        let a = [7u8; 32];
        let mut b = a;
        assert!(same_token(&a, &b));
        b[31] ^= 1;
        assert!(!same_token(&a, &b));
    }

    #[tokio::test]
    async fn a_hello_with_the_issued_token_names_its_peer_and_others_are_refused() {
        let (listener, name) = listen().expect("listen");
        let token = [9u8; 32];
        let dialer = tokio::spawn({
            let name = name.clone();
            async move {
                let a = dial(&name, &token, Purpose::Channel(Channel::Data)).await.expect("dial");
                let b = dial(&name, &[1u8; 32], Purpose::BlobPull).await.expect("dial");
                (a, b)
            }
        });
        let owner = |t: &[u8; 32]| same_token(t, &token).then_some("peer-a");
        let (mut first, _) = listener.accept().await.expect("accept");
        let (peer, purpose) = read_hello(&mut first, owner).await.expect("hello");
        assert_eq!((peer, purpose), ("peer-a", Purpose::Channel(Channel::Data)));
        let (mut second, _) = listener.accept().await.expect("accept");
        let refused = read_hello(&mut second, owner).await.expect_err("a token nobody was issued");
        assert!(refused.to_string().contains("issued to no connected peer"), "{refused}");
        drop(dialer.await.expect("dialer"));
    }
}

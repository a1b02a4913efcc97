//! The control-plane stream to one peer (ractor_cluster's node session rides it): a QUIC
//! bidirectional stream, or, between two nodes of one host, a same-host stream of
//! [`crate::local`] that lives no longer than the QUIC connection that vouched for it.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use quinn::{Connection, RecvStream, SendStream};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::UnixStream;
use tokio::net::unix::OwnedWriteHalf;
use tokio::sync::oneshot;

/// A boxed reading half (what ractor_cluster's external transports take).
pub type ControlRead = Box<dyn AsyncRead + Unpin + Send + 'static>;
/// A boxed writing half.
pub type ControlWrite = Box<dyn AsyncWrite + Unpin + Send + 'static>;

/// One control-plane stream, either road.
#[derive(Debug)]
pub enum ControlStream {
    /// A bidirectional stream of the encrypted QUIC connection.
    Quic {
        /// Our sending half.
        send: SendStream,
        /// Our receiving half.
        recv: RecvStream,
    },
    /// A same-host stream, shut down when its QUIC connection closes.
    Local(TiedStream),
}

impl ControlStream {
    /// Whether the stream takes the same-host road.
    pub fn is_local(&self) -> bool {
        matches!(self, Self::Local(_))
    }

    /// Splits the stream into halves (for ractor_cluster's `ClusterBidiStream`).
    pub fn into_split(self) -> (ControlRead, ControlWrite) {
        match self {
            Self::Quic { send, recv } => (Box::new(recv), Box::new(send)),
            Self::Local(tied) => {
                let (read, write) = tied.stream.into_split();
                (Box::new(read), Box::new(TiedWrite { write, _tie: tied.tie }))
            }
        }
    }
}

/// A same-host stream tied to a QUIC connection: when the connection closes, a watcher shuts
/// the socket down (both halves see the end at once); when the stream's writing half is
/// dropped first, the watcher ends and keeps nothing open.
#[derive(Debug)]
pub struct TiedStream {
    stream: UnixStream,
    tie: oneshot::Sender<()>,
}

impl TiedStream {
    /// Ties `stream` to `conn` (spawns the watcher; needs a tokio runtime).
    pub(crate) fn new(stream: UnixStream, conn: Connection) -> io::Result<Self> {
        let std_stream = stream.into_std()?;
        let watch = std_stream.try_clone()?;
        let stream = UnixStream::from_std(std_stream)?;
        let (tie, released) = oneshot::channel::<()>();
        tokio::spawn(async move {
            tokio::select! {
                _ = conn.closed() => {
                    let _ = watch.shutdown(std::net::Shutdown::Both);
                }
                _ = released => {}
            }
        });
        Ok(Self { stream, tie })
    }
}

/// The writing half of a [`TiedStream`]; dropping it releases the watcher.
struct TiedWrite {
    write: OwnedWriteHalf,
    _tie: oneshot::Sender<()>,
}

impl AsyncWrite for TiedWrite {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.write).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.write).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.write).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.write).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.write.is_write_vectored()
    }
}

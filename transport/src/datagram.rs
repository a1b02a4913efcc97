//! quinn's UDP socket with segmentation-offload batches kept within what one UDP send may
//! carry, so that large datagrams and GSO work together.
//!
//! Why: quinn batches up to ten datagrams of the path MTU into one GSO send, and the kernel
//! refuses a send whose total passes 64 KiB. With the MTU capped low enough for ten to fit
//! (6500 bytes), loopback and same-host links (MTU 64 KiB) carried a 64 MiB tensor in ~10,000
//! packets, each one decrypted, acknowledged and handed over on its own. This wrapper lets QUIC's
//! MTU discovery go up to [`MAX_DATAGRAM`]: a batch over the send limit is cut into sends of as
//! many whole datagrams as fit (one, for 64 KiB datagrams), while links with an Ethernet MTU keep
//! their batches of ten.

use std::fmt;
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use quinn::udp::{RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, UdpPoller};

/// Largest UDP payload one send may carry over IPv4 (65,535 less the IP and UDP headers); a GSO
/// batch counts as one send.
pub const MAX_SEND_BYTES: usize = 65_507;
/// Largest datagram this node sends or accepts (QUIC's MTU discovery stops here; paths with a
/// smaller MTU are found by discovery, whose oversized probes the kernel refuses locally).
pub const MAX_DATAGRAM: u16 = 65_000;

/// quinn's socket with GSO batches cut to [`MAX_SEND_BYTES`] (see the module docs).
pub struct CappedBatchSocket {
    inner: Arc<dyn AsyncUdpSocket>,
}

impl CappedBatchSocket {
    /// Wraps quinn's socket.
    pub fn new(inner: Arc<dyn AsyncUdpSocket>) -> Self {
        Self { inner }
    }
}

impl fmt::Debug for CappedBatchSocket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CappedBatchSocket").finish_non_exhaustive()
    }
}

/// The byte ranges of `len` bytes of datagrams of `segment` bytes, cut into sends of whole
/// datagrams of at most [`MAX_SEND_BYTES`] in all (at least one datagram per send).
fn send_ranges(len: usize, segment: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let per_send = (MAX_SEND_BYTES / segment.max(1)).max(1) * segment.max(1);
    (0..len).step_by(per_send).map(move |start| start..(start + per_send).min(len))
}

impl AsyncUdpSocket for CappedBatchSocket {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    /// A batch within the limit goes as is. A larger one goes in several sends; when a later
    /// one would block, quinn retries the whole batch, and the peer drops the datagrams it
    /// already has as duplicates (QUIC packet numbers), so nothing is counted as lost.
    fn try_send(&self, transmit: &Transmit<'_>) -> io::Result<()> {
        let segment = match transmit.segment_size {
            Some(s) if transmit.contents.len() > MAX_SEND_BYTES => s,
            _ => return self.inner.try_send(transmit),
        };
        for range in send_ranges(transmit.contents.len(), segment) {
            let contents = &transmit.contents[range];
            self.inner.try_send(&Transmit {
                destination: transmit.destination,
                ecn: transmit.ecn,
                contents,
                segment_size: (contents.len() > segment).then_some(segment),
                src_ip: transmit.src_ip,
            })?;
        }
        Ok(())
    }

    fn poll_recv(
        &self,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        self.inner.poll_recv(cx, bufs, meta)
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.inner.max_transmit_segments()
    }

    fn max_receive_segments(&self) -> usize {
        self.inner.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_are_cut_into_whole_datagrams_within_the_send_limit() {
        // ten loopback-sized datagrams: one per send, the last one short
        let ranges: Vec<_> = send_ranges(9 * 65_000 + 100, 65_000).collect();
        assert_eq!(ranges.len(), 10);
        assert!(ranges.iter().all(|r| r.len() <= MAX_SEND_BYTES));
        assert_eq!(ranges[9], 9 * 65_000..9 * 65_000 + 100);
        // Ethernet-sized datagrams: as many whole ones per send as fit
        let ranges: Vec<_> = send_ranges(100 * 1452, 1452).collect();
        assert!(ranges.iter().all(|r| r.len() % 1452 == 0 && r.len() <= MAX_SEND_BYTES));
        assert_eq!(ranges[0].len(), 45 * 1452);
        assert_eq!(ranges.iter().map(|r| r.len()).sum::<usize>(), 100 * 1452);
        // contiguous, in order
        assert!(ranges.windows(2).all(|w| w[0].end == w[1].start));
    }
}

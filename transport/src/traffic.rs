//! Frame and byte counters per channel: what a node's application traffic costs, for metrics.
//!
//! Counted at the [`Link`](crate::Link) boundary of a [`QuicNode`](crate::QuicNode): a frame
//! is counted sent once `send` returned `Ok`, received once it is handed to the node's inbox.
//! Bytes are the frame's header plus its body as the application sees it, whichever path it
//! took (a QUIC stream or a same-host segment); what QUIC itself put on the wire per peer is in
//! `QuicNode::connection_stats`. Relaxed atomics: a snapshot is a consistent-enough reading of
//! counters that only grow.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::frame::HEADER_LEN;
use crate::link::Channel;

/// Totals for one channel since the node started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ChannelTraffic {
    /// Frames sent.
    pub frames_sent: u64,
    /// Header and body bytes sent.
    pub bytes_sent: u64,
    /// Frames received.
    pub frames_received: u64,
    /// Header and body bytes received.
    pub bytes_received: u64,
}

#[derive(Default)]
struct Counters {
    frames_sent: AtomicU64,
    bytes_sent: AtomicU64,
    frames_received: AtomicU64,
    bytes_received: AtomicU64,
}

/// The counters of every channel of one node.
#[derive(Default)]
pub(crate) struct Traffic {
    channels: [Counters; Channel::ALL.len()],
}

fn index(channel: Channel) -> usize {
    match channel {
        Channel::Control => 0,
        Channel::Data => 1,
        Channel::Blob => 2,
    }
}

impl Traffic {
    /// Counts one frame with a body of `body` bytes sent on `channel`.
    pub(crate) fn sent(&self, channel: Channel, body: usize) {
        let c = &self.channels[index(channel)];
        c.frames_sent.fetch_add(1, Ordering::Relaxed);
        c.bytes_sent.fetch_add((HEADER_LEN + body) as u64, Ordering::Relaxed);
    }

    /// Counts one frame with a body of `body` bytes received on `channel`.
    pub(crate) fn received(&self, channel: Channel, body: usize) {
        let c = &self.channels[index(channel)];
        c.frames_received.fetch_add(1, Ordering::Relaxed);
        c.bytes_received.fetch_add((HEADER_LEN + body) as u64, Ordering::Relaxed);
    }

    /// Every channel's totals, in [`Channel::ALL`] order.
    pub(crate) fn snapshot(&self) -> Vec<(Channel, ChannelTraffic)> {
        Channel::ALL
            .iter()
            .map(|&ch| {
                let c = &self.channels[index(ch)];
                let t = ChannelTraffic {
                    frames_sent: c.frames_sent.load(Ordering::Relaxed),
                    bytes_sent: c.bytes_sent.load(Ordering::Relaxed),
                    frames_received: c.frames_received.load(Ordering::Relaxed),
                    bytes_received: c.bytes_received.load(Ordering::Relaxed),
                };
                (ch, t)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_land_on_their_channel_with_the_header() {
        let t = Traffic::default();
        t.sent(Channel::Data, 100);
        t.sent(Channel::Data, 0);
        t.received(Channel::Control, 8);
        let s = t.snapshot();
        assert_eq!(
            s[1],
            (
                Channel::Data,
                ChannelTraffic {
                    frames_sent: 2,
                    bytes_sent: (2 * HEADER_LEN + 100) as u64,
                    ..ChannelTraffic::default()
                }
            )
        );
        assert_eq!(s[0].1.frames_received, 1);
        assert_eq!(s[0].1.bytes_received, (HEADER_LEN + 8) as u64);
        assert_eq!(s[2].1, ChannelTraffic::default());
    }
}

//! Blob pulls on the simulated net: what a QUIC blob stream does ([`crate::QuicNode::fetch_blob`]),
//! for [`SimLink`]s of one [`SimHub`].
//!
//! A node installs a [`BlobServer`] ([`SimLink::set_blob_server`]); a peer pulls a blob by its
//! BLAKE3 from it ([`SimLink::fetch_blob_with`]). The pull fails at once when the two do not
//! reach each other (a crash, a partition), takes a modelled transfer time on tokio's clock (one
//! round trip at the net's smallest delay plus the bytes at [`SIM_BLOB_BYTES_PER_US`]), and
//! fails if the peer crashed or was cut off meanwhile. A crash drops the node's server (a
//! restarted process holds nothing until it installs one again). Each pull is a line of the
//! hub's event log.

use std::sync::Arc;
use std::time::Duration;

use super::{SimHub, SimLink};
use crate::link::{LinkError, NodeId};
use crate::quic::{BlobServer, QuicError};

/// Modelled bandwidth of a simulated blob pull, bytes per microsecond (100 MB/s).
pub const SIM_BLOB_BYTES_PER_US: u64 = 100;

impl SimHub {
    /// Forgets `node`'s blob server (its process crashed).
    pub(super) fn drop_blob_server(&self, node: &NodeId) {
        self.lock().blobs.remove(node);
    }
}

impl SimLink {
    /// Serves pulls of this node's blobs from `server`, replacing any server there.
    pub fn set_blob_server(&self, server: Arc<dyn BlobServer>) {
        self.hub.lock().blobs.insert(self.id.clone(), server);
    }

    /// Pulls blob `id` (at most `max_len` bytes) from `peer` and hands the verified bytes to
    /// `take` (see the module docs for its timing and failures).
    pub async fn fetch_blob_with<T>(
        &self,
        peer: &NodeId,
        id: [u8; 32],
        max_len: u32,
        take: impl FnOnce(&[u8]) -> T,
    ) -> Result<T, QuicError> {
        let down = |why: &str| QuicError::Link(LinkError::PeerDown(peer.clone(), why.to_owned()));
        let (bytes, wait) = {
            let mut s = self.hub.lock();
            if !s.reachable(&self.id, peer) {
                return Err(down("not reachable on the simulated net"));
            }
            let bytes = s
                .blobs
                .get(peer)
                .and_then(|server| server.blob(&id))
                .ok_or_else(|| QuicError::Stream(format!("{peer}: no blob {}", hex8(&id))))?;
            if bytes.len() > max_len as usize {
                return Err(QuicError::Stream(format!(
                    "{peer}: blob of {} bytes, above the {max_len} asked for",
                    bytes.len()
                )));
            }
            let now = s.now;
            let line = format!("blob {}<-{peer} {} {}B", self.id, hex8(&id), bytes.len());
            s.net.note(now, &line);
            let transfer = bytes.len() as u64 / SIM_BLOB_BYTES_PER_US;
            (bytes, Duration::from_micros(2 * s.net.config().min_delay.0 + transfer))
        };
        tokio::time::sleep(wait).await;
        if !self.hub.lock().reachable(&self.id, peer) {
            return Err(down("lost during the pull on the simulated net"));
        }
        if blake3::hash(&bytes).as_bytes() != &id {
            return Err(QuicError::Stream(format!("blob from {peer} does not match its hash {}", hex8(&id))));
        }
        Ok(take(&bytes))
    }
}

fn hex8(id: &[u8; 32]) -> String {
    id.iter().take(4).map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::SimConfig;
    use std::sync::Mutex;

    struct One(Vec<u8>);

    impl BlobServer for One {
        fn blob(&self, id: &[u8; 32]) -> Option<Arc<Vec<u8>>> {
            (blake3::hash(&self.0).as_bytes() == id).then(|| Arc::new(self.0.clone()))
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_pull_takes_its_modelled_time_and_fails_across_a_crash() {
        let hub = SimHub::new(SimConfig::default());
        let (a, b) = (NodeId::new("a"), NodeId::new("b"));
        let la = hub.link(a.clone());
        let lb = hub.link(b.clone());
        let data = vec![7u8; 100_000];
        let id = *blake3::hash(&data).as_bytes();
        lb.set_blob_server(Arc::new(One(data.clone())));
        let start = tokio::time::Instant::now();
        let got = la.fetch_blob_with(&b, id, 1 << 20, <[u8]>::to_vec).await.unwrap();
        assert_eq!(got, data);
        let min = Duration::from_micros(100_000 / SIM_BLOB_BYTES_PER_US);
        assert!(start.elapsed() >= min, "{:?}", start.elapsed());
        assert!(la.fetch_blob_with(&b, [0; 32], 1 << 20, |_| ()).await.is_err(), "unknown blob");
        assert!(la.fetch_blob_with(&b, id, 10, |_| ()).await.is_err(), "above the cap");
        let seen = Mutex::new(false);
        hub.crash(&b);
        assert!(la.fetch_blob_with(&b, id, 1 << 20, |_| *seen.lock().unwrap() = true).await.is_err());
        hub.restart(&b);
        assert!(la.fetch_blob_with(&b, id, 1 << 20, |_| ()).await.is_err(), "a restart holds nothing");
        assert!(!*seen.lock().unwrap());
        assert!(hub.log().iter().any(|l| l.contains("blob a<-b")), "{:?}", hub.log());
    }
}

//! Per-connection memory budget: the bytes one peer makes this node hold.
//!
//! Frame limits alone are per frame: a peer may open many streams and announce a maximum-size
//! frame on each, or keep finished frames queued in the inboxes. A [`ConnBudget`] counts, for one
//! connection, the bytes of every frame buffer being received on any of its streams **and** of
//! every frame received but not yet consumed (a [`Delivery`](crate::link::Delivery) still queued
//! or held by the application). A frame buffer grows only as bytes arrive, and every growth is
//! charged here before it is allocated ([`FrameCharge::grow_to`]); the charge is released when
//! the frame's [`Held`] (carried by its `Delivery`) is dropped. A growth that would take the
//! connection past its cap fails with [`BudgetExceeded`], naming the peer, the cap and the bytes
//! held; the QUIC layer then closes that connection (other peers keep being served).
//!
//! What is *not* counted here: QUIC's own receive buffers, which flow control already bounds by
//! the connection receive window (`transport_config` in `quic.rs`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Default cap on the bytes one connection may hold buffered: 256 MiB. It fits three 64 MiB
/// tensors in flight at once plus headroom, and bounds what one peer can make a node hold.
pub const DEFAULT_CONN_BUDGET: u64 = 256 << 20;

/// A buffer growth that would take a connection past its budget.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "peer {peer} would hold {wanted} bytes buffered (holds {held}), over the per-connection cap of {cap} bytes"
)]
pub struct BudgetExceeded {
    /// The peer whose connection is over budget.
    pub peer: String,
    /// The connection's cap in bytes.
    pub cap: u64,
    /// Bytes held when the growth was refused.
    pub held: u64,
    /// Bytes the growth would have brought it to.
    pub wanted: u64,
}

#[derive(Debug)]
struct BudgetInner {
    peer: String,
    cap: u64,
    held: AtomicU64,
    high_water: AtomicU64,
}

impl BudgetInner {
    fn release(&self, bytes: u64) {
        if bytes > 0 {
            self.held.fetch_sub(bytes, Ordering::AcqRel);
        }
    }
}

/// The byte budget of one connection. Cheap to clone (clones share the count).
#[derive(Clone, Debug)]
pub struct ConnBudget {
    inner: Arc<BudgetInner>,
}

impl ConnBudget {
    /// A budget of `cap` bytes for the connection to `peer` (named in errors).
    pub fn new(peer: impl Into<String>, cap: u64) -> Self {
        Self {
            inner: Arc::new(BudgetInner {
                peer: peer.into(),
                cap,
                held: AtomicU64::new(0),
                high_water: AtomicU64::new(0),
            }),
        }
    }

    /// The cap in bytes.
    pub fn cap(&self) -> u64 {
        self.inner.cap
    }

    /// Bytes held now.
    pub fn held(&self) -> u64 {
        self.inner.held.load(Ordering::Acquire)
    }

    /// Most bytes ever held at once.
    pub fn high_water(&self) -> u64 {
        self.inner.high_water.load(Ordering::Acquire)
    }

    /// A new, empty charge for one frame buffer.
    pub fn frame(&self) -> FrameCharge {
        FrameCharge { budget: Some(self.inner.clone()), bytes: 0 }
    }

    /// Adds `bytes` to the count, or refuses (leaving the count unchanged) past the cap.
    fn charge(&self, bytes: u64) -> Result<(), BudgetExceeded> {
        let inner = &self.inner;
        let mut held = inner.held.load(Ordering::Acquire);
        loop {
            let wanted = held.saturating_add(bytes);
            if wanted > inner.cap {
                return Err(BudgetExceeded { peer: inner.peer.clone(), cap: inner.cap, held, wanted });
            }
            match inner.held.compare_exchange_weak(held, wanted, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    inner.high_water.fetch_max(wanted, Ordering::AcqRel);
                    return Ok(());
                }
                Err(now) => held = now,
            }
        }
    }
}

/// The bytes charged for one frame buffer; released on drop.
#[derive(Debug, Default)]
pub struct FrameCharge {
    budget: Option<Arc<BudgetInner>>,
    bytes: u64,
}

impl FrameCharge {
    /// A charge against no budget (reads that are not attributed to a connection).
    pub fn unbounded() -> Self {
        Self::default()
    }

    /// Bytes charged.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Raises the charge to `total` bytes (a no-op when it is already that large). Call before
    /// allocating: on `Err` nothing was charged and the buffer must not grow.
    pub fn grow_to(&mut self, total: u64) -> Result<(), BudgetExceeded> {
        if total <= self.bytes {
            return Ok(());
        }
        if let Some(inner) = &self.budget {
            ConnBudget { inner: inner.clone() }.charge(total - self.bytes)?;
        }
        self.bytes = total;
        Ok(())
    }

    /// Hands the charge to whatever keeps the frame ([`Held`], carried by its `Delivery`).
    pub fn into_held(self) -> Held {
        Held(Some(Arc::new(self)))
    }
}

impl Drop for FrameCharge {
    fn drop(&mut self) {
        if let Some(inner) = &self.budget {
            inner.release(self.bytes);
        }
    }
}

/// The charge a received frame keeps against its connection's budget, released when the last
/// clone is dropped. `Held::default()` holds nothing (frames that did not come from a peer).
#[derive(Clone, Debug, Default)]
pub struct Held(Option<Arc<FrameCharge>>);

impl Held {
    /// Bytes this frame keeps charged.
    pub fn bytes(&self) -> u64 {
        self.0.as_ref().map_or(0, |c| c.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_add_up_and_are_released_on_drop() {
        let b = ConnBudget::new("peer-a", 100);
        let mut f1 = b.frame();
        f1.grow_to(40).unwrap();
        f1.grow_to(30).unwrap(); // never shrinks
        assert_eq!((b.held(), f1.bytes()), (40, 40));
        let mut f2 = b.frame();
        f2.grow_to(60).unwrap();
        assert_eq!(b.held(), 100);
        let e = f2.grow_to(61).unwrap_err();
        assert_eq!(e, BudgetExceeded { peer: "peer-a".into(), cap: 100, held: 100, wanted: 101 });
        assert!(e.to_string().contains("peer peer-a") && e.to_string().contains("cap of 100"), "{e}");
        assert_eq!((b.held(), f2.bytes()), (100, 60), "a refused growth charges nothing");
        let held = f1.into_held();
        let copy = held.clone();
        drop(held);
        assert_eq!(b.held(), 100, "a clone still holds the frame");
        drop(copy);
        assert_eq!(b.held(), 60);
        drop(f2);
        assert_eq!((b.held(), b.high_water()), (0, 100));
    }

    #[test]
    fn concurrent_charges_never_pass_the_cap() {
        let b = ConnBudget::new("p", 1000);
        let kept: Vec<FrameCharge> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        (0..100)
                            .filter_map(|_| {
                                let mut f = b.frame();
                                f.grow_to(7).is_ok().then_some(f)
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            hs.into_iter().flat_map(|h| h.join().unwrap_or_default()).collect()
        });
        let ok = kept.len() as u64;
        assert_eq!(ok, 1000 / 7);
        assert_eq!(b.held(), ok * 7);
        drop(kept);
        assert_eq!(b.held(), 0);
    }

    #[test]
    fn unbounded_charges_count_but_refuse_nothing() {
        let mut f = FrameCharge::unbounded();
        f.grow_to(u64::MAX).unwrap();
        assert_eq!(f.into_held().bytes(), u64::MAX);
    }
}

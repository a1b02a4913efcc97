//! Spare host buffers: the host tier's freed buffers, kept for its next demotion.
//!
//! An expert that moves device -> host -> device would otherwise unmap its host buffer on every
//! promotion and fault fresh pages in on every demotion. Both costs landed in the executors'
//! expert-management time, and both grow with the expert's size. The spares are bounded by the
//! room the host tier leaves unused, so the tier's memory stays within its budget. A spare that
//! must go is unmapped on the reclaimer thread ([`crate::reclaimer`]).

use crate::direct_io::{AlignedBuf, DIRECT_ALIGN};
use crate::error::Result;
use crate::reclaimer::free_later;

/// A spare is reused for a request only if at most this share of its capacity would go unused.
const MAX_WASTE_DIVISOR: usize = 8;

/// Freed aligned buffers, smallest capacity first, at most `room` bytes in all.
#[derive(Debug, Default)]
pub struct SpareBuffers {
    /// Sorted by capacity.
    bufs: Vec<AlignedBuf>,
    bytes: u64,
}

impl SpareBuffers {
    /// Bytes held as spares.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// How many spares are held.
    pub fn len(&self) -> usize {
        self.bufs.len()
    }

    /// Whether no spare is held.
    pub fn is_empty(&self) -> bool {
        self.bufs.is_empty()
    }

    /// A buffer of `len` bytes: the smallest spare that holds them and wastes at most an eighth
    /// of its capacity (its old bytes are left in it: the caller overwrites all `len`), else a
    /// fresh zeroed one. The second value says whether a spare was reused.
    pub fn take(&mut self, len: usize) -> Result<(AlignedBuf, bool)> {
        let need = len.max(1).div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
        let at = self.bufs.partition_point(|b| b.capacity() < need);
        let fits = self.bufs.get(at).is_some_and(|b| b.capacity() - need <= b.capacity() / MAX_WASTE_DIVISOR);
        if fits {
            let mut buf = self.bufs.remove(at);
            self.bytes -= buf.capacity() as u64;
            let resized = buf.set_len(len);
            debug_assert!(resized, "a spare of capacity {} for {len} bytes", buf.capacity());
            return Ok((buf, true));
        }
        Ok((AlignedBuf::zeroed(len)?, false))
    }

    /// Keep `buf` as a spare, then drop the largest spares until they fit in `room` bytes.
    pub fn put(&mut self, buf: AlignedBuf, room: u64) {
        let at = self.bufs.partition_point(|b| b.capacity() < buf.capacity());
        self.bytes += buf.capacity() as u64;
        self.bufs.insert(at, buf);
        self.trim(room);
    }

    /// Give up the largest spares (to [`free_later`]) until they fit in `room` bytes.
    pub fn trim(&mut self, room: u64) {
        while self.bytes > room {
            let Some(b) = self.bufs.pop() else { break };
            self.bytes -= b.capacity() as u64;
            free_later(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spare_is_reused_only_when_it_fits_closely_and_the_spares_stay_within_their_room() {
        let mut s = SpareBuffers::default();
        let (mut a, reused) = s.take(10_000).unwrap();
        assert!(!reused);
        assert_eq!((a.len(), a.capacity()), (10_000, 12_288));
        a.as_mut_slice().fill(7);
        s.put(a, 1 << 20);
        assert_eq!(s.bytes(), 12_288);

        // 9000 bytes round to 12_288: the spare fits exactly and keeps its old bytes.
        let (b, reused) = s.take(9000).unwrap();
        assert!(reused && b.len() == 9000 && b.iter().all(|&x| x == 7));
        assert!(s.is_empty() && s.bytes() == 0);
        s.put(b, 1 << 20);

        // 4000 bytes need one page: a three-page spare would waste two thirds of itself.
        let (c, reused) = s.take(4000).unwrap();
        assert!(!reused && c.capacity() == 4096);
        assert_eq!(s.len(), 1);

        // The room shrinks below both: the largest goes first.
        s.put(c, 12_288);
        assert_eq!((s.len(), s.bytes()), (1, 4096));
        s.trim(0);
        assert!(s.is_empty() && s.bytes() == 0);
    }
}

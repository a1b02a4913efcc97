//! `MemoryPool`: a budgeted arena per device, managed by an offset allocator.
//!
//! The pool hands out `[offset, offset + len)` ranges inside `0..budget`; whoever owns the arena's
//! memory (the weight store's device tier, AdaSprite's cache region) maps them onto real bytes. Free
//! ranges live in a map keyed by offset and are coalesced with their neighbours on free; allocation is
//! best-fit (smallest block that fits, lowest offset on ties), and every length is rounded up to the
//! pool's alignment. Stats are exact, including external fragmentation.

use std::collections::{BTreeMap, HashMap};

use crate::error::{KernelError, Result};

/// A range handed out by a [`MemoryPool`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Allocation {
    /// Start, a multiple of the pool's alignment.
    pub offset: u64,
    /// Reserved length (the request rounded up to the alignment).
    pub len: u64,
}

impl Allocation {
    /// One past the last byte.
    pub fn end(&self) -> u64 {
        self.offset + self.len
    }
}

/// A snapshot of a pool's occupancy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PoolStats {
    /// Total bytes the pool may hand out.
    pub budget: u64,
    /// Bytes currently allocated (aligned lengths).
    pub used: u64,
    /// `budget - used`.
    pub free: u64,
    /// The largest contiguous free range.
    pub largest_free_block: u64,
    /// Number of free ranges.
    pub free_blocks: usize,
    /// Number of live allocations.
    pub allocations: usize,
    /// `1 - largest_free_block / free` (0 when nothing is free): the share of free memory that a
    /// single maximal request cannot use.
    pub external_fragmentation: f64,
}

/// A budgeted offset allocator (see the module docs).
#[derive(Clone, Debug)]
pub struct MemoryPool {
    label: String,
    budget: u64,
    align: u64,
    /// Free ranges: offset -> len, never adjacent (always coalesced).
    free: BTreeMap<u64, u64>,
    /// Live allocations: offset -> len.
    live: HashMap<u64, u64>,
    used: u64,
}

impl MemoryPool {
    /// A pool of `budget` bytes with `align`-byte alignment (a power of two). The budget is rounded
    /// down to the alignment so every block stays aligned.
    pub fn new(label: impl Into<String>, budget: u64, align: u64) -> Result<Self> {
        if align == 0 || !align.is_power_of_two() {
            return Err(KernelError::invalid(
                "MemoryPool::new",
                format!("alignment {align} is not a power of two"),
            ));
        }
        let budget = budget & !(align - 1);
        let mut free = BTreeMap::new();
        if budget > 0 {
            free.insert(0, budget);
        }
        Ok(Self { label: label.into(), budget, align, free, live: HashMap::new(), used: 0 })
    }

    /// The pool's label (used in errors).
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The budget in bytes.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// The alignment in bytes.
    pub fn alignment(&self) -> u64 {
        self.align
    }

    /// `len` rounded up to the alignment (`None` on overflow).
    pub fn aligned_len(&self, len: u64) -> Option<u64> {
        len.checked_add(self.align - 1).map(|v| v & !(self.align - 1))
    }

    /// The refusal of a request for `need` bytes, with the pool's state when it was refused.
    fn out_of_memory(&self, need: u64) -> KernelError {
        let s = self.stats();
        KernelError::OutOfMemory {
            pool: self.label.clone(),
            requested: need,
            free: s.free,
            largest_free: s.largest_free_block,
            budget: self.budget,
        }
    }

    /// Reserve `len` bytes (at least one alignment unit). Errors with
    /// [`KernelError::OutOfMemory`] when no free range is large enough.
    pub fn alloc(&mut self, len: u64) -> Result<Allocation> {
        let need = self.aligned_len(len.max(1)).unwrap_or(u64::MAX);
        let best = self
            .free
            .iter()
            .filter(|&(_, &l)| l >= need)
            .min_by_key(|&(&o, &l)| (l, o))
            .map(|(&o, &l)| (o, l));
        let Some((offset, block)) = best else {
            return Err(self.out_of_memory(need));
        };
        self.free.remove(&offset);
        if block > need {
            self.free.insert(offset + need, block - need);
        }
        self.live.insert(offset, need);
        self.used += need;
        Ok(Allocation { offset, len: need })
    }

    /// Reserve exactly `[offset, offset + len)` (`len` rounded up to the alignment): the placement
    /// a caller decided (AdaSprite's lifespan-ordered layout, `troupe_policy::adapt::layout`).
    /// Refused with [`KernelError::OutOfMemory`] when that range is not wholly inside one free
    /// range, and with an invalid-argument error when `offset` is not aligned; nothing changes then.
    pub fn alloc_at(&mut self, offset: u64, len: u64) -> Result<Allocation> {
        if offset & (self.align - 1) != 0 {
            return Err(KernelError::invalid(
                "MemoryPool::alloc_at",
                format!("offset {offset} is not a multiple of the alignment {}", self.align),
            ));
        }
        let need = self.aligned_len(len.max(1)).unwrap_or(u64::MAX);
        let end = offset.checked_add(need);
        let holder = self
            .free
            .range(..=offset)
            .next_back()
            .map(|(&o, &l)| (o, l))
            .filter(|&(o, l)| end.is_some_and(|e| e <= o + l));
        let Some((start, block)) = holder else {
            return Err(self.out_of_memory(need));
        };
        self.free.remove(&start);
        if offset > start {
            self.free.insert(start, offset - start);
        }
        let tail = (start + block) - (offset + need);
        if tail > 0 {
            self.free.insert(offset + need, tail);
        }
        self.live.insert(offset, need);
        self.used += need;
        Ok(Allocation { offset, len: need })
    }

    /// The free ranges `(offset, len)`, ascending by offset (coalesced: never adjacent).
    pub fn free_ranges(&self) -> Vec<(u64, u64)> {
        self.free.iter().map(|(&o, &l)| (o, l)).collect()
    }

    /// Return an allocation; its range is merged with free neighbours. Freeing anything that is
    /// not a live allocation (wrong length, double free) is an error and changes nothing.
    pub fn free(&mut self, a: Allocation) -> Result<()> {
        if self.live.get(&a.offset) != Some(&a.len) {
            return Err(KernelError::InvalidFree { pool: self.label.clone(), offset: a.offset, len: a.len });
        }
        self.live.remove(&a.offset);
        self.used -= a.len;
        let (mut start, mut len) = (a.offset, a.len);
        if let Some((&po, &pl)) = self.free.range(..start).next_back()
            && po + pl == start
        {
            self.free.remove(&po);
            start = po;
            len += pl;
        }
        if let Some(nl) = self.free.remove(&(a.offset + a.len)) {
            len += nl;
        }
        self.free.insert(start, len);
        Ok(())
    }

    /// Whether `len` bytes could be allocated right now.
    pub fn can_fit(&self, len: u64) -> bool {
        let need = self.aligned_len(len.max(1)).unwrap_or(u64::MAX);
        self.free.values().any(|&l| l >= need)
    }

    /// Exact occupancy figures.
    pub fn stats(&self) -> PoolStats {
        let free = self.budget - self.used;
        let largest = self.free.values().copied().max().unwrap_or(0);
        PoolStats {
            budget: self.budget,
            used: self.used,
            free,
            largest_free_block: largest,
            free_blocks: self.free.len(),
            allocations: self.live.len(),
            external_fragmentation: if free == 0 { 0.0 } else { 1.0 - largest as f64 / free as f64 },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn alloc_free_coalesce_by_hand() {
        let mut p = MemoryPool::new("t", 1000, 64).unwrap();
        assert_eq!(p.budget(), 960, "rounded down to the alignment");
        let a = p.alloc(100).unwrap(); // 128 at 0
        let b = p.alloc(64).unwrap(); // 64 at 128
        let c = p.alloc(1).unwrap(); // 64 at 192
        assert_eq!((a.offset, a.len, b.offset, c.offset), (0, 128, 128, 192));
        p.free(b).unwrap();
        // Free: [128,192) and [256,960): 64 + 704 = 768 free, largest 704.
        let s = p.stats();
        assert_eq!((s.used, s.free, s.largest_free_block, s.free_blocks), (192, 768, 704, 2));
        assert!((s.external_fragmentation - (1.0 - 704.0 / 768.0)).abs() < 1e-12);
        // Best fit puts a 64-byte request in the 64-byte hole, not the big block.
        let d = p.alloc(50).unwrap();
        assert_eq!(d.offset, 128);
        p.free(d).unwrap();
        p.free(a).unwrap();
        p.free(c).unwrap();
        let s = p.stats();
        assert_eq!((s.used, s.free_blocks, s.largest_free_block), (0, 1, 960));
        assert_eq!(s.external_fragmentation, 0.0);
        assert!(p.free(c).is_err(), "double free");
        let err = p.alloc(961).unwrap_err().to_string();
        assert!(err.contains("cannot allocate 1024"), "{err}");
    }

    #[test]
    fn alloc_at_takes_exactly_the_range_asked_or_nothing() {
        let mut p = MemoryPool::new("t", 1024, 64).unwrap();
        let a = p.alloc_at(256, 100).unwrap();
        assert_eq!((a.offset, a.len), (256, 128));
        assert_eq!(p.free_ranges(), vec![(0, 256), (384, 640)]);
        // Overlapping a live range, past the budget, or unaligned: refused, nothing changes.
        assert!(p.alloc_at(320, 64).is_err());
        assert!(p.alloc_at(192, 128).is_err());
        assert!(p.alloc_at(960, 128).is_err());
        assert!(p.alloc_at(10, 64).is_err());
        assert_eq!(p.free_ranges(), vec![(0, 256), (384, 640)]);
        let b = p.alloc_at(960, 64).unwrap();
        assert_eq!(p.free_ranges(), vec![(0, 256), (384, 576)]);
        p.free(a).unwrap();
        p.free(b).unwrap();
        assert_eq!(p.free_ranges(), vec![(0, 1024)]);
    }

    #[derive(Clone, Debug)]
    enum Step {
        Alloc(u64),
        Free(usize),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            3 => (1u64..3000).prop_map(Step::Alloc),
            2 => any::<usize>().prop_map(Step::Free),
        ]
    }

    /// Gaps between live allocations (sorted), i.e. the free ranges a coalescing allocator must have.
    fn gaps(live: &[Allocation], budget: u64) -> Vec<u64> {
        let mut sorted = live.to_vec();
        sorted.sort_by_key(|a| a.offset);
        let mut out = Vec::new();
        let mut cursor = 0;
        for a in &sorted {
            if a.offset > cursor {
                out.push(a.offset - cursor);
            }
            cursor = a.end();
        }
        if budget > cursor {
            out.push(budget - cursor);
        }
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        #[test]
        fn random_sequences_keep_invariants(steps in proptest::collection::vec(step(), 1..120)) {
            let budget = 16 * 1024;
            let mut pool = MemoryPool::new("prop", budget, 256).unwrap();
            let mut live: Vec<Allocation> = Vec::new();
            for s in steps {
                match s {
                    Step::Alloc(len) => {
                        let want = len.div_ceil(256) * 256;
                        let fits_somewhere = gaps(&live, budget).iter().any(|&g| g >= want);
                        match pool.alloc(len) {
                            Ok(a) => {
                                prop_assert_eq!(a.len, want);
                                prop_assert_eq!(a.offset % 256, 0);
                                prop_assert!(a.end() <= budget, "beyond budget");
                                for b in &live {
                                    prop_assert!(a.end() <= b.offset || b.end() <= a.offset, "overlap {:?} {:?}", a, b);
                                }
                                live.push(a);
                            }
                            Err(_) => prop_assert!(!fits_somewhere, "refused although a gap fits"),
                        }
                    }
                    Step::Free(i) if !live.is_empty() => {
                        let a = live.swap_remove(i % live.len());
                        pool.free(a).unwrap();
                    }
                    Step::Free(_) => {}
                }
                let used: u64 = live.iter().map(|a| a.len).sum();
                let g = gaps(&live, budget);
                let largest = g.iter().copied().max().unwrap_or(0);
                let st = pool.stats();
                prop_assert!(st.used <= budget);
                prop_assert_eq!(st.used, used);
                prop_assert_eq!(st.free, budget - used);
                prop_assert_eq!(st.largest_free_block, largest);
                prop_assert_eq!(st.free_blocks, g.len(), "free ranges must be fully coalesced");
                prop_assert_eq!(st.allocations, live.len());
                let frag = if budget == used { 0.0 } else { 1.0 - largest as f64 / (budget - used) as f64 };
                prop_assert!((st.external_fragmentation - frag).abs() < 1e-12);
            }
        }
    }
}

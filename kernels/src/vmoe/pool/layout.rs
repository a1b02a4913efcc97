//! Carries out the lifespan-ordered layout ([`troupe_policy::adapt::layout`]) on the pool's real
//! buffers: with it on ([`CoAdaptPool::set_ordered`]), long-lived buffers (shared parts, experts,
//! projector, and the optimiser state, now allocated with the model) go first-fit from the low
//! end, the reuse tier's arena takes the top end, and each step's or slice's temporaries take
//! contiguous slots placed low to high in execution order at the top of the free memory below the
//! reuse tier (the runtime-managed region). Off (the default, and every baseline): best fit for
//! everything, optimiser state on the first step, the reuse arena wherever best fit puts it.

use troupe_policy::adapt::layout::{Temporary, place_long_lived, place_temporaries, reuse_tier_offset};

use super::{CoAdaptPool, VMoeError};
use crate::KernelError;
use crate::pool::Allocation;

impl CoAdaptPool {
    /// Turns the lifespan-ordered layout on or off (see the module docs). Only on an empty pool
    /// (before any load or the reuse cache), since buffers already placed would not move.
    pub fn set_ordered(&mut self, on: bool) -> Result<(), VMoeError> {
        if self.pool.stats().used > 0 {
            return Err(VMoeError::Config("the pool's layout is set before anything is allocated".into()));
        }
        self.ordered = on;
        Ok(())
    }

    /// The last step's (or slice's) temporaries region `[start, end)` with the layout on (`None`
    /// before the first step or with it off).
    pub fn last_region(&self) -> Option<(u64, u64)> {
        self.last_region
    }

    /// Whether the lifespan-ordered layout is on.
    pub fn ordered(&self) -> bool {
        self.ordered
    }

    /// Where the reuse arena of `bytes` goes: the pool's top end with the layout on, anywhere
    /// (best fit) off.
    pub(super) fn reuse_arena_at(&self, bytes: u64) -> Option<u64> {
        if !self.ordered {
            return None;
        }
        let s = self.pool.stats();
        reuse_tier_offset(s.budget, bytes, self.pool.alignment())
    }

    /// The first byte the layout keeps from long-lived buffers and temporaries: the reuse arena's
    /// start, or the budget without one.
    fn layout_limit(&self) -> u64 {
        self.reuse
            .as_ref()
            .map_or(self.pool.budget(), |r| if self.ordered { r.arena().offset } else { self.pool.budget() })
    }

    fn refused(&self, need: u64) -> VMoeError {
        let s = self.pool.stats();
        VMoeError::Kernel(KernelError::OutOfMemory {
            pool: self.pool.label().to_string(),
            requested: need,
            free: s.free,
            largest_free: s.largest_free_block,
            budget: s.budget,
        })
    }

    /// Frees what `taken` holds, records the refusal and hands `e` back.
    fn give_back(&mut self, taken: &mut Vec<Allocation>, e: VMoeError) -> VMoeError {
        for a in taken.drain(..) {
            if let Err(f) = self.pool.free(a) {
                return f.into();
            }
        }
        self.sample("refused");
        e
    }

    /// A long-lived buffer of `bytes` (kept with a model until it leaves), pushed onto `taken`; on
    /// refusal everything in `taken` is freed.
    pub(super) fn alloc(&mut self, bytes: u64, taken: &mut Vec<Allocation>) -> Result<Allocation, VMoeError> {
        let placed = if self.ordered {
            let limit = self.layout_limit();
            match place_long_lived(&self.pool.free_ranges(), bytes, self.pool.alignment(), limit) {
                Ok(at) => self.pool.alloc_at(at, bytes).map_err(VMoeError::from),
                Err(_) => Err(self.refused(self.pool.aligned_len(bytes.max(1)).unwrap_or(u64::MAX))),
            }
        } else {
            self.pool.alloc(bytes).map_err(VMoeError::from)
        };
        match placed {
            Ok(a) => {
                taken.push(a);
                self.peak_used = self.peak_used.max(self.pool.stats().used);
                Ok(a)
            }
            Err(e) => Err(self.give_back(taken, e)),
        }
    }

    /// One step's (or slice's) temporaries, `sizes` in execution order, pushed onto `taken`; on
    /// refusal everything in `taken` is freed. With the layout on they are one contiguous region
    /// placed by the policy ([`place_temporaries`]); off, each is best fit.
    pub(super) fn alloc_temporaries(
        &mut self,
        sizes: &[u64],
        taken: &mut Vec<Allocation>,
    ) -> Result<(), VMoeError> {
        if !self.ordered {
            for &b in sizes {
                match self.pool.alloc(b) {
                    Ok(a) => taken.push(a),
                    Err(e) => return Err(self.give_back(taken, e.into())),
                }
            }
            self.peak_used = self.peak_used.max(self.pool.stats().used);
            return Ok(());
        }
        let temps: Vec<Temporary> = sizes
            .iter()
            .enumerate()
            .map(|(i, &bytes)| Temporary { order: u32::try_from(i).unwrap_or(u32::MAX), bytes })
            .collect();
        let limit = self.layout_limit();
        let slots = match place_temporaries(&self.pool.free_ranges(), &temps, self.pool.alignment(), limit) {
            Ok(s) => s,
            Err(_) => {
                let need = sizes.iter().map(|b| self.pool.aligned_len((*b).max(1)).unwrap_or(u64::MAX)).sum();
                let e = self.refused(need);
                return Err(self.give_back(taken, e));
            }
        };
        let start = slots.first().map_or(0, |s| s.offset);
        let end = slots.last().map_or(0, |s| s.offset + s.len);
        for s in slots {
            match self.pool.alloc_at(s.offset, s.len) {
                Ok(a) => taken.push(a),
                Err(e) => return Err(self.give_back(taken, e.into())),
            }
        }
        self.last_region = Some((start, end));
        self.peak_used = self.peak_used.max(self.pool.stats().used);
        Ok(())
    }
}

//! Carries out the lifespan-ordered layout ([`troupe_policy::adapt::layout`]) on the pool's real
//! buffers: with it on ([`CoAdaptPool::set_ordered`]), long-lived buffers (shared parts, experts,
//! projector, and the optimiser state, now allocated with the model) go first-fit from the low
//! end and slide down with a real copy when a departed model leaves a hole below them
//! ([`CoAdaptPool::compacted_bytes`] counts the bytes), the reuse tier's arena takes the top end, and each step's or slice's temporaries take
//! contiguous slots placed low to high in execution order at the top of the free memory below the
//! reuse tier (the runtime-managed region). Off (the default, and every baseline): best fit for
//! everything, optimiser state on the first step, the reuse arena wherever best fit puts it.

use troupe_policy::adapt::layout::{
    Temporary, place_long_lived, place_temporaries, plan_compaction, reuse_tier_offset,
};

use super::{CoAdaptPool, ModelId, VMoeError};
use crate::pool::Allocation;
use crate::vmoe::ParamGroup;
use crate::{KernelError, Tensor};

/// What a long-lived buffer holds, so that compaction moves its bytes with its place.
enum Holder {
    Shared([u8; 32]),
    Expert(ModelId, usize, usize),
    Projector(ModelId),
    State(ModelId),
}

/// Gives `t` a fresh buffer holding its values: the copy a move in the pool costs.
fn relocate(t: &mut Tensor) -> Result<(), VMoeError> {
    let values = t.as_f32()?.to_vec();
    *t = Tensor::from_f32(t.shape(), values)?;
    Ok(())
}

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

    /// Closes the holes a departed model left below buffers still resident (with the layout on;
    /// off, nothing moves): the long-lived buffers slide down in address order until they are
    /// contiguous from the pool's low end ([`plan_compaction`]), each with a real copy of the
    /// bytes it holds (weights, experts, projector, optimiser moments) into a fresh buffer, the
    /// copy a device pool would make. Runs between steps, when no temporaries are live. Returns
    /// the bytes moved.
    pub(super) fn compact(&mut self) -> Result<u64, VMoeError> {
        if !self.ordered {
            return Ok(0);
        }
        let mut holders = Vec::new();
        let mut live = Vec::new();
        for (key, e) in &self.shared {
            holders.push(Holder::Shared(*key));
            live.push((e.alloc.offset, e.alloc.len));
        }
        for (&id, p) in &self.models {
            for (b, row) in p.expert_allocs.iter().enumerate() {
                for (e, a) in row.iter().enumerate() {
                    holders.push(Holder::Expert(id, b, e));
                    live.push((a.offset, a.len));
                }
            }
            holders.push(Holder::Projector(id));
            live.push((p.projector_alloc.offset, p.projector_alloc.len));
            if let Some(a) = p.state.or(p.trainer.as_ref().map(|t| t.1)) {
                holders.push(Holder::State(id));
                live.push((a.offset, a.len));
            }
        }
        let mut moved = 0;
        for m in plan_compaction(&live) {
            let len = live[m.index].1;
            self.pool.free(Allocation { offset: m.from, len })?;
            let to = self.pool.alloc_at(m.to, len)?;
            self.carry(&holders[m.index], to)?;
            moved += len;
        }
        if moved > 0 {
            self.compacted_bytes += moved;
            self.sample("compact");
        }
        Ok(moved)
    }

    /// Records `to` as the new place of what `holder` names and copies its bytes there.
    fn carry(&mut self, holder: &Holder, to: Allocation) -> Result<(), VMoeError> {
        let missing = |id: &ModelId| VMoeError::UnknownModel(id.0);
        match holder {
            Holder::Shared(key) => {
                let Some(entry) = self.shared.get_mut(key) else {
                    return Err(VMoeError::Config("a shared tensor left the pool while it compacted".into()));
                };
                entry.alloc = to;
                relocate(&mut entry.tensor)?;
                // Every model that merged it points at the one moved buffer again.
                for p in self.models.values_mut() {
                    let mut keys = p.shared_keys.iter();
                    for (group, t) in p.model.params.tensors_mut() {
                        if group == ParamGroup::Shared && keys.next() == Some(key) {
                            *t = entry.tensor.clone();
                        }
                    }
                }
            }
            Holder::Expert(id, b, e) => {
                let p = self.models.get_mut(id).ok_or_else(|| missing(id))?;
                p.expert_allocs[*b][*e] = to;
                for (group, t) in p.model.params.tensors_mut() {
                    if group == (ParamGroup::Expert { block: *b, expert: *e }) {
                        relocate(t)?;
                    }
                }
            }
            Holder::Projector(id) => {
                let p = self.models.get_mut(id).ok_or_else(|| missing(id))?;
                p.projector_alloc = to;
                for (group, t) in p.model.params.tensors_mut() {
                    if group == ParamGroup::Projector {
                        relocate(t)?;
                    }
                }
            }
            Holder::State(id) => {
                let p = self.models.get_mut(id).ok_or_else(|| missing(id))?;
                if p.state.is_some() {
                    // Reserved at load, no moments written yet: nothing to copy.
                    p.state = Some(to);
                } else if let Some((trainer, a)) = p.trainer.as_mut() {
                    *a = to;
                    trainer.relocate_state();
                }
            }
        }
        Ok(())
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

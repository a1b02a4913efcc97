//! What the executor does when the pool refuses memory (a load, optimiser state or a slice): which
//! resident model to unload, whether to split the slice, or to give up. Pure: the executor passes
//! who is resident and when each last ran, then carries the decision out and retries.
//!
//! Rule: unload the model idle longest outside the current cycle; if every resident model belongs
//! to the cycle, unload the cycle member idle longest that the refused work does not need (free
//! space can be too fragmented for the cycle's own models to fit together; it is reloaded before
//! it runs); else split a slice of more than one expert in two (half the temporaries at a time);
//! else, once per refused slice, reload one of the slice's own models (unloading and merging it
//! back packs its buffers into the free space, which undoes fragmentation; its optimiser state
//! starts over); else give up. Unloading comes before splitting because a split costs the
//! slice's task a whole forward and backward pass more on this step, while an unloaded member
//! costs a copy to the host and a merge before its turn: at K = 12 in the bench, 48 splits made
//! ours' steps a quarter dearer than whole-task steps. A preload merged while a cycle runs may only unload models outside
//! the cycle; otherwise it waits on the host. Ties go to the lower task id, so the choice is deterministic.
//!
//! Before a step is planned ([`make_room`]): when the free bytes cannot train the cycle's largest
//! task whole, models outside the cycle (finished waiting for their next turn, or preloaded) are
//! unloaded, idlest first, until it can. Splitting a task over slices costs a forward and backward
//! pass per slice on every step of the cycle; unloading an idle model costs a copy to the host now
//! and a merge when its turn comes. A preload is merged while a cycle runs only when the cycle's
//! step still fits after it ([`preload_fits`]); otherwise it stays prepared on the host.

use super::TaskId;

/// A model resident in the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resident {
    /// Its task.
    pub task: TaskId,
    /// The last cycle that ran (or preloaded) it.
    pub last_cycle: u64,
    /// Whether it belongs to the current cycle.
    pub in_cycle: bool,
}

/// What was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused<'a> {
    /// Loading this task's model or allocating its optimiser state.
    Load(TaskId),
    /// Merging this task's preloaded model while a cycle runs: only models outside the cycle may go.
    Preload(TaskId),
    /// A slice over these tasks with this many experts.
    Slice {
        /// The tasks whose experts are in the slice (they must stay resident).
        tasks: &'a [TaskId],
        /// Experts in the slice.
        experts: usize,
        /// Whether the executor already reloaded one of its models for this slice.
        reloaded: bool,
    },
}

/// The decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnRefusal {
    /// Unload this task's model and retry.
    Evict(TaskId),
    /// Run the slice as two halves, in order.
    Split,
    /// Unload this task's model (one of the refused slice's) and merge it back in, then retry.
    Reload(TaskId),
    /// Nothing helps: report the refusal.
    GiveUp,
}

/// A resident model outside the running cycle, as [`make_room`] sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Idle {
    /// Its task.
    pub task: TaskId,
    /// The last cycle that ran (or preloaded) it.
    pub last_cycle: u64,
    /// Bytes unloading it gives back to the pool.
    pub bytes: u64,
}

/// The idle models to unload before a step so that `need` bytes are free (see the module doc):
/// idlest first (ties to the lower task id), as few as reach `need`; none when `free` already
/// does, or when even all of them would not (the step is then planned in the room there is).
pub fn make_room(idle: &[Idle], free: u64, need: u64) -> Vec<TaskId> {
    if free >= need {
        return Vec::new();
    }
    let mut order: Vec<&Idle> = idle.iter().collect();
    order.sort_by_key(|m| (m.last_cycle, m.task));
    let mut room = free;
    let mut out = Vec::new();
    for m in order {
        room = room.saturating_add(m.bytes);
        out.push(m.task);
        if room >= need {
            return out;
        }
    }
    Vec::new()
}

/// Whether a preloaded model of `bytes` may be merged while a cycle runs: the cycle's step
/// (`need` bytes) must still fit in the `free` bytes left after it.
pub fn preload_fits(free: u64, bytes: u64, need: u64) -> bool {
    free >= bytes.saturating_add(need)
}

/// Decides (see the module doc).
pub fn on_refusal(resident: &[Resident], refused: &Refused<'_>) -> OnRefusal {
    let needed = |t: TaskId| match refused {
        Refused::Load(n) | Refused::Preload(n) => *n == t,
        Refused::Slice { tasks, .. } => tasks.contains(&t),
    };
    let idlest = |outside_cycle: bool| {
        resident
            .iter()
            .filter(|r| !needed(r.task) && (!outside_cycle || !r.in_cycle))
            .min_by_key(|r| (r.last_cycle, r.task))
            .map(|r| r.task)
    };
    if let Some(t) = idlest(true) {
        return OnRefusal::Evict(t);
    }
    if matches!(refused, Refused::Preload(_)) {
        return OnRefusal::GiveUp;
    }
    if let Some(t) = idlest(false) {
        return OnRefusal::Evict(t);
    }
    if let Refused::Slice { experts, .. } = refused
        && *experts > 1
    {
        return OnRefusal::Split;
    }
    match refused {
        Refused::Slice { tasks, reloaded: false, .. } => resident
            .iter()
            .filter(|r| tasks.contains(&r.task))
            .min_by_key(|r| (r.last_cycle, r.task))
            .map_or(OnRefusal::GiveUp, |r| OnRefusal::Reload(r.task)),
        _ => OnRefusal::GiveUp,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(task: u32, last_cycle: u64, in_cycle: bool) -> Resident {
        Resident { task: TaskId(task), last_cycle, in_cycle }
    }

    #[test]
    fn the_idlest_model_outside_the_cycle_goes_first() {
        let rs = [r(0, 5, true), r(1, 3, false), r(2, 1, false), r(3, 1, true)];
        assert_eq!(on_refusal(&rs, &Refused::Load(TaskId(0))), OnRefusal::Evict(TaskId(2)));
        // Equal idleness: the lower id.
        let rs = [r(4, 1, false), r(2, 1, false)];
        assert_eq!(on_refusal(&rs, &Refused::Load(TaskId(9))), OnRefusal::Evict(TaskId(2)));
    }

    #[test]
    fn the_needed_model_is_never_chosen() {
        let rs = [r(0, 0, false), r(1, 4, false)];
        assert_eq!(on_refusal(&rs, &Refused::Load(TaskId(0))), OnRefusal::Evict(TaskId(1)));
        let slice = [TaskId(0), TaskId(1)];
        // Nothing else to unload: the slice's own model is reloaded once (compaction), then give up.
        assert_eq!(
            on_refusal(&rs, &Refused::Slice { tasks: &slice, experts: 1, reloaded: false }),
            OnRefusal::Reload(TaskId(0))
        );
        assert_eq!(
            on_refusal(&rs, &Refused::Slice { tasks: &slice, experts: 1, reloaded: true }),
            OnRefusal::GiveUp
        );
    }

    #[test]
    fn inside_the_cycle_a_member_is_unloaded_before_a_slice_splits() {
        let rs = [r(0, 7, true), r(1, 6, true)];
        let slice = [TaskId(0)];
        for experts in [1, 3] {
            assert_eq!(
                on_refusal(&rs, &Refused::Slice { tasks: &slice, experts, reloaded: false }),
                OnRefusal::Evict(TaskId(1))
            );
        }
        // With only the slice's own models resident, a slice of several experts splits; one of
        // a single expert reloads its model once (compaction).
        assert_eq!(
            on_refusal(&rs[..1], &Refused::Slice { tasks: &slice, experts: 3, reloaded: false }),
            OnRefusal::Split
        );
        assert_eq!(
            on_refusal(&rs[..1], &Refused::Slice { tasks: &slice, experts: 1, reloaded: false }),
            OnRefusal::Reload(TaskId(0))
        );
        // A load inside a full cycle unloads the idlest other member; alone, it gives up.
        assert_eq!(on_refusal(&rs, &Refused::Load(TaskId(1))), OnRefusal::Evict(TaskId(0)));
        assert_eq!(on_refusal(&[r(0, 7, true)], &Refused::Load(TaskId(0))), OnRefusal::GiveUp);
        assert_eq!(on_refusal(&[], &Refused::Load(TaskId(0))), OnRefusal::GiveUp);
    }

    fn idle(task: u32, last_cycle: u64, bytes: u64) -> Idle {
        Idle { task: TaskId(task), last_cycle, bytes }
    }

    #[test]
    fn room_is_made_from_the_idlest_models_and_only_when_it_is_reached() {
        let ms = [idle(3, 4, 100), idle(1, 2, 100), idle(2, 2, 50), idle(0, 5, 500)];
        // Enough already: nothing goes.
        assert!(make_room(&ms, 1000, 1000).is_empty());
        // 120 short: idlest first (cycle 2, ids 1 then 2), as few as reach it.
        assert_eq!(make_room(&ms, 880, 1000), [TaskId(1), TaskId(2)]);
        assert_eq!(make_room(&ms, 950, 1000), [TaskId(1)]);
        // Everything together: 750 B; 800 short is out of reach, so nothing is unloaded.
        assert!(make_room(&ms, 200, 1000).is_empty());
        assert_eq!(make_room(&ms, 250, 1000), [TaskId(1), TaskId(2), TaskId(3), TaskId(0)]);
        assert!(make_room(&[], 0, 1).is_empty());
    }

    #[test]
    fn a_preload_fits_only_with_the_step_still_free_after_it() {
        assert!(preload_fits(1000, 300, 700));
        assert!(!preload_fits(999, 300, 700));
        assert!(!preload_fits(u64::MAX - 1, u64::MAX, 1));
    }

    #[test]
    fn a_preload_never_unloads_a_model_of_the_running_cycle() {
        let rs = [r(0, 1, true), r(1, 9, false), r(2, 0, true)];
        assert_eq!(on_refusal(&rs, &Refused::Preload(TaskId(5))), OnRefusal::Evict(TaskId(1)));
        assert_eq!(on_refusal(&rs[..1], &Refused::Preload(TaskId(5))), OnRefusal::GiveUp);
        assert_eq!(on_refusal(&[r(2, 0, true)], &Refused::Preload(TaskId(5))), OnRefusal::GiveUp);
    }
}

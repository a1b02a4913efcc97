//! The lifespan-ordered layout of the co-adaptation pool (AdaSprite §3.2.1 and §3.3: "contiguous
//! slots within a runtime-managed cache region", placed "from low to high addresses based on the
//! execution order").
//!
//! The pool's address space `0..budget` is split by lifespan so that buffers of different
//! lifespans never interleave, which is what leaves holes in a best-fit pool:
//! * **long-lived** buffers (a model's weights, experts, projector and its optimiser state, all
//!   allocated when the model is loaded and freed together when it leaves) are placed first-fit
//!   from the low end ([`place_long_lived`]), and when a model leaves a hole below buffers still
//!   resident they slide down to close it ([`plan_compaction`]: preloading makes models resident
//!   in arrival order, so the first to finish is seldom the top one);
//! * the **reuse tier** (the stem-token cache's memory arena) takes the top end of the pool
//!   ([`reuse_tier_offset`]), out of every step's way;
//! * a step's (or time slice's) **temporaries** (activations, gradients, expert scratch: reserved
//!   together and freed together when the step ends) form the runtime-managed region: contiguous
//!   slots placed low to high in execution order, packed against the top of the highest free range
//!   below the reuse tier ([`place_temporaries`]), so that while a step runs the free memory below
//!   them stays one block and when it ends the region leaves no hole.
//!
//! Pure: the pool hands in its free ranges and sizes, and carries the offsets out with real buffers
//! (`troupe_kernels::vmoe::CoAdaptPool`). [`check_slots`] is the region's invariant.

/// A step's temporary: its rank in the step's execution order and its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Temporary {
    /// Position in execution order (0 first); ties keep the given order.
    pub order: u32,
    /// Bytes (rounded up to the pool's alignment by [`place_temporaries`]).
    pub bytes: u64,
}

/// Where one temporary lives: `[offset, offset + len)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    /// Index of the temporary in the caller's list.
    pub index: usize,
    /// Start (aligned).
    pub offset: u64,
    /// Aligned length.
    pub len: u64,
}

/// Why a placement was refused or a set of slots breaks the region's invariant.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// No free range below the limit holds the bytes asked in one piece.
    #[error("no free range below {limit} holds {need} contiguous bytes")]
    NoRoom {
        /// Bytes needed in one piece.
        need: u64,
        /// The highest address the placement may use.
        limit: u64,
    },
    /// The alignment is not a power of two.
    #[error("alignment {0} is not a power of two")]
    BadAlignment(u64),
    /// Two slots share bytes.
    #[error("slots {0} and {1} overlap")]
    Overlap(usize, usize),
    /// A later temporary in execution order sits at a lower address.
    #[error("slot {later} comes after slot {earlier} in execution order but lies below it")]
    OrderViolated {
        /// The earlier temporary's index.
        earlier: usize,
        /// The later one's.
        later: usize,
    },
    /// Consecutive slots leave a gap (the region must stay contiguous).
    #[error("a gap of {gap} bytes after slot {after}")]
    Gap {
        /// The slot before the gap.
        after: usize,
        /// Its size.
        gap: u64,
    },
    /// A slot lies outside the region it was checked against, or is shorter than its temporary.
    #[error("slot {0} is outside the region or shorter than its temporary")]
    OutOfRegion(usize),
    /// The slots do not cover every temporary exactly once.
    #[error("the slots do not name every temporary once")]
    Mismatch,
}

fn align_up(v: u64, align: u64) -> Option<u64> {
    v.checked_add(align - 1).map(|x| x & !(align - 1))
}

fn check_align(align: u64) -> Result<u64, LayoutError> {
    if align == 0 || !align.is_power_of_two() { Err(LayoutError::BadAlignment(align)) } else { Ok(align) }
}

/// Where a long-lived buffer of `len` bytes goes: the lowest free offset (first fit from the low
/// end) whose range holds it whole and ends at or below `limit`. `free` is the pool's free ranges
/// `(offset, len)`, in any order.
pub fn place_long_lived(free: &[(u64, u64)], len: u64, align: u64, limit: u64) -> Result<u64, LayoutError> {
    let align = check_align(align)?;
    let need = align_up(len.max(1), align).ok_or(LayoutError::NoRoom { need: len, limit })?;
    free.iter()
        .filter(|&&(o, l)| l >= need && o.checked_add(need).is_some_and(|e| e <= limit))
        .map(|&(o, _)| o)
        .min()
        .ok_or(LayoutError::NoRoom { need, limit })
}

/// Where the reuse tier of `bytes` goes in a pool of `budget` bytes: its top end (aligned down),
/// or `None` when it does not fit.
pub fn reuse_tier_offset(budget: u64, bytes: u64, align: u64) -> Option<u64> {
    let align = check_align(align).ok()?;
    let need = align_up(bytes.max(1), align)?;
    let top = budget & !(align - 1);
    top.checked_sub(need)
}

/// The runtime-managed region of one step: the temporaries' slots, contiguous and low to high in
/// execution order, packed against the top of the highest free range that ends at or below `limit`
/// (the reuse tier's start) and holds them all. Returned in execution order. Refused when no free
/// range holds them in one piece (the caller then frees nothing: nothing was taken).
pub fn place_temporaries(
    free: &[(u64, u64)],
    temps: &[Temporary],
    align: u64,
    limit: u64,
) -> Result<Vec<Slot>, LayoutError> {
    let align = check_align(align)?;
    let mut order: Vec<usize> = (0..temps.len()).collect();
    order.sort_by_key(|&i| temps[i].order);
    let mut lens = Vec::with_capacity(order.len());
    let mut total = 0u64;
    for &i in &order {
        let l =
            align_up(temps[i].bytes.max(1), align).ok_or(LayoutError::NoRoom { need: u64::MAX, limit })?;
        total = total.checked_add(l).ok_or(LayoutError::NoRoom { need: u64::MAX, limit })?;
        lens.push(l);
    }
    // The highest range (by its usable top) that holds the whole region.
    let top = free
        .iter()
        .filter_map(|&(o, l)| {
            let end = o.saturating_add(l).min(limit) & !(align - 1);
            (end >= o && end - o >= total).then_some(end)
        })
        .max()
        .ok_or(LayoutError::NoRoom { need: total, limit })?;
    let mut at = top - total;
    let mut slots = Vec::with_capacity(order.len());
    for (&i, &len) in order.iter().zip(&lens) {
        slots.push(Slot { index: i, offset: at, len });
        at += len;
    }
    Ok(slots)
}

/// One long-lived buffer's move when the pool compacts: buffer `index` (in the caller's list)
/// from `from` down to `to`, its length unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Move {
    /// Index of the buffer in the caller's list.
    pub index: usize,
    /// Where it starts now.
    pub from: u64,
    /// Where it starts after the move (below `from`).
    pub to: u64,
}

/// Compaction when a model leaves (the copying collectors AdaSprite cites for §3.2): the
/// long-lived buffers `live` (`(offset, len)`, aligned, not overlapping, any order) slid down in
/// address order until they are contiguous from address 0, so the free memory below the reuse tier
/// is one block again. Returns only the buffers that move, lowest first: carried out in that order,
/// each destination is free once the moves before it are done (it lies below the buffer's old
/// start and above every buffer already placed). Empty when there is no hole to close.
pub fn plan_compaction(live: &[(u64, u64)]) -> Vec<Move> {
    let mut order: Vec<usize> = (0..live.len()).collect();
    order.sort_by_key(|&i| live[i].0);
    let mut cursor = 0u64;
    let mut moves = Vec::new();
    for i in order {
        let (offset, len) = live[i];
        let at = if offset > cursor {
            moves.push(Move { index: i, from: offset, to: cursor });
            cursor
        } else {
            // Contiguous with the one before (or overlapping input, which no pool hands in): stays.
            offset
        };
        cursor = cursor.max(at.saturating_add(len));
    }
    moves
}

/// The region's invariant for `slots` of `temps` inside `[start, end)`: every temporary has
/// exactly one slot at least its size, slots lie inside the range, do not overlap, are contiguous
/// (no gap between consecutive ones) and rise with execution order.
pub fn check_slots(slots: &[Slot], temps: &[Temporary], start: u64, end: u64) -> Result<(), LayoutError> {
    let mut seen = vec![false; temps.len()];
    for s in slots {
        match seen.get_mut(s.index) {
            Some(v) if !*v => *v = true,
            _ => return Err(LayoutError::Mismatch),
        }
        let inside = s.offset >= start && s.offset.checked_add(s.len).is_some_and(|e| e <= end);
        if !inside || s.len < temps[s.index].bytes {
            return Err(LayoutError::OutOfRegion(s.index));
        }
    }
    if seen.iter().any(|v| !v) {
        return Err(LayoutError::Mismatch);
    }
    let mut by_addr: Vec<&Slot> = slots.iter().collect();
    by_addr.sort_by_key(|s| s.offset);
    for w in by_addr.windows(2) {
        let (a, b) = (w[0], w[1]);
        let a_end = a.offset + a.len;
        if a_end > b.offset {
            return Err(LayoutError::Overlap(a.index, b.index));
        }
        if a_end < b.offset {
            return Err(LayoutError::Gap { after: a.index, gap: b.offset - a_end });
        }
        if temps[b.index].order < temps[a.index].order {
            return Err(LayoutError::OrderViolated { earlier: b.index, later: a.index });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(order: u32, bytes: u64) -> Temporary {
        Temporary { order, bytes }
    }

    #[test]
    fn temporaries_rise_with_execution_order_packed_under_the_limit() {
        // Free: a low hole [0, 512) and the tail [1024, 4096); the reuse tier starts at 3840.
        let free = [(0, 512), (1024, 3072)];
        let temps = [t(2, 100), t(0, 300), t(1, 256)];
        let slots = place_temporaries(&free, &temps, 256, 3840).unwrap();
        // Execution order: index 1 (300 -> 512), index 2 (256), index 0 (100 -> 256): 1024 bytes
        // ending at 3840.
        let got: Vec<(usize, u64, u64)> = slots.iter().map(|s| (s.index, s.offset, s.len)).collect();
        assert_eq!(got, vec![(1, 2816, 512), (2, 3328, 256), (0, 3584, 256)]);
        check_slots(&slots, &temps, 2816, 3840).unwrap();
    }

    #[test]
    fn temporaries_take_the_highest_range_that_holds_them_or_are_refused() {
        // The top range [3072, 3584) is too small for 768 bytes; the next one down holds them.
        let free = [(0, 1024), (1024 + 256, 1024), (3072, 512)];
        let temps = [t(0, 512), t(1, 256)];
        let slots = place_temporaries(&free, &temps, 256, 4096).unwrap();
        assert_eq!((slots[0].offset, slots[1].offset), (1536, 2048));
        assert_eq!(
            place_temporaries(&free, &[t(0, 2048)], 256, 4096),
            Err(LayoutError::NoRoom { need: 2048, limit: 4096 })
        );
        // A range cut by the limit counts only below it.
        assert!(place_temporaries(&[(0, 4096)], &[t(0, 1024)], 256, 768).is_err());
        assert_eq!(place_temporaries(&[(0, 4096)], &[t(0, 1)], 3, 4096), Err(LayoutError::BadAlignment(3)));
    }

    #[test]
    fn long_lived_buffers_go_first_fit_from_the_low_end() {
        let free = [(2048, 4096), (0, 512), (768, 256)];
        assert_eq!(place_long_lived(&free, 200, 256, 8192), Ok(0));
        assert_eq!(place_long_lived(&free, 600, 256, 8192), Ok(2048));
        // Not past the limit (the region and the reuse tier above it).
        assert!(place_long_lived(&free, 600, 256, 2048).is_err());
        assert_eq!(reuse_tier_offset(4096 + 100, 1000, 256), Some(3072));
        assert_eq!(reuse_tier_offset(512, 1000, 256), None);
    }

    #[test]
    fn the_invariant_catches_overlap_gaps_order_and_strays() {
        let temps = [t(0, 256), t(1, 256)];
        let ok = [Slot { index: 0, offset: 0, len: 256 }, Slot { index: 1, offset: 256, len: 256 }];
        check_slots(&ok, &temps, 0, 512).unwrap();
        let overlap = [ok[0], Slot { offset: 128, ..ok[1] }];
        assert_eq!(check_slots(&overlap, &temps, 0, 512), Err(LayoutError::Overlap(0, 1)));
        let gap = [ok[0], Slot { offset: 512, ..ok[1] }];
        assert_eq!(check_slots(&gap, &temps, 0, 1024), Err(LayoutError::Gap { after: 0, gap: 256 }));
        let swapped = [Slot { offset: 256, ..ok[0] }, Slot { offset: 0, ..ok[1] }];
        assert_eq!(
            check_slots(&swapped, &temps, 0, 512),
            Err(LayoutError::OrderViolated { earlier: 0, later: 1 })
        );
        assert_eq!(check_slots(&ok, &temps, 0, 384), Err(LayoutError::OutOfRegion(1)));
        assert_eq!(check_slots(&ok[..1], &temps, 0, 512), Err(LayoutError::Mismatch));
        let short = [ok[0], Slot { len: 128, ..ok[1] }];
        assert_eq!(check_slots(&short, &temps, 0, 512), Err(LayoutError::OutOfRegion(1)));
    }

    #[test]
    fn any_placement_keeps_the_invariant() {
        // Deterministic sweep over sizes and orders: whatever is placed passes the check.
        for n in 1..8u32 {
            let temps: Vec<Temporary> =
                (0..n).map(|i| t((i * 7 + 3) % n, u64::from(i * 97 % 700 + 1))).collect();
            let free = [(0, 300), (1024, 9000), (20_000, 5000)];
            let slots = place_temporaries(&free, &temps, 64, 24_000).unwrap();
            let start = slots.iter().map(|s| s.offset).min().unwrap();
            let end = slots.iter().map(|s| s.offset + s.len).max().unwrap();
            check_slots(&slots, &temps, start, end).unwrap();
            assert!(end <= 24_000);
            assert!(free.iter().any(|&(o, l)| start >= o && end <= o + l), "inside one free range");
        }
    }

    #[test]
    fn compaction_slides_buffers_above_a_hole_down_in_address_order() {
        // Buffers at [0,256), [512,1024), [1280,1536): holes of 256 at 256 and 1024.
        let live = [(1280, 256), (0, 256), (512, 512)];
        let moves = plan_compaction(&live);
        assert_eq!(
            moves,
            vec![Move { index: 2, from: 512, to: 256 }, Move { index: 0, from: 1280, to: 768 }]
        );
        // Already contiguous from 0: nothing moves.
        assert!(plan_compaction(&[(0, 256), (256, 512)]).is_empty());
        assert!(plan_compaction(&[]).is_empty());
        // A lone buffer above a hole goes to 0.
        assert_eq!(plan_compaction(&[(4096, 256)]), vec![Move { index: 0, from: 4096, to: 0 }]);
    }

    #[test]
    fn compacted_buffers_are_contiguous_and_never_land_on_one_not_yet_moved() {
        // Deterministic sweep: after the moves, the buffers tile [0, total) and each move's
        // destination overlaps no buffer still at its old place.
        for n in 1..9u64 {
            let mut live = Vec::new();
            let mut at = 0;
            for i in 0..n {
                at += (i * 37 % 5) * 256; // a hole before some
                let len = (i * 53 % 7 + 1) * 256;
                live.push((at, len));
                at += len;
            }
            live.reverse();
            let moves = plan_compaction(&live);
            let mut now = live.clone();
            for m in &moves {
                let len = now[m.index].1;
                assert!(m.to < m.from);
                for (j, &(o, l)) in now.iter().enumerate() {
                    if j != m.index {
                        assert!(m.to + len <= o || o + l <= m.to, "move {m:?} lands on buffer {j}");
                    }
                }
                now[m.index].0 = m.to;
            }
            now.sort();
            let mut cursor = 0;
            for (o, l) in now {
                assert_eq!(o, cursor);
                cursor += l;
            }
        }
    }
}

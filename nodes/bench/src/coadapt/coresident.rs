//! Memory-bound concurrency at equal budget: how many tasks each strategy keeps resident and
//! stepping in one pool budget, packed by the kernels' real allocator ([`MemoryPool`], first fit,
//! 256-byte aligned) with the byte sizes the real co-adaptation pool reported for the student
//! (its merged frozen parts, one task's experts, projector and optimiser state, one step's
//! workspace). Ours stores the frozen parts once and its tasks take turns in one step workspace;
//! isolated adaptation (isolated, AMS, RECL) gives every task its own frozen copy and its own
//! workspace, as the seed describes it; MoE-SE merges but runs one task to completion at a time,
//! so it keeps one stepping however many fit.

use troupe_kernels::MemoryPool;

/// Bytes the packing uses (measured on the real pool).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sizes {
    /// One copy of the frozen parts.
    pub shared: u64,
    /// One task's experts, projector and optimiser state.
    pub state: u64,
    /// One step's workspace.
    pub workspace: u64,
}

/// Tasks packed into `budget` when the frozen parts and the workspace are allocated once
/// (`merged`) or with every task.
pub fn packed(budget: u64, s: Sizes, merged: bool) -> anyhow::Result<usize> {
    let mut pool = MemoryPool::new("coresident", budget, 256)?;
    if merged && (pool.alloc(s.shared).is_err() || pool.alloc(s.workspace).is_err()) {
        return Ok(0);
    }
    let mut n = 0;
    loop {
        let fits = if merged {
            pool.alloc(s.state).is_ok()
        } else {
            pool.alloc(s.shared).is_ok() && pool.alloc(s.state).is_ok() && pool.alloc(s.workspace).is_ok()
        };
        if !fits {
            return Ok(n);
        }
        n += 1;
    }
}

/// (ours, best baseline, its name): ours merged; the baselines isolated (own copy and workspace
/// each) or, for MoE-SE, one at a time.
pub fn coresident(budget: u64, s: Sizes) -> anyhow::Result<(usize, usize, &'static str)> {
    let ours = packed(budget, s, true)?;
    let isolated = packed(budget, s, false)?;
    let moe_se = packed(budget, s, true)?.min(1);
    Ok(if isolated >= moe_se { (ours, isolated, "isolated/ams/recl") } else { (ours, moe_se, "moe_se") })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merged_packs_the_frozen_parts_and_workspace_once() {
        // 40 units of 256 B: merged 4 + 12, then 2-unit states -> 12; isolated 4 + 2 + 12 = 18
        // units a task -> 2.
        let budget = 256 * 40;
        let scaled = Sizes { shared: 256 * 4, state: 256 * 2, workspace: 256 * 12 };
        assert_eq!(packed(budget, scaled, true).unwrap(), 12);
        assert_eq!(packed(budget, scaled, false).unwrap(), 2);
        assert_eq!(coresident(budget, scaled).unwrap(), (12, 2, "isolated/ams/recl"));
        // Room for the frozen parts but not the workspace: none.
        assert_eq!(packed(256, Sizes { shared: 100, state: 60, workspace: 300 }, true).unwrap(), 0);
    }
}

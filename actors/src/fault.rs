//! The node's fault switch: one process-wide [`FaultPlan`], installed from the node config's
//! `[faults]` section and off by default. Code marks a site with [`point`]; when the plan says
//! the site fires, [`point`] panics there, so supervision handles it like any other crash. Tests,
//! the chaos run and a user's own reproduction all go through this one switch.

use std::sync::Mutex;

use troupe_policy::FaultPlan;

static PLAN: Mutex<Option<FaultPlan>> = Mutex::new(None);

/// Installs `plan` for this process (replacing any earlier one); an empty plan switches faults off.
pub fn install(plan: FaultPlan) {
    if let Ok(mut g) = PLAN.lock() {
        *g = (!plan.is_empty()).then_some(plan);
    }
}

/// Whether the fault at `site` fires now (counts the hit).
pub fn fires(site: &str) -> bool {
    match PLAN.lock() {
        Ok(mut g) => g.as_mut().is_some_and(|p| p.hit(site)),
        Err(_) => false,
    }
}

/// A fault site: panics when the plan says `site` fires now, naming the site.
pub fn point(site: &str) {
    if fires(site) {
        tracing::warn!(%site, "fault switch: injecting a panic");
        panic!("fault injected at {site} by the fault switch");
    }
}

/// Hits and firings of `site` so far.
pub fn counts(site: &str) -> (u64, u64) {
    PLAN.lock().ok().and_then(|g| g.as_ref().map(|p| p.counts(site))).unwrap_or((0, 0))
}

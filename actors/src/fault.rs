//! The node's fault switch: one process-wide [`FaultPlan`], installed from the node config's
//! `[faults]` section and off by default. Code marks a site with [`point`]; when the plan says
//! the site fires, [`point`] panics there, so supervision handles it like any other crash. Tests,
//! the chaos run and a user's own reproduction all go through this one switch.
//!
//! Beside the process plan, a plan may be armed for one site alone ([`install_site`]): the
//! simulated cluster names a site per run (its scheduler's), so runs sharing a process (parallel
//! tests) never see each other's faults nor share hit counts.

use std::collections::BTreeMap;
use std::sync::Mutex;

use troupe_policy::FaultPlan;

static PLAN: Mutex<Option<FaultPlan>> = Mutex::new(None);
static SITES: Mutex<BTreeMap<String, FaultPlan>> = Mutex::new(BTreeMap::new());

/// Installs `plan` for this process (replacing any earlier one); an empty plan switches faults off.
pub fn install(plan: FaultPlan) {
    if let Ok(mut g) = PLAN.lock() {
        *g = (!plan.is_empty()).then_some(plan);
    }
}

/// Arms `plan` for `site` alone, beside the process plan (replacing an earlier one for that
/// site); an empty plan disarms it.
pub fn install_site(site: &str, plan: FaultPlan) {
    if let Ok(mut g) = SITES.lock() {
        if plan.is_empty() {
            g.remove(site);
        } else {
            g.insert(site.to_string(), plan);
        }
    }
}

/// Whether the fault at `site` fires now (counts the hit, in the process plan and in the
/// site's own).
pub fn fires(site: &str) -> bool {
    let process = match PLAN.lock() {
        Ok(mut g) => g.as_mut().is_some_and(|p| p.hit(site)),
        Err(_) => false,
    };
    let own = match SITES.lock() {
        Ok(mut g) => g.get_mut(site).is_some_and(|p| p.hit(site)),
        Err(_) => false,
    };
    process || own
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

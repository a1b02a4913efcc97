//! Seeded, per-site fault injection (FoundationDB's buggify is the model): code marks a site
//! with a name, and a plan decides, from a seed and how often that site was reached, whether the
//! fault fires this time. The decision is pure: the same seed and the same sequence of hits give
//! the same faults, so a failing run can be replayed.
//!
//! A site fires either at fixed hit numbers (`after`: the Nth hit, then every `every` hits, at
//! most `times` times) or with a probability per hit drawn from a stream seeded by
//! (seed, site name). Sites the plan does not name never fire: the switch is off by default.

use std::collections::BTreeMap;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// When one site fires.
#[derive(Clone, Debug, PartialEq)]
pub struct SiteRule {
    /// Fire at this hit (1-based); `None` means "use `probability`".
    pub after: Option<u64>,
    /// With `after`: fire again every this many hits after it (0 = only once).
    pub every: u64,
    /// Probability per hit when `after` is `None` (0..=1).
    pub probability: f64,
    /// Fire at most this many times in all.
    pub times: u64,
}

impl SiteRule {
    /// Fires once, at hit `n`.
    pub fn once_at(n: u64) -> Self {
        Self { after: Some(n), every: 0, probability: 0.0, times: 1 }
    }

    /// Checks the rule's numbers, naming the bad one.
    pub fn validate(&self) -> Result<(), String> {
        if self.after == Some(0) {
            return Err("after must be at least 1 (hits are counted from 1)".into());
        }
        if !(0.0..=1.0).contains(&self.probability) {
            return Err(format!("probability {} is outside [0, 1]", self.probability));
        }
        if self.after.is_none() && self.probability == 0.0 {
            return Err("give either after = N or a probability above 0".into());
        }
        Ok(())
    }
}

#[derive(Clone, Debug)]
struct SiteState {
    rule: SiteRule,
    hits: u64,
    fired: u64,
    rng: SmallRng,
}

/// The fault plan: which sites fire when. Hits on sites it does not name are free.
#[derive(Clone, Debug, Default)]
pub struct FaultPlan {
    seed: u64,
    sites: BTreeMap<String, SiteState>,
}

impl FaultPlan {
    /// An empty plan (nothing fires) with `seed` for probabilistic sites.
    pub fn new(seed: u64) -> Self {
        Self { seed, sites: BTreeMap::new() }
    }

    /// Adds or replaces the rule of `site`.
    pub fn with_site(mut self, site: &str, rule: SiteRule) -> Self {
        let rng = SmallRng::seed_from_u64(self.seed ^ fnv1a(site.as_bytes()));
        self.sites.insert(site.to_string(), SiteState { rule, hits: 0, fired: 0, rng });
        self
    }

    /// Whether the plan names any site.
    pub fn is_empty(&self) -> bool {
        self.sites.is_empty()
    }

    /// Records one hit of `site` and decides whether the fault fires now.
    pub fn hit(&mut self, site: &str) -> bool {
        let Some(s) = self.sites.get_mut(site) else { return false };
        s.hits += 1;
        if s.fired >= s.rule.times {
            return false;
        }
        let fire = match s.rule.after {
            Some(n) if s.hits == n => true,
            Some(n) => s.rule.every > 0 && s.hits > n && (s.hits - n).is_multiple_of(s.rule.every),
            None => s.rng.random_bool(s.rule.probability),
        };
        if fire {
            s.fired += 1;
        }
        fire
    }

    /// How often `site` was hit and how often it fired.
    pub fn counts(&self, site: &str) -> (u64, u64) {
        self.sites.get(site).map_or((0, 0), |s| (s.hits, s.fired))
    }
}

/// FNV-1a, so each site's random stream depends on its name and not on iteration order.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unnamed_sites_never_fire() {
        let mut p = FaultPlan::new(1);
        assert!((0..1000).all(|_| !p.hit("anything")));
    }

    #[test]
    fn fixed_hits_fire_exactly_there() {
        let rule = SiteRule { after: Some(3), every: 4, probability: 0.0, times: 3 };
        let mut p = FaultPlan::new(1).with_site("s", rule);
        let fired: Vec<u64> = (1..=30).filter(|_| p.hit("s")).collect();
        assert_eq!(fired, vec![3, 7, 11]);
        assert_eq!(p.counts("s"), (30, 3));
    }

    #[test]
    fn same_seed_same_faults_other_seed_other_faults() {
        let rule = SiteRule { after: None, every: 0, probability: 0.2, times: u64::MAX };
        let run = |seed| {
            let mut p = FaultPlan::new(seed).with_site("a", rule.clone()).with_site("b", rule.clone());
            (0..200).map(|i| p.hit(if i % 2 == 0 { "a" } else { "b" })).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
        let fired = run(7).iter().filter(|f| **f).count();
        assert!((15..=70).contains(&fired), "about 20% of 200 hits should fire, got {fired}");
    }

    #[test]
    fn bad_rules_are_named() {
        assert!(SiteRule::once_at(0).validate().unwrap_err().contains("after"));
        let r = SiteRule { after: None, every: 0, probability: 1.5, times: 1 };
        assert!(r.validate().unwrap_err().contains("1.5"));
    }
}

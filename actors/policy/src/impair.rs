//! Link impairment decided in user space: what happens to one outgoing datagram (dropped, or
//! sent after a delay) under a link's configured round-trip time, jitter and loss.
//!
//! The kernels troupe runs on have no `netem` qdisc, so the transport applies `[links]` itself
//! (see `troupe_transport::impaired`). Each end delays what it sends by half the round-trip time,
//! so a round trip between two impaired ends costs the configured RTT. The decision for a
//! datagram is a pure function of the settings, the seed and the datagram's sequence number:
//! the same seed drops and delays the same datagrams.

use std::time::Duration;

/// Largest round-trip time accepted, in milliseconds (a minute-long RTT is a typo, not a link).
pub const MAX_RTT_MS: u64 = 10_000;
/// Largest loss accepted, in percent (past this QUIC spends its time retransmitting).
pub const MAX_LOSS_PCT: f64 = 50.0;

/// Why link settings were refused; each variant names the field and the bound.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ImpairError {
    /// `rtt_ms` above [`MAX_RTT_MS`].
    #[error("rtt_ms = {0}: at most {MAX_RTT_MS}")]
    Rtt(u64),
    /// `jitter_ms` above half of `rtt_ms` (a one-way delay cannot go negative).
    #[error("jitter_ms = {jitter}: at most rtt_ms / 2 = {half}")]
    Jitter {
        /// The jitter given.
        jitter: u64,
        /// Half the RTT.
        half: u64,
    },
    /// `loss_pct` not a number in 0..=[`MAX_LOSS_PCT`].
    #[error("loss_pct = {0}: must be within 0..={MAX_LOSS_PCT}")]
    Loss(f64),
}

/// What to do with one outgoing datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Lose it.
    Drop,
    /// Send it after this delay.
    Delay(Duration),
}

/// One end's share of a link's impairment: the delay it adds to each datagram it sends (half
/// the RTT, plus or minus the jitter) and the fraction it drops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkImpairment {
    /// Delay added to every datagram sent (RTT / 2).
    pub one_way: Duration,
    /// Uniform spread around `one_way` (each datagram's delay is within `one_way ± jitter`).
    pub jitter: Duration,
    /// Datagrams lost per million sent.
    pub loss_ppm: u32,
    /// Seed of the per-datagram draws.
    pub seed: u64,
}

impl LinkImpairment {
    /// Settings from a topology's `[links]` values, checked against their bounds. `jitter_ms` is
    /// the one-way spread; it may not exceed `rtt_ms / 2`.
    pub fn new(rtt_ms: u64, jitter_ms: u64, loss_pct: f64, seed: u64) -> Result<Self, ImpairError> {
        if rtt_ms > MAX_RTT_MS {
            return Err(ImpairError::Rtt(rtt_ms));
        }
        if jitter_ms.saturating_mul(2) > rtt_ms {
            return Err(ImpairError::Jitter { jitter: jitter_ms, half: rtt_ms / 2 });
        }
        if !(0.0..=MAX_LOSS_PCT).contains(&loss_pct) {
            return Err(ImpairError::Loss(loss_pct));
        }
        // in range 0..=500_000 after the check above
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let loss_ppm = (loss_pct * 10_000.0).round() as u32;
        Ok(Self {
            one_way: Duration::from_micros(rtt_ms * 500),
            jitter: Duration::from_millis(jitter_ms),
            loss_ppm,
            seed,
        })
    }

    /// True when nothing is delayed or dropped (the transport then skips the wrapper entirely).
    pub fn is_off(&self) -> bool {
        self.one_way.is_zero() && self.jitter.is_zero() && self.loss_ppm == 0
    }

    /// The fate of datagram number `seq` (0, 1, 2, ... in send order).
    pub fn verdict(&self, seq: u64) -> Verdict {
        let r = splitmix64(self.seed ^ seq.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        if u32::try_from(r % 1_000_000).unwrap_or(u32::MAX) < self.loss_ppm {
            return Verdict::Drop;
        }
        let spread = u64::try_from(self.jitter.as_micros()).unwrap_or(u64::MAX);
        if spread == 0 {
            return Verdict::Delay(self.one_way);
        }
        // an independent draw for the delay: offset in 0..=2*spread, centred on one_way
        let offset = splitmix64(r) % (2 * spread + 1);
        let base = u64::try_from(self.one_way.as_micros()).unwrap_or(u64::MAX);
        Verdict::Delay(Duration::from_micros((base + offset).saturating_sub(spread)))
    }
}

/// The splitmix64 mixer: a seeded, stateless stand-in for an RNG draw.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_enforced_and_named() {
        assert_eq!(LinkImpairment::new(MAX_RTT_MS + 1, 0, 0.0, 0), Err(ImpairError::Rtt(MAX_RTT_MS + 1)));
        assert_eq!(LinkImpairment::new(40, 21, 0.0, 0), Err(ImpairError::Jitter { jitter: 21, half: 20 }));
        assert!(matches!(LinkImpairment::new(40, 0, 51.0, 0), Err(ImpairError::Loss(_))));
        assert!(matches!(LinkImpairment::new(40, 0, f64::NAN, 0), Err(ImpairError::Loss(_))));
        assert!(LinkImpairment::new(0, 0, 0.0, 0).unwrap().is_off());
    }

    #[test]
    fn delay_is_half_the_rtt_within_the_jitter() {
        let l = LinkImpairment::new(40, 5, 0.0, 7).unwrap();
        for seq in 0..10_000 {
            match l.verdict(seq) {
                Verdict::Delay(d) => assert!((15..=25).contains(&d.as_millis()), "{d:?}"),
                Verdict::Drop => panic!("no loss configured, datagram {seq} dropped"),
            }
        }
        assert_eq!(
            LinkImpairment::new(40, 0, 0.0, 7).unwrap().verdict(3),
            Verdict::Delay(Duration::from_millis(20))
        );
    }

    #[test]
    fn loss_rate_matches_the_setting_and_the_seed_decides() {
        let l = LinkImpairment::new(40, 0, 1.0, 42).unwrap();
        let dropped = (0..100_000).filter(|s| l.verdict(*s) == Verdict::Drop).count();
        assert!((800..=1200).contains(&dropped), "1% of 100000 datagrams, dropped {dropped}");
        let again: Vec<Verdict> = (0..1000).map(|s| l.verdict(s)).collect();
        assert_eq!(again, (0..1000).map(|s| l.verdict(s)).collect::<Vec<_>>());
        let other = LinkImpairment { seed: 43, ..l };
        assert_ne!(again, (0..1000).map(|s| other.verdict(s)).collect::<Vec<_>>());
    }
}

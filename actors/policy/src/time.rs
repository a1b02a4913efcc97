//! Logical time handed to policies by their callers.

use std::fmt;
use std::ops::{Add, Sub};
use std::time::Duration;

/// Microseconds on the caller's clock (monotonic, origin chosen by the caller).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Micros(pub u64);

impl Micros {
    /// Zero time: the origin of the caller's clock.
    pub const ZERO: Micros = Micros(0);

    /// From milliseconds.
    pub const fn from_millis(ms: u64) -> Self {
        Micros(ms * 1_000)
    }

    /// From seconds.
    pub const fn from_secs(s: u64) -> Self {
        Micros(s * 1_000_000)
    }

    /// Whole milliseconds (truncated).
    pub const fn as_millis(self) -> u64 {
        self.0 / 1_000
    }

    /// As fractional seconds.
    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / 1e6
    }

    /// From a `Duration` (saturating at `u64::MAX` microseconds).
    pub fn from_duration(d: Duration) -> Self {
        Micros(u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
    }

    /// `self - earlier`, or zero when `earlier` is later.
    pub fn saturating_sub(self, earlier: Micros) -> Micros {
        Micros(self.0.saturating_sub(earlier.0))
    }
}

impl Add for Micros {
    type Output = Micros;
    fn add(self, rhs: Micros) -> Micros {
        Micros(self.0.saturating_add(rhs.0))
    }
}

impl Sub for Micros {
    type Output = Micros;
    fn sub(self, rhs: Micros) -> Micros {
        self.saturating_sub(rhs)
    }
}

impl fmt::Display for Micros {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}us", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_saturates() {
        assert_eq!(Micros(5) - Micros(9), Micros::ZERO);
        assert_eq!(Micros(u64::MAX) + Micros(1), Micros(u64::MAX));
        assert_eq!(Micros::from_millis(3).as_millis(), 3);
        assert_eq!(Micros::from_secs(2), Micros(2_000_000));
    }
}

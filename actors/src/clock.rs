//! The one place actors read the wall clock: policies get time as [`Micros`] from here.

use std::time::Instant;

use troupe_policy::Micros;

/// Monotonic microseconds since the clock was made.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    origin: Instant,
}

impl Clock {
    /// A clock starting at zero now.
    pub fn start() -> Self {
        Self { origin: Instant::now() }
    }

    /// Microseconds since [`Clock::start`].
    pub fn now(&self) -> Micros {
        Micros::from_duration(self.origin.elapsed())
    }
}

impl Default for Clock {
    fn default() -> Self {
        Self::start()
    }
}

//! The one place actors read the clock: policies get time as [`Micros`] from here. It is
//! tokio's clock, so a paused-time test or a simulation moves it (outside a runtime, or with
//! time not paused, it is the monotonic clock).

use std::time::Duration;

use tokio::time::Instant;

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

    /// Time since [`Clock::start`]: for measuring how long something took (a figure, never a
    /// decision).
    pub fn elapsed(&self) -> Duration {
        self.origin.elapsed()
    }
}

impl Default for Clock {
    fn default() -> Self {
        Self::start()
    }
}

/// Now on tokio's timer clock: for deadlines handed to tokio's timers (`sleep_until`, timeouts),
/// which a paused-time test or a simulation advances by itself.
pub fn timer_now() -> tokio::time::Instant {
    tokio::time::Instant::now()
}

/// Time left until `deadline` (zero once it has passed).
pub fn left_until(deadline: std::time::Instant) -> Duration {
    deadline.saturating_duration_since(std::time::Instant::now())
}

/// Microseconds since the Unix epoch: for numbers that must grow across processes and restarts
/// (placement generations), never for measuring time.
pub fn wall_micros() -> u64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    u64::try_from(since.as_micros()).unwrap_or(u64::MAX)
}

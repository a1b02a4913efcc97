//! OTP-style restart intensity: at most `max_restarts` restarts within any `period`; one more
//! failure inside the window escalates to the supervisor's own supervisor.

use std::collections::VecDeque;

use crate::Micros;

/// What a supervisor does with a failed child.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestartDecision {
    /// Start the child again.
    Restart,
    /// Too many failures in the period: stop and fail upwards.
    Escalate,
}

/// Restart intensity over a sliding window (one-for-one strategy, per child group).
#[derive(Clone, Debug)]
pub struct RestartIntensity {
    max_restarts: u32,
    period: Micros,
    recent: VecDeque<Micros>,
}

impl RestartIntensity {
    /// At most `max_restarts` restarts in any window of length `period`.
    pub fn new(max_restarts: u32, period: Micros) -> Self {
        Self { max_restarts, period, recent: VecDeque::new() }
    }

    /// Records a failure at `now` and decides.
    pub fn handle_failure(&mut self, now: Micros) -> RestartDecision {
        while let Some(&t) = self.recent.front() {
            if now.saturating_sub(t) >= self.period {
                self.recent.pop_front();
            } else {
                break;
            }
        }
        if self.recent.len() as u64 >= u64::from(self.max_restarts) {
            return RestartDecision::Escalate;
        }
        self.recent.push_back(now);
        RestartDecision::Restart
    }

    /// Restarts counted in the current window.
    pub fn restarts_in_window(&self) -> usize {
        self.recent.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escalates_past_intensity_and_forgets_old_failures() {
        let mut r = RestartIntensity::new(2, Micros::from_secs(5));
        assert_eq!(r.handle_failure(Micros::from_secs(0)), RestartDecision::Restart);
        assert_eq!(r.handle_failure(Micros::from_secs(1)), RestartDecision::Restart);
        assert_eq!(r.handle_failure(Micros::from_secs(2)), RestartDecision::Escalate);
        // the first failure leaves the window at t=5
        assert_eq!(r.handle_failure(Micros::from_secs(5)), RestartDecision::Restart);
        assert_eq!(r.restarts_in_window(), 2);
    }

    #[test]
    fn zero_intensity_always_escalates() {
        let mut r = RestartIntensity::new(0, Micros::from_secs(1));
        assert_eq!(r.handle_failure(Micros(0)), RestartDecision::Escalate);
    }
}

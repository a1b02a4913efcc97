//! Moves a [`SimHub`]'s virtual time with tokio's clock (simulation only).
//!
//! Each turn releases what is due by tokio's now, then sleeps until the next queued frame is
//! due, or for at most the net's smallest delay: a frame sent during that sleep is due no sooner
//! than its send time plus that delay, so no delivery is released late. Under paused time tokio
//! jumps straight to the next timer when every task waits, so idle stretches cost nothing.

use std::time::Duration;

use troupe_policy::Micros;
use troupe_transport::SimHub;

/// Runs until aborted: the hub's clock follows tokio's from the moment this starts.
pub(super) async fn drive(hub: SimHub, min_delay: Micros) {
    let origin = crate::clock::timer_now();
    // a zero smallest delay would make this spin without letting time pass
    let quantum = Duration::from_micros(min_delay.0.max(1));
    loop {
        let now = Micros::from_duration(origin.elapsed());
        hub.advance_to(now);
        let next = hub.next_event_time().map(|t| Duration::from_micros(t.0.saturating_sub(now.0)));
        let wait = next.map_or(quantum, |d| d.min(quantum)).max(Duration::from_micros(1));
        tokio::time::sleep(wait).await;
    }
}

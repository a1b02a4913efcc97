//! Helpers shared by the coe scheduler tests that serve client requests.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use ractor::Actor;
use tokio::sync::broadcast;
use troupe_actors::coe::app::{App, GenKnobs};
use troupe_actors::coe::runner::start_local_executors;
use troupe_actors::coe::serve::CoeShared;
use troupe_actors::supervisor::{Intensity, Supervisor, SupervisorArgs};
use troupe_policy::coe::LatencyModel;

/// These tests need the experts, not the same-bytes baseline `coe gen` also trains.
pub fn no_baseline() -> GenKnobs {
    GenKnobs { skip_single_model: true, ..GenKnobs::default() }
}

/// Runs `body` with the job's scheduler under a supervisor and executor threads.
pub fn with_scheduler<T>(
    shared: &Arc<CoeShared>,
    app: &App,
    latency: &LatencyModel,
    body: impl std::future::Future<Output = T>,
) -> T {
    let threads = start_local_executors(shared, app, latency).expect("executor threads");
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let out = runtime.block_on(async {
        let (events, _failures) = broadcast::channel(16);
        let args = SupervisorArgs {
            name: "test-root".into(),
            children: vec![shared.child_spec()],
            intensity: Intensity { max_restarts: 0, period: Duration::from_secs(1) },
            events,
        };
        let (sup, handle) = Actor::spawn(None, Supervisor, args).await.expect("supervisor");
        let out = body.await;
        sup.stop(None);
        let _ = handle.await;
        out
    });
    shared.close_links();
    for t in threads {
        t.join().unwrap();
    }
    out
}

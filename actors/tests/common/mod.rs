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

/// The ci app with 4 experts generated into `dir` (no baseline), profiled on this machine, and
/// its latency model from that profile.
pub fn profiled_ci_app(dir: &std::path::Path) -> (Arc<App>, LatencyModel) {
    use troupe_actors::coe::app::{Scale, generate_with};
    use troupe_actors::coe::profiler::{default_plan, load_profile, profile};
    generate_with(dir, Scale::Ci, 4, &no_baseline()).expect("generating the ci app");
    let app = Arc::new(App::open(dir, None).expect("opening the app"));
    let p = profile(&app, &default_plan(&app)).expect("profiling");
    std::fs::write(dir.join("profile.txt"), p.to_text()).expect("writing the profile");
    let latency = LatencyModel::from_profile(&load_profile(&dir.join("profile.txt")).unwrap()).unwrap();
    (app, latency)
}

//! Warm restart of the coe scheduler: the fault switch panics the scheduler actor twice in the
//! middle of a real run (real ONNX experts on executor threads); the supervisor restarts it, the
//! new incarnation rebuilds from the journaled requests and resets the executors, and every
//! request is answered exactly once with the outputs of a fault-free run.
//!
//! Its own test binary: the fault switch is process-wide.
#![cfg(feature = "onnx")]

use std::sync::Arc;
use std::time::Duration;

use ractor::Actor;
use tokio::sync::broadcast;
use troupe_actors::coe::app::{App, Scale};
use troupe_actors::coe::profiler::{default_plan, load_profile, profile};
use troupe_actors::coe::runner::{RunOptions, run_local, start_local_executors};
use troupe_actors::coe::serve::{CoeShared, FAULT_SITE, serve_trace};
use troupe_actors::supervisor::{Intensity, Supervisor, SupervisorArgs, SupervisorEvent};
use troupe_policy::coe::{LatencyModel, SchedulerConfig};
use troupe_policy::{FaultPlan, SiteRule};

mod common;
use common::{generated_app, no_baseline};

#[test]
fn a_scheduler_that_panics_mid_run_answers_every_request_once_with_the_same_outputs() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let dir = tmp.path().join("app");
    generated_app(&dir, Scale::Ci, 5, &no_baseline());
    let app = Arc::new(App::open(&dir, None).expect("opening the app"));
    let p = profile(&app, &default_plan(&app)).expect("profiling");
    std::fs::write(dir.join("profile.txt"), p.to_text()).expect("writing the profile");
    let latency = LatencyModel::from_profile(&load_profile(&dir.join("profile.txt")).unwrap()).unwrap();
    let n = app.trace.requests.len();

    let reference =
        run_local(&app, &latency, &RunOptions::new(SchedulerConfig::ours())).expect("fault-free run");

    // Panic at the scheduler's 30th input and again 40 inputs later.
    let rule = SiteRule { after: Some(30), every: 40, probability: 0.0, times: 2 };
    troupe_actors::fault::install(FaultPlan::new(1).with_site(FAULT_SITE, rule));
    let journal = tmp.path().join("coe.journal");
    let (shared, damage) =
        CoeShared::open(app.clone(), latency.clone(), SchedulerConfig::ours(), Some(&journal)).unwrap();
    assert!(damage.is_none());
    let threads = start_local_executors(&shared, &app, &latency).unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let restarts = runtime.block_on(async {
        let (events, failures) = broadcast::channel(64);
        let mut watch = events.subscribe();
        let args = SupervisorArgs {
            name: "test-root".into(),
            children: vec![shared.child_spec()],
            intensity: Intensity { max_restarts: 5, period: Duration::from_secs(60) },
            events,
        };
        let (sup, handle) = Actor::spawn(None, Supervisor, args).await.expect("supervisor");
        // arrivals spread out a little so the panics land while requests are in flight
        serve_trace(&shared, 0.2, Duration::from_secs(300), failures).await.expect("the run completes");
        sup.stop(None);
        let _ = handle.await;
        let mut restarts = Vec::new();
        while let Ok(ev) = watch.try_recv() {
            if let SupervisorEvent::Restarted { child, reason, .. } = ev {
                restarts.push((child, reason));
            }
        }
        restarts
    });
    shared.close_links();
    for t in threads {
        t.join().unwrap();
    }
    let (hits, fired) = troupe_actors::fault::counts(FAULT_SITE);
    assert_eq!(fired, 2, "the fault switch fired twice ({hits} scheduler inputs)");
    assert_eq!(restarts.len(), 2, "two restarts: {restarts:?}");
    assert!(
        restarts.iter().all(|(c, r)| c == "coe-scheduler" && r.contains("fault injected")),
        "{restarts:?}"
    );

    let digests: Vec<u64> =
        shared.digests().into_iter().map(|d| d.expect("every request answered")).collect();
    assert_eq!(digests.len(), n);
    assert_eq!(digests, reference.digests, "outputs differ from the fault-free run");
    drop(shared);
    // Exactly once on disk too: the journal replays cleanly (a second answer of one request
    // would be refused by name) with every request answered.
    troupe_actors::fault::install(FaultPlan::default());
    let (again, damage) = CoeShared::open(app, latency, SchedulerConfig::ours(), Some(&journal)).unwrap();
    assert!(damage.is_none());
    assert_eq!(*again.answered().borrow(), n);
    assert_eq!(again.accepted().len(), n);
}

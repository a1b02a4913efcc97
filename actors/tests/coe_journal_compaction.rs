//! A coe journal compacted while the scheduler serves client requests (real ONNX experts on
//! executor threads): answers match a local run's, a restart resumes exactly the open requests
//! under their ids, and answered ones are forgotten but still counted. (Its own binary: the
//! scheduler actor's name is registered process-wide.)
#![cfg(feature = "onnx")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use troupe_actors::coe::runner::{RunOptions, run_local};
use troupe_actors::coe::serve::CoeShared;
use troupe_policy::coe::SchedulerConfig;
use troupe_policy::compaction::CompactionRule;

mod common;
use common::{profiled_ci_app, with_scheduler};

/// Waits (bounded, as a hang guard) until `shared` counts `count` answered requests.
async fn until_answered(shared: &CoeShared, count: usize) {
    let mut answered = shared.answered();
    let all = async {
        while *answered.borrow_and_update() < count {
            answered.changed().await.expect("job state alive");
        }
    };
    tokio::time::timeout(Duration::from_secs(120), all).await.expect("answered in time");
}

#[test]
fn a_journal_compacted_while_serving_serves_and_resumes_the_same() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("app");
    let (app, latency) = profiled_ci_app(&dir);
    let reference = run_local(&app, &latency, &RunOptions::new(SchedulerConfig::ours())).expect("local run");
    let n = app.trace.requests.len() as u64;
    let input = |i: usize| {
        let r = &app.trace.requests[i];
        (r.root, app.input(r.input))
    };
    let journal = tmp.path().join("compacted.journal");
    let open = || {
        let shared =
            CoeShared::open(app.clone(), latency.clone(), SchedulerConfig::ours(), Some(&journal)).unwrap().0;
        // a 1-byte threshold: due at once (at open, at the first answer under the running
        // scheduler, with requests still open), then whenever the journal has doubled
        shared.set_compaction(CompactionRule { threshold: 1 });
        shared
    };

    // accepted with no scheduler running, then answered by one that compacts as it goes
    let shared = open();
    let mut rxs = Vec::new();
    for i in 0..4 {
        let (root, pixels) = input(i);
        let (id, rx) = shared.submit(root, pixels).expect("accepted");
        assert_eq!(id, n + i as u64);
        rxs.push(rx);
    }
    with_scheduler(&shared, &app, &latency, until_answered(&shared, 4));
    for (i, rx) in rxs.into_iter().enumerate() {
        let mut rx = rx;
        assert_eq!(rx.try_recv().expect("answered").digest, reference.digests[i], "request {i}");
    }
    assert!(shared.pending().is_empty());
    drop(shared);

    // reopened (and compacted at once): the answered requests are forgotten, still counted
    let shared = open();
    assert_eq!(shared.answer_of(n), None, "an answered client request is forgotten by the compaction");
    let small = std::fs::metadata(&journal).unwrap().len();
    // the magic and two small records, less than one client request (its input is 256 bytes)
    assert!(small < 128, "only the next id and the forgotten count are left: {small} bytes");
    assert_eq!(*shared.answered().borrow(), 4, "forgotten answers still count");
    assert_eq!(shared.next_client_id(), n + 4);
    // two more accepted with no scheduler; a restart resumes exactly them, under new ids
    for i in [4, 5] {
        let (root, pixels) = input(i);
        shared.submit(root, pixels).expect("accepted");
    }
    drop(shared);
    let shared = open();
    assert_eq!(shared.pending().into_iter().collect::<Vec<u64>>(), vec![n + 4, n + 5]);
    with_scheduler(&shared, &app, &latency, until_answered(&shared, 6));
    assert!(shared.pending().is_empty());
    drop(shared);
    let shared = open();
    assert!(shared.pending().is_empty(), "nothing answered is run again");
    assert_eq!(*shared.answered().borrow(), 6);
    assert_eq!(shared.next_client_id(), n + 6);
}

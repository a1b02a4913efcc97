//! Client requests in the coe scheduler (real ONNX experts on executor threads): a request
//! submitted with a trace request's input and entry expert is answered with that request's
//! digest from a local run; requests accepted while no scheduler runs are in the journal with
//! their inputs, and a scheduler started over the reopened journal answers them; bad requests
//! are refused, naming the problem.
#![cfg(feature = "onnx")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use troupe_actors::coe::app::INPUT_WIDTH;
use troupe_actors::coe::runner::{RunOptions, run_local};
use troupe_actors::coe::serve::CoeShared;
use troupe_policy::coe::{ExpertId, SchedulerConfig};

mod common;
use common::{profiled_ci_app, with_scheduler};

#[test]
fn client_requests_are_answered_as_a_local_run_and_survive_a_restart_through_the_journal() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let dir = tmp.path().join("app");
    let (app, latency) = profiled_ci_app(&dir);
    let reference = run_local(&app, &latency, &RunOptions::new(SchedulerConfig::ours())).expect("local run");
    let n = app.trace.requests.len() as u64;
    let input = |i: usize| {
        let r = &app.trace.requests[i];
        (r.root, app.input(r.input))
    };
    let journal = tmp.path().join("serve.journal");
    let open =
        || CoeShared::open(app.clone(), latency.clone(), SchedulerConfig::ours(), Some(&journal)).unwrap().0;

    // 1. a client request with a scheduler running: answered with the local run's digest
    let shared = open();
    let (root, pixels) = input(0);
    let answer = with_scheduler(&shared, &app, &latency, async {
        let (id, rx) = shared.submit(root, pixels).expect("accepted");
        assert_eq!(id, n, "the first client request takes the id after the trace");
        tokio::time::timeout(Duration::from_secs(120), rx).await.expect("answered in time").expect("answered")
    });
    assert_eq!(answer.digest, reference.digests[0]);
    let ran: Vec<ExpertId> = answer.outputs.keys().copied().collect();
    let mut expected = app.trace.requests[0].experts();
    expected.sort();
    expected.dedup();
    assert_eq!(ran, expected, "the experts the trace records for request 0");
    drop(shared);

    // 2. accepted while no scheduler runs: journaled with their inputs
    let shared = open();
    for i in [1, 2] {
        let (root, pixels) = input(i);
        shared.submit(root, pixels).expect("accepted");
    }
    // bad requests are refused by name and take no id
    let (root, pixels) = input(3);
    let e = shared.submit(root, pixels[..INPUT_WIDTH - 1].to_vec()).unwrap_err().to_string();
    assert!(e.contains("has 63"), "{e}");
    let mut nan = pixels.clone();
    nan[5] = f32::NAN;
    assert!(shared.submit(root, nan).unwrap_err().to_string().contains("input float 5 is not finite"));
    let sub =
        app.trace.model.experts().iter().find(|e| e.preliminary().is_some()).expect("a subsequent expert");
    let e = shared.submit(sub.id, pixels.clone()).unwrap_err().to_string();
    assert!(e.contains("not a preliminary"), "{e}");
    assert!(shared.submit(ExpertId(1 << 20), pixels).unwrap_err().to_string().contains("not an expert"));
    drop(shared);

    // 3. reopened: the scheduler answers what was accepted and not answered
    let shared = open();
    assert_eq!(shared.accepted().into_iter().collect::<Vec<u64>>(), vec![n, n + 1, n + 2]);
    assert_eq!(shared.answer_of(n), Some(reference.digests[0]), "the journaled answer is kept");
    let mut answered = shared.answered();
    with_scheduler(&shared, &app, &latency, async {
        let all = async {
            while *answered.borrow_and_update() < 3 {
                answered.changed().await.expect("job state alive");
            }
        };
        tokio::time::timeout(Duration::from_secs(120), all).await.expect("answered in time");
    });
    assert_eq!(shared.answer_of(n + 1), Some(reference.digests[1]));
    assert_eq!(shared.answer_of(n + 2), Some(reference.digests[2]));
    assert_eq!(shared.answer_of(n + 3), None, "refused requests took no id");
}

//! Supervision: a panicking actor is restarted by its supervisor; past the restart intensity the
//! failure escalates to the supervisor's supervisor, which restarts the whole subtree.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use ractor_cluster::RactorMessage;
use tokio::sync::broadcast;
use troupe_actors::supervisor::{
    ChildSpec, Intensity, Supervisor, SupervisorArgs, SupervisorEvent, SupervisorMsg,
};

struct Fragile;

#[derive(RactorMessage)]
enum FragileMsg {
    Boom,
    Generation(RpcReplyPort<u64>),
}

impl Actor for Fragile {
    type Msg = FragileMsg;
    type State = u64;
    type Arguments = u64;

    async fn pre_start(&self, _me: ActorRef<Self::Msg>, generation: u64) -> Result<u64, ActorProcessingErr> {
        Ok(generation)
    }

    async fn handle(
        &self,
        _me: ActorRef<Self::Msg>,
        msg: Self::Msg,
        g: &mut u64,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            FragileMsg::Boom => panic!("fragile actor generation {g} panics on purpose"),
            FragileMsg::Generation(r) => {
                let _ = r.send(*g);
            }
        }
        Ok(())
    }
}

async fn next(rx: &mut broadcast::Receiver<SupervisorEvent>) -> SupervisorEvent {
    tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("no supervision event within 10 s")
        .unwrap()
}

async fn child_of(sup: &ActorRef<SupervisorMsg>, name: &str) -> ActorRef<FragileMsg> {
    let children = ractor::call_t!(sup, SupervisorMsg::Children, 2000).unwrap();
    children.into_iter().find(|(n, _)| n == name).expect("child is running").1.into()
}

#[tokio::test]
async fn restarts_then_escalates_past_intensity() {
    let (tx, mut rx) = broadcast::channel(64);
    let counter = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let inner_tx = tx.clone();
    let make_inner = move || {
        let c = counter.clone();
        SupervisorArgs {
            name: "inner".into(),
            children: vec![ChildSpec::new("fragile-under-test", move || {
                (Fragile, c.fetch_add(1, std::sync::atomic::Ordering::SeqCst))
            })],
            intensity: Intensity { max_restarts: 2, period: Duration::from_secs(60) },
            events: inner_tx.clone(),
        }
    };
    let (outer, outer_handle) = Actor::spawn(
        None,
        Supervisor,
        SupervisorArgs {
            name: "outer".into(),
            children: vec![troupe_actors::supervisor::supervisor_child(make_inner, "inner-supervisor")],
            intensity: Intensity { max_restarts: 1, period: Duration::from_secs(60) },
            events: tx.clone(),
        },
    )
    .await
    .unwrap();
    let inner: ActorRef<SupervisorMsg> = {
        let children = ractor::call_t!(outer, SupervisorMsg::Children, 2000).unwrap();
        children[0].1.clone().into()
    };

    // two failures: restarted each time, a fresh generation answers
    for expected_generation in 1..=2u64 {
        child_of(&inner, "fragile-under-test").await.cast(FragileMsg::Boom).unwrap();
        match next(&mut rx).await {
            SupervisorEvent::Restarted { supervisor, child, in_window, reason } => {
                assert_eq!((supervisor.as_str(), child.as_str()), ("inner", "fragile-under-test"));
                assert_eq!(in_window as u64, expected_generation);
                assert!(reason.contains("panics on purpose"), "{reason}");
            }
            other => panic!("expected a restart, got {other:?}"),
        }
        let g = ractor::call_t!(child_of(&inner, "fragile-under-test").await, FragileMsg::Generation, 2000)
            .unwrap();
        assert_eq!(g, expected_generation);
    }

    // the third failure inside the window escalates; the outer supervisor restarts the subtree
    child_of(&inner, "fragile-under-test").await.cast(FragileMsg::Boom).unwrap();
    assert!(
        matches!(next(&mut rx).await, SupervisorEvent::Escalated { supervisor, .. } if supervisor == "inner")
    );
    match next(&mut rx).await {
        SupervisorEvent::Restarted { supervisor, child, .. } => {
            assert_eq!((supervisor.as_str(), child.as_str()), ("outer", "inner-supervisor"));
        }
        other => panic!("expected the outer supervisor to restart the inner one, got {other:?}"),
    }
    let new_inner: ActorRef<SupervisorMsg> =
        ractor::call_t!(outer, SupervisorMsg::Children, 2000).unwrap()[0].1.clone().into();
    let g = ractor::call_t!(child_of(&new_inner, "fragile-under-test").await, FragileMsg::Generation, 2000)
        .unwrap();
    assert_eq!(g, 3, "the restarted subtree starts a fresh child");

    // the subtree fails past its intensity again: the outer supervisor (intensity 1) escalates too
    for _ in 0..2 {
        child_of(&new_inner, "fragile-under-test").await.cast(FragileMsg::Boom).unwrap();
        assert!(
            matches!(next(&mut rx).await, SupervisorEvent::Restarted { supervisor, .. } if supervisor == "inner")
        );
    }
    child_of(&new_inner, "fragile-under-test").await.cast(FragileMsg::Boom).unwrap();
    assert!(
        matches!(next(&mut rx).await, SupervisorEvent::Escalated { supervisor, .. } if supervisor == "inner")
    );
    match next(&mut rx).await {
        SupervisorEvent::Escalated { supervisor, child, .. } => {
            assert_eq!((supervisor.as_str(), child.as_str()), ("outer", "inner-supervisor"));
        }
        other => panic!("expected the outer supervisor to escalate, got {other:?}"),
    }
    tokio::time::timeout(Duration::from_secs(10), outer_handle)
        .await
        .expect("outer supervisor stopped")
        .unwrap();
}

//! Role-checked service calls over real QUIC on loopback, against a real CoE executor (ONNX
//! experts of a generated ci app): a camera-role certificate asking it to load an expert is
//! refused with an error naming the role and the method, a scheduler-role one is served, and
//! unknown services and methods are named.
#![cfg(feature = "onnx")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use troupe_actors::coe::app::{App, Scale};
use troupe_actors::coe::exec_wire::{self, LOAD, Load};
use troupe_actors::coe::profiler::{default_plan, load_profile, profile};
use troupe_actors::coe::remote::{CoeExecutor, ExecutorSpec, RemoteExecutor, find_executors};
use troupe_actors::typed::{ActorError, service_name};
use troupe_actors::{Children, MembershipConfig, NodeRuntime, NodeSpec, PeerAddr, fixed_children};
use troupe_policy::coe::LatencyModel;
use troupe_transport::service::FaultKind;
use troupe_transport::{ClusterCa, IssueOptions, NodeId, Role, RoleSet};

mod common;
use common::{generated_app, no_baseline};

fn spec(ca: &ClusterCa, name: &str, roles: RoleSet, peers: Vec<PeerAddr>, children: Children) -> NodeSpec {
    NodeSpec {
        identity: ca.issue(name, &IssueOptions::new(roles).unwrap()).unwrap(),
        quic: Default::default(),
        peers,
        membership: MembershipConfig {
            heartbeat: Duration::from_millis(100),
            timeout: Duration::from_millis(2000),
        },
        intensity: Default::default(),
        cookie: "0123456789abcdef0123456789abcdef".into(),
        children,
        redial: Duration::from_millis(100),
        placement: Default::default(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_scheduler_role_may_drive_a_coe_executor() {
    let tmp = tempfile::tempdir().unwrap();
    generated_app(tmp.path(), Scale::Ci, 5, &no_baseline());
    let app = App::open(tmp.path(), None).unwrap();
    let p = profile(&app, &default_plan(&app)).unwrap();
    std::fs::write(tmp.path().join("profile.txt"), p.to_text()).unwrap();
    let latency =
        LatencyModel::from_profile(&load_profile(&tmp.path().join("profile.txt")).unwrap()).unwrap();
    let executor = latency.name(0).to_string();
    let expert = app.trace.model.roots().next().unwrap().id;

    let ca = ClusterCa::generate("roles").unwrap();
    let spec_args = ExecutorSpec::real(tmp.path().display().to_string(), executor.clone());
    let name = exec_wire::actor_name(&executor);
    let children: Children = Box::new(move |_link, _services, _membership, actors| {
        Ok(vec![actors.child_spec::<CoeExecutor>(&name, spec_args).map_err(|e| e.to_string())?])
    });
    let exec_node =
        NodeRuntime::start(spec(&ca, "exec-node", RoleSet::only(Role::Executor), Vec::new(), children))
            .await
            .unwrap();
    let addr = exec_node.link.local_addr().unwrap();
    let peer = || vec![PeerAddr { name: NodeId::new("exec-node"), addr: addr.into() }];
    let camera =
        NodeRuntime::start(spec(&ca, "cam-1", RoleSet::only(Role::Camera), peer(), fixed_children(vec![])))
            .await
            .unwrap();
    let scheduler = NodeRuntime::start(spec(
        &ca,
        "sched",
        RoleSet::only(Role::Scheduler),
        peer(),
        fixed_children(vec![]),
    ))
    .await
    .unwrap();

    // discovery by announcement; hello is open to any member, so the camera finds it too
    let wait = Duration::from_secs(60);
    let names = vec![executor.clone()];
    let seen_by_camera: Vec<RemoteExecutor> = find_executors(&camera.actors, &names, wait).await.unwrap();
    let found = find_executors(&scheduler.actors, &names, wait).await.unwrap();
    assert_eq!((found[0].node.as_str(), seen_by_camera[0].node.as_str()), ("exec-node", "exec-node"));
    let service = service_name(&exec_wire::actor_name(&executor));
    let timeout = Duration::from_secs(30);
    let load = Load { expert: expert.0 };

    match seen_by_camera[0].handle.call(load, timeout).await {
        Err(ActorError::Forbidden { message, detail, .. }) => {
            assert_eq!(message, LOAD);
            assert!(
                detail.contains("role camera of cam-1 may not call")
                    && detail.contains(&format!("{service}.{LOAD}")),
                "the refusal must name the role and the method: {detail}"
            );
            assert!(detail.contains("needs role scheduler"), "{detail}");
        }
        other => panic!("a camera loading an expert: {other:?}"),
    }

    let loaded = found[0].handle.call(load, timeout).await.unwrap();
    assert!(loaded.resident > 0, "the scheduler's load ran: {loaded:?}");

    let peer = NodeId::new("exec-node");
    let err = scheduler.services.call(&peer, &service, "explode", vec![0; 8], timeout).await.unwrap_err();
    assert_eq!(err.fault(), Some(FaultKind::UnknownMethod), "{err}");
    assert!(err.to_string().contains("no method \"explode\""), "{err}");
    let err =
        scheduler.services.call(&peer, "@coe-executor/nobody", LOAD, vec![0; 8], timeout).await.unwrap_err();
    assert_eq!(err.fault(), Some(FaultKind::UnknownService), "{err}");
    assert!(err.to_string().contains("coe-executor/nobody"), "{err}");
    match scheduler.actors.lookup::<CoeExecutor>("coe-executor/nobody").await {
        Err(ActorError::UnknownActor { name, .. }) => assert_eq!(name, "coe-executor/nobody"),
        other => panic!("an executor nobody runs: {other:?}"),
    }

    for n in [camera, scheduler, exec_node] {
        n.shutdown().await;
    }
}

//! The coadapt edge's progress reports over real QUIC on loopback (two in-process nodes: an edge
//! and a camera-role peer): hostile bytes, oversized lists and reports for another camera are
//! refused with errors naming what is wrong and change nothing; valid snapshots replace the
//! camera's progress, and the job's summary waiter is answered only once the camera's stream has
//! ended and every adaptation it asked for is back.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use troupe_actors::coadapt::EDGE_ACTOR;
use troupe_actors::coadapt::edge::{
    AdaptOutcome, EdgeActor, EdgeArgs, EdgeCompute, EdgeShared, Report, Upload,
};
use troupe_actors::coadapt::engine::EngineConfig;
use troupe_actors::coadapt::wire::{
    AccuracySample, CameraReport, DecodeBudget, EdgeSummary, MAX_DECODED_BYTES, MAX_SAMPLES, PIXELS,
    StreamReport, UploadRequest, decode,
};
use troupe_actors::typed::{RemoteMessage, service_name};
use troupe_actors::{Children, MembershipConfig, NodeRuntime, NodeSpec, PeerAddr, fixed_children};
use troupe_transport::{ClusterCa, IssueOptions, NodeId, Role, RoleSet};

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

fn report(camera: &str, ended: bool, requested: u32, adaptations: u32) -> StreamReport {
    StreamReport {
        camera: camera.into(),
        frame: if ended { 512 } else { 128 },
        frames: 512,
        ended,
        requested,
        phases: Vec::new(),
        samples: vec![AccuracySample { frame: 64, accuracy: 0.9, confidence: 0.8 }],
        adaptations: (0..adaptations)
            .map(|k| CameraReport {
                camera: camera.into(),
                adaptation: k,
                drift_frame: 200,
                installed_frame: 456,
                exact_before: 0.3,
                exact_after: 0.6,
                accuracy_before: 0.3,
                accuracy_after: 0.6,
                latency_ms: 1,
                error: String::new(),
            })
            .collect(),
        error: String::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_edge_refuses_bad_reports_and_answers_the_job_once_the_camera_is_done() {
    let ca = ClusterCa::generate("coadapt-reports").unwrap();
    let edge = EdgeShared::new(EdgeArgs {
        engine: EngineConfig::default(),
        expected: vec!["tiny".into()],
        compute: EdgeCompute::Real,
    });
    let served = edge.clone();
    let children: Children = Box::new(move |_link, _services, _membership, actors| {
        served.children(actors, "coadapt-edge").map_err(|e| e.to_string())
    });
    let edge_node =
        NodeRuntime::start(spec(&ca, "edge", RoleSet::only(Role::Edge), Vec::new(), children)).await.unwrap();
    let addr = edge_node.link.local_addr().unwrap();
    let camera = NodeRuntime::start(spec(
        &ca,
        "cam-1",
        RoleSet::only(Role::Camera),
        vec![PeerAddr { name: NodeId::new("edge"), addr: addr.into() }],
        fixed_children(vec![]),
    ))
    .await
    .unwrap();
    let edge_actor = camera
        .actors
        .wait_for::<EdgeActor>(EDGE_ACTOR, Duration::from_secs(60))
        .await
        .expect("the edge is announced");
    let timeout = Duration::from_secs(30);
    let call = |r: StreamReport| edge_actor.call(Report(r), timeout);

    // hostile bytes (on the typed actor's wire path, addressed to any incarnation), a list past
    // its cap, another camera's name: refused, naming why
    let peer = edge_actor.node().expect("resolved");
    let hostile = [vec![0; 8], vec![0xff; 40]].concat();
    let e = camera
        .services
        .call(&peer, &service_name(EDGE_ACTOR), Report::NAME, hostile, timeout)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("invalid report"), "{e}");
    let big = StreamReport {
        samples: vec![report("cam-1", false, 0, 0).samples[0]; MAX_SAMPLES + 1],
        ..report("cam-1", false, 0, 0)
    };
    let e = call(big).await.unwrap_err().to_string();
    assert!(e.contains("samples") && e.contains(&MAX_SAMPLES.to_string()), "{e}");
    let e = call(report("cam-2", true, 0, 0)).await.unwrap_err().to_string();
    assert!(e.contains("may not report for camera \"cam-2\""), "{e}");
    assert_eq!(edge.progress(1).missing, ["1 of 1 cameras not heard from yet"], "nothing was kept");

    // an upload in another camera's name is refused before it takes a task slot
    let upload = UploadRequest {
        camera: "cam-2".into(),
        model: "tiny".into(),
        params: Vec::new(),
        train_images: vec![0.5; PIXELS],
        eval_images: vec![0.5; PIXELS],
        adaptation: 0,
        drift_frame: 1,
        target_gain: 0.1,
    };
    let outcome = edge_actor.call(Upload(upload), timeout).await.unwrap();
    match outcome {
        AdaptOutcome::Refused(why) => assert!(why.contains("may not upload for camera \"cam-2\""), "{why}"),
        other => panic!("an upload for another camera was not refused: {other:?}"),
    }

    // the job waits for one camera
    let (tx, mut rx) = ractor::concurrency::oneshot();
    edge.wait_summary(1, tx.into()).unwrap();

    // streaming, one adaptation out: heard from, not done
    call(report("cam-1", false, 1, 0)).await.unwrap();
    assert_eq!(edge.progress(1).missing, ["cam-1: 1 of 1 adaptations not back, stream at frame 128"]);
    // ended with its adaptation back: the snapshot replaces the last one, the job is answered
    call(report("cam-1", true, 1, 1)).await.unwrap();
    assert!(edge.progress(1).done);
    let bytes = tokio::time::timeout(Duration::from_secs(120), &mut rx).await.expect("answered").unwrap();
    let s: EdgeSummary = decode("edge summary", &bytes, &mut DecodeBudget::new(MAX_DECODED_BYTES)).unwrap();
    assert_eq!(s.cameras.len(), 1);
    assert_eq!(s.cameras[0], report("cam-1", true, 1, 1));

    for n in [camera, edge_node] {
        n.shutdown().await;
    }
}

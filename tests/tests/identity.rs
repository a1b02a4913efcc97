//! Cluster identity with real `troupe` processes: every `keys init` makes its own cookie and an
//! admin-role identity; a peer revoked while joined is disconnected, with the reason, when the
//! node reloads its revocation list on SIGHUP, and its redial is refused.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::Duration;

use troupe::transport::{NodeIdentity, Role};
use troupe_tests::{ProcCluster, member_is};

const EXE: &str = env!("CARGO_BIN_EXE_troupe-node");

fn troupe(args: &[&str]) -> String {
    troupe_tests::run_ok(EXE.as_ref(), args).unwrap_or_else(|e| panic!("{e:#}"))
}

#[test]
fn two_keys_init_runs_give_different_cookies_and_an_admin_identity() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    for d in [&a, &b] {
        troupe(&["keys", "init", "--out", d.to_str().unwrap()]);
    }
    let cookie = |d: &std::path::Path| std::fs::read_to_string(d.join("cookie")).unwrap().trim().to_string();
    let (ca, cb) = (cookie(&a), cookie(&b));
    assert_eq!(ca.len(), 64, "{ca:?}");
    assert!(ca.bytes().all(|c| c.is_ascii_hexdigit()));
    assert_ne!(ca, cb, "two clusters got the same cookie");
    let admin = NodeIdentity::load(&a, "admin").unwrap();
    assert!(admin.roles().contains(Role::Admin), "{:?}", admin.roles());

    // roles and validity on the command line end up in the certificate; bad roles are named
    troupe(&["keys", "node", "cam-1", "--keys", a.to_str().unwrap(), "--role", "camera,edge", "--days", "7"]);
    let info = NodeIdentity::load(&a, "cam-1").unwrap().info().unwrap();
    assert_eq!(info.roles.to_string(), "camera,edge");
    let days = info.not_after.duration_since(std::time::SystemTime::now()).unwrap().as_secs() / 86_400;
    assert!((6..=7).contains(&days), "{days}");
    // a role of the user's own goes in the certificate and comes back by name
    troupe(&["keys", "node", "app-1", "--keys", a.to_str().unwrap(), "--role", "my-app,client"]);
    let info = NodeIdentity::load(&a, "app-1").unwrap().info().unwrap();
    assert_eq!(info.roles.to_string(), "client,my-app");
    assert!(info.roles.contains(Role::named("my-app").unwrap()));
    let out = Command::new(EXE)
        .args(["keys", "node", "x", "--keys", a.to_str().unwrap(), "--role", "executor,My_App"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("invalid role name \"My_App\"") && err.contains("a-z, 0-9 and '-'"), "{err}");
    assert!(!a.join("x.crt").exists());
}

const TOPOLOGY: &str = r#"name = "ident"
[membership]
heartbeat_ms = 100
timeout_ms = 1200

[[nodes]]
name = "scheduler"

[[nodes]]
name = "expert-1"
actors = [{ kind = "hello-expert" }]

[[nodes]]
name = "expert-2"
actors = [{ kind = "hello-expert" }]
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reload_disconnects_a_revoked_peer_and_refuses_its_redial() {
    let cluster = ProcCluster::start(EXE.as_ref(), TOPOLOGY).unwrap();
    cluster
        .wait_status("scheduler", Duration::from_secs(30), |s| {
            member_is(s, "expert-1", "up") && member_is(s, "expert-2", "up")
        })
        .await
        .unwrap();
    let keys = cluster.dir().join("keys");
    troupe(&["keys", "revoke", "expert-2", "--keys", keys.to_str().unwrap()]);
    cluster.signal("scheduler", libc::SIGHUP).unwrap();
    let line = cluster
        .wait_log("scheduler", Duration::from_secs(30), &["disconnected peer after reload", "expert-2"])
        .await
        .unwrap();
    assert!(line.contains("the name expert-2 is on the revocation list"), "{line}");
    // expert-2 keeps redialing; every hello is refused with the reason
    cluster
        .wait_log(
            "scheduler",
            Duration::from_secs(30),
            &["refused peer", "certificate of expert-2 is revoked"],
        )
        .await
        .unwrap();
    let (s, _) = cluster
        .wait_status("scheduler", Duration::from_secs(30), |s| member_is(s, "expert-2", "down"))
        .await
        .unwrap();
    assert!(member_is(&s, "expert-1", "up"), "{s:?}");
}

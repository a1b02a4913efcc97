//! Helpers shared by the coe scheduler tests that serve client requests.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use ractor::Actor;
use tokio::sync::broadcast;
use troupe_actors::coe::app::{App, GenKnobs, Scale, generate_with};
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

/// A copy in `dir` of the app `generate_with(_, scale, seed, knobs)` writes. Generation trains
/// every expert (about 16 CPU-seconds at ci scale) and the coe test binaries use one app (seed 5,
/// no baseline), so it is generated once per build of the library and shared through
/// `CARGO_TARGET_TMPDIR`: the key holds the arguments and the modification time of the newest
/// `troupe_actors` library in the binary's folder (a change to the generator rebuilds it, so the
/// next test generates afresh and the apps of older builds are removed). The first caller
/// generates under a file lock while the others wait; every test gets a copy of its own to change.
pub fn generated_app(dir: &Path, scale: Scale, seed: u64, knobs: &GenKnobs) {
    use std::hash::{Hash, Hasher};
    let built = newest_library_build();
    let mut h = std::hash::DefaultHasher::new();
    (format!("{scale:?} {seed} {knobs:?}"), built).hash(&mut h);
    let key = format!("{:016x}", h.finish());
    let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("coe-apps");
    std::fs::create_dir_all(&root).expect("creating the generated-app cache");
    let lock = std::fs::File::create(root.join(format!("{key}.lock"))).expect("the cache's lock file");
    lock.lock().expect("locking the generated-app cache");
    let template = root.join(&key);
    let done = root.join(format!("{key}.done"));
    if !done.exists() {
        for entry in std::fs::read_dir(&root).expect("reading the cache").flatten() {
            let older =
                entry.metadata().and_then(|m| m.modified()).ok().zip(built).is_some_and(|(m, b)| m < b);
            if older {
                let p = entry.path();
                let _ = if p.is_dir() { std::fs::remove_dir_all(&p) } else { std::fs::remove_file(&p) };
            }
        }
        let _ = std::fs::remove_dir_all(&template);
        generate_with(&template, scale, seed, knobs)
            .expect("generating the ci app (scripts/setup makes the digits and ONNX Runtime it needs)");
        std::fs::write(&done, b"").expect("marking the generated app done");
    }
    copy_tree(&template, dir);
}

/// When the newest `troupe_actors` library next to this test binary was built (`None` when none
/// is found: every process then shares one key, as before a rebuild).
fn newest_library_build() -> Option<std::time::SystemTime> {
    let exe = std::env::current_exe().ok()?;
    std::fs::read_dir(exe.parent()?)
        .ok()?
        .flatten()
        .filter(|e| {
            e.file_name().to_str().is_some_and(|n| n.starts_with("libtroupe_actors-") && n.ends_with(".rlib"))
        })
        .filter_map(|e| e.metadata().and_then(|m| m.modified()).ok())
        .max()
}

/// Copies the folder `from` to `to` (files and subfolders).
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("creating the app's copy");
    for entry in std::fs::read_dir(from).expect("reading the generated app") {
        let entry = entry.expect("a folder entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("its type").is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("copying the generated app");
        }
    }
}

/// The ci app of seed 5 generated into `dir` (no baseline), profiled on this machine, and
/// its latency model from that profile.
pub fn profiled_ci_app(dir: &std::path::Path) -> (Arc<App>, LatencyModel) {
    use troupe_actors::coe::profiler::{default_plan, load_profile, profile};
    generated_app(dir, Scale::Ci, 5, &no_baseline());
    let app = Arc::new(App::open(dir, None).expect("opening the app"));
    let p = profile(&app, &default_plan(&app)).expect("profiling");
    std::fs::write(dir.join("profile.txt"), p.to_text()).expect("writing the profile");
    let latency = LatencyModel::from_profile(&load_profile(&dir.join("profile.txt")).unwrap()).unwrap();
    (app, latency)
}

//! The coe job's journal: old records read the same, a long-serving journal stays bounded and
//! replays as an uncompacted one, a torn tail is reported and not replayed.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;
use crate::coe::app::{GenKnobs, Scale, generate_with};
use crate::journal::compacting_path;
use troupe_policy::coe::synth::synthetic_edge_profile;

/// The coe records as they were before compaction added its two: an old journal must read
/// the same.
#[derive(Archive, Serialize, Deserialize)]
enum OldCoeRecord {
    Accepted(Vec<u64>),
    Answered { request: u64, digest: u64 },
    Submitted { root: u32, pixels: Vec<f32> },
}

#[test]
fn old_journal_records_encode_and_decode_unchanged() {
    let old = [
        OldCoeRecord::Accepted(vec![1, 2, 3]),
        OldCoeRecord::Answered { request: 7, digest: 0xfeed },
        OldCoeRecord::Submitted { root: 2, pixels: vec![0.5; INPUT_WIDTH] },
    ]
    .map(|r| rkyv::to_bytes::<rancor::Error>(&r).unwrap().to_vec());
    let new = [
        CoeRecord::Accepted(vec![1, 2, 3]),
        CoeRecord::Answered { request: 7, digest: 0xfeed },
        CoeRecord::Submitted { root: 2, pixels: vec![0.5; INPUT_WIDTH] },
    ];
    for (o, n) in old.iter().zip(&new) {
        assert_eq!(o, &encode(n).unwrap());
        assert_eq!(&decode(o).unwrap(), n);
    }
    for r in [CoeRecord::NextClient(9), CoeRecord::Forgotten(4)] {
        assert_eq!(decode(&encode(&r).unwrap()).unwrap(), r);
    }
}

struct Fixture {
    _dir: tempfile::TempDir,
    app: Arc<App>,
    latency: LatencyModel,
    root: std::path::PathBuf,
}

/// The ci app, generated once per build of this test binary (it trains every expert, about 16
/// CPU-seconds) into a folder beside the binary, under a file lock: nextest runs each test in a
/// process of its own, several at once. A marker holds the binary's build time; a rebuilt binary
/// generates afresh. The tests only read the app.
fn shared_app() -> Arc<App> {
    static APP: std::sync::OnceLock<Arc<App>> = std::sync::OnceLock::new();
    APP.get_or_init(|| {
        let exe = std::env::current_exe().expect("the test binary's path");
        let built = std::fs::metadata(&exe).and_then(|m| m.modified()).expect("the test binary's mtime");
        let app_dir = exe.with_extension("journal-tests-app");
        let lock =
            std::fs::File::create(exe.with_extension("journal-tests-app.lock")).expect("the lock file");
        lock.lock().expect("locking the shared app");
        let marker = exe.with_extension("journal-tests-app.built");
        let stamp = format!("{built:?}");
        if std::fs::read_to_string(&marker).ok().as_deref() != Some(stamp.as_str()) {
            let _ = std::fs::remove_dir_all(&app_dir);
            let knobs = GenKnobs { skip_single_model: true, ..GenKnobs::default() };
            generate_with(&app_dir, Scale::Ci, 5, &knobs).expect("generating the ci app");
            std::fs::write(&marker, &stamp).expect("marking the shared app built");
        }
        Arc::new(App::open(&app_dir, None).expect("opening the app"))
    })
    .clone()
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let app = shared_app();
    let latency = LatencyModel::from_profile(&synthetic_edge_profile("test", 4 << 20, 6 << 20)).unwrap();
    let root = dir.path().to_path_buf();
    Fixture { _dir: dir, app, latency, root }
}

impl Fixture {
    fn open(&self, name: &str, threshold: u64) -> (Arc<CoeShared>, Option<TailDamage>) {
        let path = self.root.join(name);
        let (shared, damage) =
            CoeShared::open(self.app.clone(), self.latency.clone(), SchedulerConfig::ours(), Some(&path))
                .unwrap();
        shared.set_compaction(CompactionRule { threshold });
        (shared, damage)
    }
    fn size(&self, name: &str) -> u64 {
        std::fs::metadata(self.root.join(name)).unwrap().len()
    }
}

/// What a restart resumes and refuses, compared between journals.
fn state(s: &CoeShared) -> (BTreeSet<u64>, Vec<Option<u64>>, usize, u64) {
    (s.pending(), s.digests(), *s.answered().borrow(), s.next_client_id())
}

const BOUND: u64 = 16 << 10;

/// Runs the same work on `shared`: trace requests accepted and mostly answered, then client
/// requests submitted and answered but every 37th, checking `check` after each step.
fn serve(f: &Fixture, shared: &CoeShared, mut check: impl FnMut()) {
    shared.accept(&(0..50).collect::<Vec<u64>>()).unwrap();
    for id in 0..40 {
        shared.settle(id, id * 3 + 1, BTreeMap::new()).unwrap();
        check();
    }
    let root = shared.default_root().unwrap();
    for k in 0..400u64 {
        let pixels = f.app.input(k % 16);
        let (id, _rx) = shared.submit(root, pixels).unwrap();
        check();
        if k % 37 != 0 {
            shared.settle(id, id ^ 0x5a5a, BTreeMap::new()).unwrap();
            check();
        }
    }
}

#[test]
fn a_long_serving_journal_stays_bounded_and_replays_as_an_uncompacted_one() {
    let f = fixture();
    let (grown, _) = f.open("grown", u64::MAX);
    serve(&f, &grown, || {});
    let (bounded, _) = f.open("bounded", BOUND);
    let mut largest = 0;
    serve(&f, &bounded, || {
        let size = f.size("bounded");
        largest = largest.max(size);
        // at most one record (a client's input, ~300 bytes) past the threshold, then compacted
        assert!(size < BOUND + 512, "journal at {size} bytes, bound {BOUND}");
    });
    assert!(f.size("grown") > 4 * BOUND, "the work outgrows the bound uncompacted: {}", f.size("grown"));
    assert!(largest >= BOUND, "the bounded journal did reach its threshold");
    assert!(f.size("bounded") < BOUND);
    assert!(!compacting_path(&f.root.join("bounded")).exists());

    // the same state in memory, compacted or not
    let expected = state(&grown);
    assert_eq!(expected.0.len(), 10 + 11, "10 trace and 11 client requests left open");
    assert_eq!(expected.2, 40 + 400 - 11);
    assert_eq!(state(&bounded), expected);
    drop((grown, bounded));

    // and after a restart
    let (grown, _) = f.open("grown", u64::MAX);
    let (bounded, damage) = f.open("bounded", BOUND);
    assert!(damage.is_none());
    assert_eq!(state(&grown), expected);
    assert_eq!(state(&bounded), expected);
    let n = grown.total() as u64;
    let open_client = *expected.0.iter().find(|&&id| id >= n).unwrap();
    for s in [&grown, &bounded] {
        // what was accepted is not accepted again; what was answered is not answered again
        s.accept(&(0..60).collect::<Vec<u64>>()).unwrap();
        assert!(s.settle(3, 0, BTreeMap::new()).is_err(), "a trace answer twice");
        assert!(s.settle(n + 1, 0, BTreeMap::new()).is_err(), "a client answer twice");
        assert!(s.settle(10_000, 0, BTreeMap::new()).is_err(), "never accepted");
        s.settle(open_client, 77, BTreeMap::new()).unwrap();
        let (id, _rx) = s.submit(s.default_root().unwrap(), f.app.input(0)).unwrap();
        assert_eq!(id, n + 400, "ids are never reused");
    }
    assert_eq!(state(&bounded), state(&grown));
    assert_eq!(bounded.answer_of(open_client), Some(77));
}

#[test]
fn a_torn_tail_after_a_store_compaction_is_reported_and_not_replayed() {
    let f = fixture();
    let (shared, _) = f.open("j", BOUND);
    serve(&f, &shared, || {});
    let before = state(&shared);
    let (id, _rx) = shared.submit(shared.default_root().unwrap(), f.app.input(1)).unwrap();
    assert!(shared.pending().contains(&id));
    drop(shared);
    let path = f.root.join("j");
    let len = f.size("j");
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(len - 3).unwrap();
    let (shared, damage) = f.open("j", BOUND);
    assert!(damage.expect("the torn record is named").detail.contains("cut short"));
    assert_eq!(state(&shared), before, "the torn submission is not replayed");
}

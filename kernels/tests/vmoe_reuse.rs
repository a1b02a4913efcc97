//! The reuse cache of stem tokens on real files: every stem it serves is bit-identical to the
//! model's own, entries spilled to disk come back bit-exact (and a corrupted file is recomputed,
//! not trusted), the second epoch over the same images hits, the memory tier and the pool never
//! exceed their budgets (seeded loops), adaptation with the cache on trains the same weights as
//! with it off, and the disk directory is removed when the cache goes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use rand::rngs::SmallRng;
use rand::seq::index::sample;
use rand::{Rng, SeedableRng};
use troupe_kernels::vmoe::pool::SliceTask;
use troupe_kernels::vmoe::reuse::{
    DIR_PREFIX, ReuseSetup, StemCache, shared_identity, slot_file_name, sweep_stale_dirs,
};
use troupe_kernels::vmoe::{CoAdaptPool, VMoe, VMoeConfig};
use troupe_kernels::{MemoryPool, Tensor};

fn images(seed: u64, n: usize) -> Vec<f32> {
    let mut rng = SmallRng::seed_from_u64(seed);
    (0..n * 64).map(|_| rng.random::<f32>()).collect()
}

fn batch(all: &[f32], idx: &[usize]) -> Tensor {
    let v = idx.iter().flat_map(|&i| &all[i * 64..(i + 1) * 64]).copied().collect();
    Tensor::from_f32(&[idx.len(), 64], v).unwrap()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.f32_cow().iter().map(|v| v.to_bits()).collect()
}

fn model(seed: u64) -> VMoe {
    VMoe::new(VMoeConfig::tiny(), &mut SmallRng::seed_from_u64(seed)).unwrap()
}

/// Bytes of one image's stem tokens for the tiny student.
fn entry_bytes() -> u64 {
    let c = VMoeConfig::tiny();
    (c.tokens_per_image() * c.dim * 4) as u64
}

/// A cache with room for 4 entries in memory whose six images `x` are all on disk: seen once (4
/// kept in the free room, 2 spilled), then six other images seen once, which ages `x`'s four out
/// (entries unused for a batch leave memory) and spills two of their own. With the model,
/// identity and `x`.
fn spilled_cache(dir: &std::path::Path, pool: &mut MemoryPool) -> (StemCache, VMoe, [u8; 32], Tensor) {
    let setup = ReuseSetup { idle_batches: 1, ..ReuseSetup::new(4 * entry_bytes(), 1 << 20, dir) };
    let mut cache = StemCache::new(pool, &setup).unwrap();
    let m = model(1);
    let id = shared_identity(&[[7; 32]]);
    let all = images(2, 12);
    let x = batch(&all, &[0, 1, 2, 3, 4, 5]);
    let y = batch(&all, &[6, 7, 8, 9, 10, 11]);
    for b in [&x, &y] {
        assert_eq!(bits(&cache.stem(&m, &id, b).unwrap()), bits(&m.stem(b).unwrap()));
    }
    cache.flush().unwrap();
    let s = cache.stats();
    assert_eq!((s.misses, s.hits, s.spilled, s.disk_bytes), (12, 0, 8, 8 * entry_bytes()));
    assert_eq!(s.memory_bytes, 4 * entry_bytes());
    (cache, m, id, x)
}

/// Bytes from one disk slot to the next (an entry rounded up to the 4 KiB `O_DIRECT` alignment).
fn stride() -> u64 {
    entry_bytes().next_multiple_of(4096)
}

/// Every file in the disk directory with its length.
fn disk_files(dir: &std::path::Path) -> Vec<(String, u64)> {
    let mut v: Vec<(String, u64)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.metadata().unwrap().len()))
        .collect();
    v.sort();
    v
}

/// What the disk directory holds once `slots` slots were written: one slot file for the tiny
/// student's entry size spanning them (none before the first).
fn one_slot_file(slots: usize) -> Vec<(String, u64)> {
    if slots == 0 {
        return Vec::new();
    }
    let len = (slots as u64 - 1) * stride() + entry_bytes();
    vec![(troupe_kernels::vmoe::reuse::slot_file_name(entry_bytes() as usize), len)]
}

#[test]
fn disk_entries_round_trip_bit_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let mut pool = MemoryPool::new("t", 1 << 20, 256).unwrap();
    let (mut cache, m, id, x) = spilled_cache(tmp.path(), &mut pool);
    assert_eq!(disk_files(cache.dir()), one_slot_file(8));
    assert_eq!(cache.disk_slots(), (8, 8));
    // Second sight: four read back from disk into the 4-entry memory tier, two recomputed.
    assert_eq!(bits(&cache.stem(&m, &id, &x).unwrap()), bits(&m.stem(&x).unwrap()));
    let s = cache.stats();
    assert_eq!((s.prefetched, s.hits, s.bad_reads), (4, 4, 0), "{s:?}");
    assert!(s.memory_bytes <= s.budget && cache.memory_held() <= s.budget);
    let dir = cache.dir().to_path_buf();
    cache.release(&mut pool).unwrap();
    assert!(!dir.exists());
    assert_eq!(pool.stats().used, 0);
}

#[test]
fn a_corrupt_disk_entry_is_recomputed_not_trusted() {
    let tmp = tempfile::tempdir().unwrap();
    let mut pool = MemoryPool::new("t", 1 << 20, 256).unwrap();
    let (mut cache, m, id, x) = spilled_cache(tmp.path(), &mut pool);
    let (name, _) = disk_files(cache.dir()).pop().unwrap();
    let path = cache.dir().join(name);
    let mut b = std::fs::read(&path).unwrap();
    for slot in 0..8 {
        b[slot * stride() as usize] ^= 0xff; // each slot's first byte
    }
    std::fs::write(&path, b).unwrap();
    assert_eq!(bits(&cache.stem(&m, &id, &x).unwrap()), bits(&m.stem(&x).unwrap()));
    let s = cache.stats();
    assert_eq!((s.prefetched, s.bad_reads, s.hits), (4, 4, 0), "{s:?}");
    // The four bad copies are dropped (entries not read keep theirs) and their slots freed for a
    // later demotion to rewrite, so the policy's copies and the live slots agree. (Making room
    // for the reads first demoted the four memory residents into four new slots.)
    cache.flush().unwrap();
    assert_eq!(cache.disk_slots(), (8, 12));
    assert_eq!(8 * entry_bytes(), cache.stats().disk_bytes);
    assert_eq!(disk_files(cache.dir()), one_slot_file(12), "freed slots stay in the file");
    // The recomputed tokens fill the slots the policy gave them: the next sight hits them.
    assert_eq!(bits(&cache.stem(&m, &id, &x).unwrap()), bits(&m.stem(&x).unwrap()));
    assert_eq!(cache.stats().hits, 4);
}

#[test]
fn second_epoch_hits_and_budgets_hold_in_seeded_loops() {
    let tmp = tempfile::tempdir().unwrap();
    for seed in 0..4u64 {
        let mut rng = SmallRng::seed_from_u64(seed);
        let budget = entry_bytes() * rng.random_range(2..40);
        let disk_budget = entry_bytes() * rng.random_range(1..60);
        let mut pool = MemoryPool::new("t", 1 << 20, 256).unwrap();
        let mut cache = StemCache::new(&mut pool, &ReuseSetup::new(budget, disk_budget, tmp.path())).unwrap();
        assert!(pool.stats().used >= budget);
        let m = model(seed);
        let id = shared_identity(&[[seed as u8; 32]]);
        let n = rng.random_range(8..48);
        let all = images(seed + 10, n);
        let mut misses_first = 0;
        for epoch in 0..3 {
            let mut order: Vec<usize> = (0..n).collect();
            rand::seq::SliceRandom::shuffle(&mut order[..], &mut rng);
            for chunk in order.chunks(rng.random_range(1..12)) {
                let x = batch(&all, chunk);
                if rng.random_bool(0.5) {
                    let next = sample(&mut rng, n, chunk.len().min(n)).into_vec();
                    assert_eq!(bits(&cache.stem(&m, &id, &x).unwrap()), bits(&m.stem(&x).unwrap()));
                    cache.plan_next(&m, &id, &batch(&all, &next)).unwrap();
                } else {
                    assert_eq!(bits(&cache.stem(&m, &id, &x).unwrap()), bits(&m.stem(&x).unwrap()));
                }
                let s = cache.stats();
                assert!(s.memory_bytes <= budget && cache.memory_held() <= budget, "{s:?}");
                assert!(s.disk_bytes <= disk_budget, "{s:?}");
                assert!(pool.stats().used <= pool.budget());
                // The live slots are exactly the policy's disk tier, and freed slots are rewritten
                // rather than new ones spanned: the slot file never spans more than the budget.
                cache.flush().unwrap();
                let (live, created) = cache.disk_slots();
                assert_eq!(live as u64 * entry_bytes(), cache.stats().disk_bytes);
                assert_eq!(disk_files(cache.dir()), one_slot_file(created));
                assert!(created as u64 * entry_bytes() <= disk_budget, "{created} slots");
            }
            if epoch == 0 {
                misses_first = cache.stats().misses;
            }
        }
        let s = cache.stats();
        assert_eq!(misses_first, n as u64, "first epoch computes every image once");
        assert!(s.hits > 0, "later epochs hit: {s:?}");
        cache.release(&mut pool).unwrap();
    }
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0, "every disk directory removed");
}

/// Adapts two models (one merged pool) for a few slices and whole-model steps; returns their
/// trainable weights and the pool's reuse figures.
fn adapt(
    reuse: Option<&std::path::Path>,
) -> (Vec<Vec<u32>>, Option<troupe_kernels::vmoe::reuse::ReuseStats>) {
    let mut pool = CoAdaptPool::new("p", 24 << 20).unwrap();
    if let Some(dir) = reuse {
        pool.enable_reuse(&ReuseSetup::new(48 * entry_bytes(), 1 << 20, dir)).unwrap();
    }
    let a = pool.load("a", &model(1)).unwrap();
    let b = pool.load("b", &model(1)).unwrap();
    let all = images(5, 24);
    let labels: Vec<usize> = (0..24).map(|i| i % 10).collect();
    let mut rng = SmallRng::seed_from_u64(3);
    for step in 0..6 {
        let ia = sample(&mut rng, 24, 8).into_vec();
        let ib = sample(&mut rng, 24, 8).into_vec();
        let (xa, xb) = (batch(&all, &ia), batch(&all, &ib));
        let ya: Vec<usize> = ia.iter().map(|&i| labels[i]).collect();
        let yb: Vec<usize> = ib.iter().map(|&i| labels[i]).collect();
        if step % 2 == 0 {
            pool.reuse_expect(a, &xa);
            let ea = [(0, step % 8), (1, 3)];
            let eb = [(0, 1)];
            pool.train_slice(
                &[
                    SliceTask { model: a, images: &xa, labels: &ya, experts: &ea },
                    SliceTask { model: b, images: &xb, labels: &yb, experts: &eb },
                ],
                1e-2,
            )
            .unwrap();
        } else {
            pool.adapt_step(a, &xa, &ya, 1e-2).unwrap();
            pool.adapt_step(b, &xb, &yb, 1e-2).unwrap();
        }
    }
    let weights = [a, b]
        .iter()
        .flat_map(|&id| pool.model(id).unwrap().params.tensors().into_iter().map(|(_, t)| bits(t)))
        .collect();
    (weights, pool.reuse_stats())
}

#[test]
fn adaptation_with_reuse_trains_bit_identical_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let (off, none) = adapt(None);
    let (on, stats) = adapt(Some(tmp.path()));
    assert!(none.is_none());
    let s = stats.unwrap();
    assert!(s.hits > 0 && s.misses > 0, "{s:?}");
    assert_eq!(off.len(), on.len());
    assert!(off == on, "reuse changed the trained weights");
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0, "pool drop removes the disk tier");
}

#[test]
fn reuse_budget_is_carved_from_the_pool() {
    let tmp = tempfile::tempdir().unwrap();
    let mut pool = CoAdaptPool::new("p", 1 << 20).unwrap();
    assert!(pool.enable_reuse(&ReuseSetup::new(2 << 20, 1 << 20, tmp.path())).is_err(), "over the budget");
    assert_eq!(pool.stats().used, 0);
    pool.enable_reuse(&ReuseSetup::new(256 << 10, 1 << 20, tmp.path())).unwrap();
    assert_eq!(pool.stats().used, 256 << 10);
    assert!(pool.reuse_dir().unwrap().exists());
    pool.disable_reuse().unwrap();
    assert_eq!(pool.stats().used, 0);
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
}

/// Adaptation step CPU time (this thread's, so disk reads on the cache's thread do not count) with
/// the reuse cache off, on with room for every image, and on with room for one batch (the rest on
/// disk). One run's figures, printed; nothing asserted on time. Run with
/// `cargo test --release -p troupe-kernels --test vmoe_reuse -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement, not a check"]
fn measure_step_cpu_time_with_reuse_on_and_off() {
    use troupe_kernels::cpu_time::thread_cpu_seconds;
    let tmp = tempfile::tempdir().unwrap();
    let (n, b, steps) = (96usize, 32usize, 60usize);
    let all = images(11, n);
    let labels: Vec<usize> = (0..n).map(|i| i % 10).collect();
    let mut rng = SmallRng::seed_from_u64(4);
    let batches: Vec<Vec<usize>> = (0..steps + 3).map(|_| sample(&mut rng, n, b).into_vec()).collect();
    let run = |budget: Option<u64>| {
        let mut pool = CoAdaptPool::new("p", 64 << 20).unwrap();
        if let Some(bytes) = budget {
            pool.enable_reuse(&ReuseSetup::new(bytes, 64 << 20, tmp.path())).unwrap();
        }
        let id = pool.load("m", &model(1)).unwrap();
        let mut cpu = 0.0;
        for (k, idx) in batches.iter().enumerate() {
            let x = batch(&all, idx);
            let y: Vec<usize> = idx.iter().map(|&i| labels[i]).collect();
            let start = thread_cpu_seconds();
            pool.adapt_step(id, &x, &y, 1e-3).unwrap();
            if k >= 3 {
                cpu += thread_cpu_seconds() - start;
            }
        }
        (cpu / steps as f64, pool.reuse_stats())
    };
    let (off, _) = run(None);
    let (all_in, s_all) = run(Some(n as u64 * entry_bytes()));
    let (one_batch, s_one) = run(Some(b as u64 * entry_bytes()));
    println!("tiny student, batch {b}, {steps} steps after 3 warm-up steps, CPU ms/step (this thread):");
    println!("  reuse off            {:.3}", off * 1e3);
    println!("  reuse on, all in mem {:.3}  ratio on/off {:.3}  {s_all:?}", all_in * 1e3, all_in / off);
    println!("  reuse on, one batch  {:.3}  ratio on/off {:.3}  {s_one:?}", one_batch * 1e3, one_batch / off);
}

/// FoggyCache-like (on demand): the first pass computes and writes every entry to disk, keeping
/// none in memory; the second pass reads every one back while the step waits (the wait counted as
/// stall, in the cache and in the process's total), bit-identical to the model's own stem.
#[test]
fn on_demand_reads_every_reuse_from_disk_and_counts_the_wait() {
    let dir = tempfile::tempdir().unwrap();
    let mut pool = MemoryPool::new("t", 1 << 20, 256).unwrap();
    let setup = ReuseSetup { on_demand: true, ..ReuseSetup::new(4 * entry_bytes(), 1 << 20, dir.path()) };
    let mut cache = StemCache::new(&mut pool, &setup).unwrap();
    let (m, id) = (model(1), shared_identity(&[[7; 32]]));
    let x = batch(&images(2, 6), &[0, 1, 2, 3, 4, 5]);
    let process_before = troupe_kernels::vmoe::reuse::io_stall_us();
    for pass in 0..2 {
        cache.plan_next(&m, &id, &x).unwrap();
        assert_eq!(bits(&cache.stem(&m, &id, &x).unwrap()), bits(&m.stem(&x).unwrap()), "pass {pass}");
    }
    let s = cache.stats();
    assert_eq!((s.misses, s.hits, s.spilled, s.prefetched, s.bad_reads), (6, 6, 6, 6, 0));
    assert_eq!(cache.memory_held(), 0, "nothing resident");
    assert!(s.stall_us > 0, "the step waited for its reads: {s:?}");
    assert!(troupe_kernels::vmoe::reuse::io_stall_us() >= process_before + s.stall_us);
}

/// A throttle's cgroup the disk thread cannot join refuses the cache, saying why, and leaves
/// nothing behind (no directory, the arena back in the pool).
#[test]
fn a_cgroup_the_disk_thread_cannot_join_refuses_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let mut pool = MemoryPool::new("t", 1 << 20, 256).unwrap();
    let setup = ReuseSetup {
        disk_thread_cgroup: Some(dir.path().join("no-such-group/tasks")),
        ..ReuseSetup::new(4 * entry_bytes(), 1 << 20, dir.path())
    };
    let err = StemCache::new(&mut pool, &setup).unwrap_err().to_string();
    assert!(
        err.contains("cannot join the storage read throttle's cgroup") && err.contains("no-such-group"),
        "{err}"
    );
    assert_eq!(pool.stats().used, 0);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// A new cache removes the disk directories of owners that no longer run (a killed edge node's
/// slot files) and keeps those of running processes: its own, and a live child's.
#[test]
fn a_new_cache_sweeps_dead_owners_directories_only() {
    let tmp = tempfile::tempdir().unwrap();
    let mut dead = std::process::Command::new("true").spawn().unwrap();
    let dead_pid = dead.id();
    dead.wait().unwrap();
    /// Killed and reaped when dropped, so a failed assertion leaves no process behind.
    struct Reaped(std::process::Child);
    impl Drop for Reaped {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let live = Reaped(std::process::Command::new("sleep").arg("600").spawn().unwrap());
    let live_pid = live.0.id();
    let dir_of = |pid: u32| tmp.path().join(format!("{DIR_PREFIX}{pid}-x1y2z3"));
    for pid in [dead_pid, live_pid, std::process::id()] {
        std::fs::create_dir(dir_of(pid)).unwrap();
        std::fs::write(dir_of(pid).join(slot_file_name(64)), [0u8; 64]).unwrap();
    }
    let other = tmp.path().join("not-a-reuse-dir-1");
    std::fs::create_dir(&other).unwrap();
    let mut pool = MemoryPool::new("t", 1 << 20, 256).unwrap();
    let cache = StemCache::new(&mut pool, &ReuseSetup::new(4 * entry_bytes(), 1 << 20, tmp.path())).unwrap();
    assert!(!dir_of(dead_pid).exists(), "a dead owner's directory stayed");
    assert!(dir_of(live_pid).exists() && dir_of(std::process::id()).exists() && other.exists());
    let own = cache.dir().file_name().unwrap().to_str().unwrap().to_owned();
    assert!(own.starts_with(&format!("{DIR_PREFIX}{}-", std::process::id())), "{own}");
    cache.release(&mut pool).unwrap();
    drop(live);
    assert_eq!(sweep_stale_dirs(tmp.path()), 1, "the child's directory, once it is gone");
}

//! Preloading: a model prepared on another thread and committed merges exactly as a direct load
//! (same bytes, shared parts deduplicated, same weights); a refused commit changes nothing and
//! hands the model back.

use rand::SeedableRng;
use rand::rngs::SmallRng;
use troupe_kernels::vmoe::{CoAdaptPool, VMoe, VMoeConfig, VMoeError};

fn model(cfg: VMoeConfig, seed: u64) -> VMoe {
    VMoe::new(cfg, &mut SmallRng::seed_from_u64(seed)).expect("valid test input")
}

fn weights(m: &VMoe) -> Vec<Vec<f32>> {
    m.params.tensors().iter().map(|(_, t)| t.to_vec_f32()).collect()
}

#[test]
fn a_model_prepared_in_the_background_commits_like_a_load() {
    let cfg = VMoeConfig::tiny();
    let (m0, m1) = (model(cfg, 1), model(cfg, 1));
    let mut direct = CoAdaptPool::new("direct", 8 << 20).unwrap();
    direct.load("cam0", &m0).unwrap();
    let d1 = direct.load("cam1", &m1).unwrap();
    let mut pool = CoAdaptPool::new("preload", 8 << 20).unwrap();
    pool.load("cam0", &m0).unwrap();
    let host = m1.clone();
    let prepared =
        std::thread::spawn(move || CoAdaptPool::prepare_load("cam1", host)).join().unwrap().unwrap();
    assert_eq!(prepared.name(), "cam1");
    let p1 = pool.commit_load(prepared).map_err(|b| b.0).unwrap();
    assert_eq!(pool.stats().used, direct.stats().used);
    assert_eq!(pool.shared_tensors(), direct.shared_tensors());
    assert_eq!(weights(pool.model(p1).unwrap()), weights(direct.model(d1).unwrap()));
    // The trainable tensors were copied off the host model; the shared ones are the pool's.
    let pm = pool.model(p1).unwrap();
    assert!(!pm.params.proj_w.shares_buffer_with(&m1.params.proj_w));
    let first = pool.model(pool.ids()[0]).unwrap();
    assert!(pm.params.patch_w.shares_buffer_with(&first.params.patch_w));
}

#[test]
fn a_refused_commit_changes_nothing_and_hands_the_model_back() {
    let cfg = VMoeConfig::tiny();
    let m = model(cfg, 2);
    let mut pool = CoAdaptPool::new("small", 4096).unwrap();
    let prepared = CoAdaptPool::prepare_load("cam", m.clone()).unwrap();
    let (e, back) = *pool.commit_load(prepared).unwrap_err();
    assert!(matches!(e, VMoeError::Kernel(_)));
    assert_eq!(pool.stats().used, 0);
    assert_eq!(weights(&back.into_model()), weights(&m));
}

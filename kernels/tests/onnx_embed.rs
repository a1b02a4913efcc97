//! Sentence embeddings from Rust: the known MiniLM similarity. Needs `scripts/setup`.
#![cfg(feature = "onnx")]
#![allow(clippy::unwrap_used)] // test helpers: a panic is the failure report

use troupe_kernels::assets::Assets;
use troupe_kernels::onnx::{Embedder, SessionConfig, cosine, embed};

#[test]
fn minilm_cosine_of_known_pair() {
    let e = embed(&["A man is eating food.", "A man is eating a piece of bread."])
        .unwrap_or_else(|err| panic!("{err}"));
    assert_eq!((e.len(), e[0].len()), (2, 384));
    for v in &e {
        let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-4, "embedding norm {norm}");
    }
    let c = cosine(&e[0], &e[1]);
    println!("cosine = {c}");
    assert!((c - 0.755).abs() <= 0.005, "cosine {c}");
}

#[test]
fn batching_does_not_change_embeddings() {
    let assets = Assets::locate().unwrap_or_else(|e| panic!("{e}"));
    let mut embedder = Embedder::from_assets(&assets, &SessionConfig::default()).unwrap();
    let texts = ["Short.", "A much longer sentence that needs padding for the short one."];
    let together = embedder.embed(&texts).unwrap();
    let alone = embedder.embed(&texts[..1]).unwrap();
    let diff = together[0].iter().zip(&alone[0]).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    assert!(diff < 1e-5, "padding changed the embedding by {diff}");
    // unrelated sentences are less similar than paraphrases
    let related = cosine(&together[0], &together[1]);
    assert!(related < 0.6, "{related}");
    assert!(embedder.embed::<&str>(&[]).unwrap().is_empty());
    // measured once, after the first run (values in tests/onnx_memory.rs, in isolated processes)
    assert!(embedder.session().memory().rss_after_first_run.is_some());
}

//! The Rust WordPiece tokenizer reproduces the `tokenizers` package's ids, recorded by setup in
//! `models/tokenizer_check.json`. Needs `scripts/setup`.

#![allow(clippy::unwrap_used)] // test helpers: a panic is the failure report

use troupe_kernels::assets::{self, Assets};
use troupe_kernels::tokenizer::WordPiece;

fn load() -> (WordPiece, serde_json::Value) {
    let a = Assets::locate().unwrap_or_else(|e| panic!("{e}"));
    let tok = WordPiece::from_assets(&a).unwrap();
    let text = std::fs::read_to_string(a.path(assets::TOKENIZER_CHECK).unwrap()).unwrap();
    (tok, serde_json::from_str(&text).unwrap())
}

#[test]
fn single_sentences_match_reference_ids() {
    let (tok, check) = load();
    assert_eq!(tok.vocab_size(), 30522);
    assert_eq!(check["max_len"].as_u64(), Some(tok.max_len() as u64));
    let cases = check["single"].as_array().unwrap();
    assert!(cases.len() >= 20);
    let mut failures = Vec::new();
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        let got = tok.encode(text);
        if got != want {
            failures.push(format!("{text:?}\n  want {want:?}\n  got  {got:?}"));
        }
    }
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
    // hand-checked: [CLS] a man is eating food . [SEP]
    assert_eq!(tok.encode("A man is eating food."), vec![101, 1037, 2158, 2003, 5983, 2833, 1012, 102]);
    // the long case is cut to 256 ids ending in [SEP]
    let long = tok.encode(&"The quick brown fox jumps over the lazy dog. ".repeat(40));
    assert_eq!((long.len(), long[255]), (256, 102));
}

#[test]
fn padded_batch_matches_reference() {
    let (tok, check) = load();
    let texts: Vec<String> = serde_json::from_value(check["batch"]["texts"].clone()).unwrap();
    let ids: Vec<Vec<i64>> = serde_json::from_value(check["batch"]["ids"].clone()).unwrap();
    let mask: Vec<Vec<i64>> = serde_json::from_value(check["batch"]["attention_mask"].clone()).unwrap();
    let b = tok.encode_batch(&texts);
    assert_eq!((b.batch, b.seq_len), (ids.len(), ids[0].len()));
    assert_eq!(b.ids, ids.concat());
    assert_eq!(b.attention_mask, mask.concat());
}

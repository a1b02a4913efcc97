//! BERT WordPiece tokenizer in pure Rust, reading a `vocab.txt` (one token per line, id = line number).
//!
//! Reproduces the `tokenizers` package's BERT pipeline for uncased models such as all-MiniLM-L6-v2:
//! clean text (drop NUL, U+FFFD and control/format characters; whitespace becomes a space), put spaces
//! around CJK ideographs, strip accents (NFD, drop non-spacing marks), lowercase, split on whitespace
//! and punctuation, then greedy longest-match-first WordPiece with the `##` continuation prefix
//! (a word longer than 100 chars, or with a piece not in the vocabulary, becomes `[UNK]`). Sequences
//! are `[CLS] pieces [SEP]`, truncated to `max_len` (256) ids; batches are right-padded with `[PAD]`
//! and carry an attention mask. setup records the reference ids in `models/tokenizer_check.json` and
//! `tests/onnx_tokenizer.rs` compares.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use unicode_normalization::UnicodeNormalization;
use unicode_properties::{GeneralCategory, GeneralCategoryGroup, UnicodeGeneralCategory};

use crate::assets::{self, Assets};

/// Longest sequence (including `[CLS]` and `[SEP]`) produced by default, as sentence-transformers uses.
pub const DEFAULT_MAX_LEN: usize = 256;
/// Words longer than this many chars become `[UNK]`.
pub const MAX_CHARS_PER_WORD: usize = 100;
/// Largest vocabulary file accepted.
const MAX_VOCAB_BYTES: u64 = 16 << 20;

/// Why a tokenizer could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// The vocabulary file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The vocabulary is unusable (too large, empty, or lacks a special token).
    #[error("{path}: bad vocabulary: {detail}")]
    BadVocab {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// The vocabulary or config is not where setup puts it.
    #[error(transparent)]
    Assets(#[from] assets::AssetError),
}

/// Token ids of a padded batch, row-major `[batch, seq_len]`, ready for `input_ids`/`attention_mask`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// Number of sequences.
    pub batch: usize,
    /// Length of the longest sequence; shorter ones are padded to it.
    pub seq_len: usize,
    /// Token ids, `[PAD]` after each sequence's end.
    pub ids: Vec<i64>,
    /// 1 for real tokens, 0 for padding.
    pub attention_mask: Vec<i64>,
}

/// A BERT WordPiece tokenizer (uncased: lowercases and strips accents).
#[derive(Debug, Clone)]
pub struct WordPiece {
    vocab: HashMap<String, u32>,
    cls: u32,
    sep: u32,
    pad: u32,
    unk: u32,
    max_len: usize,
}

impl WordPiece {
    /// The tokenizer for the setup cache's MiniLM vocabulary.
    pub fn from_assets(assets: &Assets) -> Result<Self, TokenizerError> {
        Self::from_vocab_file(&assets.path(assets::VOCAB)?)
    }

    /// Reads a `vocab.txt`; `[CLS]`, `[SEP]`, `[PAD]` and `[UNK]` must be in it.
    pub fn from_vocab_file(path: &Path) -> Result<Self, TokenizerError> {
        let io = |source| TokenizerError::Io { path: path.to_path_buf(), source };
        let len = std::fs::metadata(path).map_err(io)?.len();
        if len > MAX_VOCAB_BYTES {
            return Err(TokenizerError::BadVocab {
                path: path.to_path_buf(),
                detail: format!("{len} bytes, more than the {MAX_VOCAB_BYTES} accepted"),
            });
        }
        let text = std::fs::read_to_string(path).map_err(io)?;
        Self::from_vocab_text(&text)
            .map_err(|detail| TokenizerError::BadVocab { path: path.to_path_buf(), detail })
    }

    /// Builds the tokenizer from the text of a `vocab.txt`; the error says what is missing.
    pub fn from_vocab_text(text: &str) -> Result<Self, String> {
        let mut vocab = HashMap::new();
        for (id, line) in text.lines().enumerate() {
            let id = u32::try_from(id).map_err(|_| "more than 2^32 tokens".to_string())?;
            // Later duplicates win, as in the `tokenizers` package.
            vocab.insert(line.trim_end().to_owned(), id);
        }
        let special = |tok: &str| vocab.get(tok).copied().ok_or_else(|| format!("no {tok} token"));
        Ok(Self {
            cls: special("[CLS]")?,
            sep: special("[SEP]")?,
            pad: special("[PAD]")?,
            unk: special("[UNK]")?,
            vocab,
            max_len: DEFAULT_MAX_LEN,
        })
    }

    /// Sets the longest sequence produced (at least 2: `[CLS]` and `[SEP]`).
    pub fn with_max_len(mut self, max_len: usize) -> Self {
        self.max_len = max_len.max(2);
        self
    }

    /// The longest sequence produced, special tokens included.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    /// The id of `[PAD]`.
    pub fn pad_id(&self) -> u32 {
        self.pad
    }

    /// `[CLS] word pieces [SEP]`, the pieces truncated so the whole fits in `max_len`.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut ids = vec![self.cls];
        let budget = self.max_len - 2;
        for word in pre_tokenize(&normalize(text)) {
            if ids.len() > budget {
                break;
            }
            self.word_pieces(&word, &mut ids);
        }
        ids.truncate(budget + 1);
        ids.push(self.sep);
        ids
    }

    /// Encodes each text and right-pads to the longest, with the attention mask.
    pub fn encode_batch<S: AsRef<str>>(&self, texts: &[S]) -> Batch {
        let encoded: Vec<Vec<u32>> = texts.iter().map(|t| self.encode(t.as_ref())).collect();
        let seq_len = encoded.iter().map(Vec::len).max().unwrap_or(0);
        let mut ids = Vec::with_capacity(encoded.len() * seq_len);
        let mut attention_mask = Vec::with_capacity(encoded.len() * seq_len);
        for seq in &encoded {
            ids.extend(seq.iter().map(|&i| i64::from(i)));
            ids.extend(std::iter::repeat_n(i64::from(self.pad), seq_len - seq.len()));
            attention_mask.extend(std::iter::repeat_n(1, seq.len()));
            attention_mask.extend(std::iter::repeat_n(0, seq_len - seq.len()));
        }
        Batch { batch: encoded.len(), seq_len, ids, attention_mask }
    }

    /// Greedy longest-match-first split of one word; the whole word is `[UNK]` if any piece is unknown.
    fn word_pieces(&self, word: &str, out: &mut Vec<u32>) {
        let chars: Vec<(usize, char)> = word.char_indices().collect();
        if chars.len() > MAX_CHARS_PER_WORD {
            out.push(self.unk);
            return;
        }
        let byte_at = |i: usize| chars.get(i).map_or(word.len(), |&(b, _)| b);
        let first = out.len();
        let mut start = 0;
        let mut piece = String::new();
        while start < chars.len() {
            let mut end = chars.len();
            let mut found = None;
            while end > start {
                piece.clear();
                if start > 0 {
                    piece.push_str("##");
                }
                piece.push_str(&word[byte_at(start)..byte_at(end)]);
                if let Some(&id) = self.vocab.get(&piece) {
                    found = Some(id);
                    break;
                }
                end -= 1;
            }
            match found {
                Some(id) => out.push(id),
                None => {
                    out.truncate(first);
                    out.push(self.unk);
                    return;
                }
            }
            start = end;
        }
    }
}

/// BERT normalisation: clean, space out CJK, strip accents, lowercase (the order `tokenizers` uses).
fn normalize(text: &str) -> String {
    let mut cleaned = String::with_capacity(text.len());
    for c in text.chars() {
        if c == '\0' || c == '\u{fffd}' || is_control(c) {
            continue;
        }
        if is_cjk(c) {
            cleaned.push(' ');
            cleaned.push(c);
            cleaned.push(' ');
        } else if is_whitespace(c) {
            cleaned.push(' ');
        } else {
            cleaned.push(c);
        }
    }
    let stripped: String =
        cleaned.nfd().filter(|&c| c.general_category() != GeneralCategory::NonspacingMark).collect();
    stripped.to_lowercase()
}

/// Splits on whitespace (dropped) and punctuation (each mark its own word).
fn pre_tokenize(text: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut current = String::new();
    for c in text.chars() {
        if c.is_whitespace() || is_punctuation(c) {
            if !current.is_empty() {
                words.push(std::mem::take(&mut current));
            }
            if !c.is_whitespace() {
                words.push(c.to_string());
            }
        } else {
            current.push(c);
        }
    }
    if !current.is_empty() {
        words.push(current);
    }
    words
}

/// Tab, newline and carriage return count as whitespace, not control.
fn is_whitespace(c: char) -> bool {
    matches!(c, '\t' | '\n' | '\r') || c.is_whitespace()
}

/// Unicode "Other" characters (Cc, Cf, Cn, Co, Cs) except tab, newline and carriage return.
fn is_control(c: char) -> bool {
    !matches!(c, '\t' | '\n' | '\r') && c.general_category_group() == GeneralCategoryGroup::Other
}

/// ASCII symbols count as punctuation too (`$`, `+`, `^`, ...), as in BERT.
fn is_punctuation(c: char) -> bool {
    c.is_ascii_punctuation() || c.general_category_group() == GeneralCategoryGroup::Punctuation
}

/// CJK Unified Ideographs and their extensions and compatibility blocks (not Hangul or kana).
fn is_cjk(c: char) -> bool {
    matches!(u32::from(c),
        0x4E00..=0x9FFF
        | 0x3400..=0x4DBF
        | 0x20000..=0x2A6DF
        | 0x2A700..=0x2B73F
        | 0x2B740..=0x2B81F
        | 0x2B920..=0x2CEAF
        | 0xF900..=0xFAFF
        | 0x2F800..=0x2FA1F)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toy() -> WordPiece {
        let vocab = "[PAD]\n[UNK]\n[CLS]\n[SEP]\nun\n##aff\n##able\nhello\n,\n!\ncafe\n中\n##a";
        WordPiece::from_vocab_text(vocab).unwrap()
    }

    #[test]
    fn wordpiece_longest_match_unknown_and_specials() {
        let t = toy();
        // [CLS]=2 un=4 ##aff=5 ##able=6 ,=8 hello=7 !=9 [SEP]=3
        assert_eq!(t.encode("Unaffable, HELLO!"), vec![2, 4, 5, 6, 8, 7, 9, 3]);
        // "unknown" has no split into known pieces: one [UNK] for the whole word
        assert_eq!(t.encode("unknown hello"), vec![2, 1, 7, 3]);
        // accents stripped, CJK isolated
        assert_eq!(t.encode("Café中"), vec![2, 10, 11, 3]);
        assert_eq!(t.encode(""), vec![2, 3]);
        assert_eq!(t.encode(&"x".repeat(101)), vec![2, 1, 3]);
    }

    #[test]
    fn truncation_and_padding() {
        let t = toy().with_max_len(4);
        assert_eq!(t.encode("hello hello hello"), vec![2, 7, 7, 3]);
        assert_eq!(t.encode("unaffable"), vec![2, 4, 5, 3]);
        let b = toy().encode_batch(&["hello", "hello, hello"]);
        assert_eq!((b.batch, b.seq_len), (2, 5));
        assert_eq!(b.ids, vec![2, 7, 3, 0, 0, 2, 7, 8, 7, 3]);
        assert_eq!(b.attention_mask, vec![1, 1, 1, 0, 0, 1, 1, 1, 1, 1]);
    }

    #[test]
    fn vocab_without_specials_is_rejected() {
        let err = WordPiece::from_vocab_text("[PAD]\n[CLS]\n[SEP]\n").unwrap_err();
        assert!(err.contains("[UNK]"), "{err}");
    }

    #[test]
    fn normalisation_matches_bert_rules() {
        assert_eq!(normalize("Héllo\tWÖRLD\u{200b}!"), "hello world!");
        assert_eq!(normalize("a中b"), "a 中 b");
        assert_eq!(pre_tokenize("don't  stop-it $5"), vec!["don", "'", "t", "stop", "-", "it", "$", "5"]);
    }
}

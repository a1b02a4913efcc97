//! Finding the files `scripts/setup` builds: models, tokenizer files, data and the ONNX Runtime library.
//!
//! Setup writes everything under `<repo>/.cache` and lists each file with its sha256 and size in
//! `.cache/manifest.json`. [`Assets::locate`] finds that directory (env `TROUPE_CACHE`, else the first
//! ancestor of the current directory or of the running executable holding `.cache/manifest.json`);
//! [`Assets::path`] resolves a listed file and [`Assets::verify`] checks its checksum on request.
//! Every error names the file and the fix ("run scripts/setup").

use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// The fix every "asset missing" error suggests.
pub const SETUP_HINT: &str = "run scripts/setup";
/// Env var that names the cache directory explicitly (the directory holding `manifest.json`).
pub const CACHE_ENV: &str = "TROUPE_CACHE";

/// all-MiniLM-L6-v2 as one graph: `input_ids`, `attention_mask` (i64 `[B,S]`) -> `sentence_embedding` (`[B,384]`).
pub const MINILM_WHOLE: &str = "models/minilm_whole.onnx";
/// The same graph in 3 stages, cut by `troupe pipeline split --stages 3` (balanced by weight bytes:
/// the word-embedding table, layers 0-2, layers 3-5 + pooling). The cut tensors are the split's
/// choice, named in [`MINILM_SPLIT`]; consumers feed each stage by its input names.
pub const MINILM_STAGES: [&str; 3] =
    ["models/minilm_stage0.onnx", "models/minilm_stage1.onnx", "models/minilm_stage2.onnx"];
/// The split's manifest for [`MINILM_STAGES`] (cuts, files with sha256, inputs and outputs, bytes).
pub const MINILM_SPLIT: &str = "models/minilm_split.json";
/// all-mpnet-base-v2 (12-layer MPNet, hidden 768, ~4.8x MiniLM) as one graph, built only by
/// `scripts/setup --large` ([`LARGE_SETUP_HINT`]): `input_ids`, `attention_mask` -> `sentence_embedding` (`[B,768]`).
pub const MPNET_WHOLE: &str = "models/mpnet_whole.onnx";
/// The same graph in 4 stages cut by `troupe pipeline split --stages 4` (balanced by weight bytes).
pub const MPNET_STAGES: [&str; 4] = [
    "models/mpnet_stage0.onnx",
    "models/mpnet_stage1.onnx",
    "models/mpnet_stage2.onnx",
    "models/mpnet_stage3.onnx",
];
/// The split's manifest for [`MPNET_STAGES`].
pub const MPNET_SPLIT: &str = "models/mpnet_split.json";
/// Token ids (from the model's own tokenizer), masks and Python onnxruntime embeddings for a few
/// sentences, written after the whole graph matched a numpy forward pass of the original weights.
pub const MPNET_CHECK: &str = "models/mpnet_check.json";
/// The fix for a missing large-model file (the opt-in part of setup).
pub const LARGE_SETUP_HINT: &str = "run scripts/setup --large (opt-in: ~404 MB download, ~1.3 GB on disk)";
/// Reference ids, masks and embeddings from Python onnxruntime for a few sentences.
pub const MINILM_CHECK: &str = "models/minilm_check.json";
/// 4->3->2 MLP with formula weights (`x` f32 `[N,4]` -> `y` f32 `[N,2]`, see scripts/tools/make_tiny.py).
pub const TINY_MLP: &str = "models/tiny_mlp.onnx";
/// `ids` i64 `[N]` -> `out` i64 `[N]` = 2*ids + 1.
pub const TINY_INT: &str = "models/tiny_int.onnx";
/// Inputs and Python onnxruntime outputs for the tiny models.
pub const TINY_CHECK: &str = "models/tiny_check.json";
/// 64-32-10 MLP trained on digits: `x` f32 `[N,64]` (pixels / 16) -> `probs` f32 `[N,10]`.
pub const DIGITS_MLP: &str = "models/digits_mlp.onnx";
/// The MiniLM WordPiece vocabulary (one token per line; the line number is the id).
pub const VOCAB: &str = "models/vocab.txt";
/// Tokenizer settings written by setup (lowercase, max length, special tokens).
pub const TOKENIZER_CONFIG: &str = "models/tokenizer_config.json";
/// Reference token ids from the Python `tokenizers` package.
pub const TOKENIZER_CHECK: &str = "models/tokenizer_check.json";
/// scikit-learn's digits as a compact binary file (see [`Digits`]).
pub const DIGITS: &str = "data/digits.bin";

/// Largest manifest accepted (it lists a few dozen files).
const MAX_MANIFEST_BYTES: u64 = 1 << 20;
/// Largest digits file accepted.
const MAX_DIGITS_BYTES: u64 = 64 << 20;

/// Why an asset could not be found or trusted.
#[derive(Debug, thiserror::Error)]
pub enum AssetError {
    /// No `.cache/manifest.json` above the current directory or the executable, and no `TROUPE_CACHE`.
    #[error("no asset cache found (looked for .cache/manifest.json above {searched}); {SETUP_HINT}")]
    CacheNotFound {
        /// The directories whose ancestors were searched.
        searched: String,
    },
    /// The manifest is missing, unreadable or not the expected JSON.
    #[error("{path}: bad asset manifest ({detail}); {SETUP_HINT}")]
    Manifest {
        /// The manifest file.
        path: PathBuf,
        /// What is wrong with it.
        detail: String,
    },
    /// The file is not one setup produces (or the manifest predates it).
    #[error("{name} is not listed in {manifest}; {SETUP_HINT}")]
    NotListed {
        /// The asset name asked for.
        name: String,
        /// The manifest searched.
        manifest: PathBuf,
    },
    /// The manifest lists the file but it is not on disk.
    #[error("{path} is missing; {SETUP_HINT}")]
    Missing {
        /// The absent file.
        path: PathBuf,
    },
    /// The file differs from what setup wrote (size or sha256).
    #[error("{path} does not match the manifest ({detail}); {SETUP_HINT} to rebuild it")]
    Changed {
        /// The changed file.
        path: PathBuf,
        /// Which check failed.
        detail: String,
    },
    /// The file exists but is not in the documented format.
    #[error("{path}: malformed file: {detail}; {SETUP_HINT} to rebuild it")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// Reading a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}

/// One file listed in the manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileEntry {
    /// Lowercase hex sha256 of the content.
    pub sha256: String,
    /// Size in bytes.
    pub bytes: u64,
}

/// The setup cache: its directory and the manifest's file list.
#[derive(Debug, Clone)]
pub struct Assets {
    dir: PathBuf,
    files: BTreeMap<String, FileEntry>,
    ort_library: Option<String>,
}

impl Assets {
    /// Finds the cache: `TROUPE_CACHE` if set, else the nearest `.cache/manifest.json` above the current
    /// directory, then above the running executable.
    pub fn locate() -> Result<Self, AssetError> {
        if let Some(dir) = std::env::var_os(CACHE_ENV).filter(|d| !d.is_empty()) {
            return Self::open(Path::new(&dir));
        }
        let starts: Vec<PathBuf> = [
            std::env::current_dir().ok(),
            std::env::current_exe().ok().and_then(|e| e.parent().map(Path::to_path_buf)),
        ]
        .into_iter()
        .flatten()
        .collect();
        for start in &starts {
            for dir in start.ancestors() {
                let cache = dir.join(".cache");
                if cache.join("manifest.json").is_file() {
                    return Self::open(&cache);
                }
            }
        }
        let searched = starts.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(" and ");
        Err(AssetError::CacheNotFound { searched })
    }

    /// Opens the cache directory `dir` (the one holding `manifest.json`).
    pub fn open(dir: &Path) -> Result<Self, AssetError> {
        let path = dir.join("manifest.json");
        let bad = |detail: String| AssetError::Manifest { path: path.clone(), detail };
        let text = read_capped(&path, MAX_MANIFEST_BYTES)?;
        let json: serde_json::Value =
            serde_json::from_slice(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
        let listed =
            json.get("files").and_then(|f| f.as_object()).ok_or_else(|| bad("no \"files\" object".into()))?;
        let mut files = BTreeMap::new();
        for (name, entry) in listed {
            let sha256 = entry.get("sha256").and_then(|s| s.as_str());
            let bytes = entry.get("bytes").and_then(|b| b.as_u64());
            match (sha256, bytes) {
                (Some(sha), Some(bytes)) if sha.len() == 64 => {
                    files.insert(name.clone(), FileEntry { sha256: sha.to_ascii_lowercase(), bytes });
                }
                _ => return Err(bad(format!("entry {name} lacks sha256/bytes"))),
            }
        }
        let ort_library = json.get("ort_library").and_then(|s| s.as_str()).map(str::to_owned);
        Ok(Self { dir: dir.to_path_buf(), files, ort_library })
    }

    /// The cache directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Every file the manifest lists, by name relative to [`Assets::dir`].
    pub fn files(&self) -> impl Iterator<Item = (&str, &FileEntry)> {
        self.files.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The path of a listed file that exists with the recorded size (no checksum: see [`Assets::verify`]).
    pub fn path(&self, name: &str) -> Result<PathBuf, AssetError> {
        let entry = self.files.get(name).ok_or_else(|| AssetError::NotListed {
            name: name.to_owned(),
            manifest: self.dir.join("manifest.json"),
        })?;
        let path = self.dir.join(name);
        let meta = match fs::metadata(&path) {
            Ok(m) if m.is_file() => m,
            Ok(_) => return Err(AssetError::Missing { path }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(AssetError::Missing { path });
            }
            Err(source) => return Err(AssetError::Io { path, source }),
        };
        if meta.len() != entry.bytes {
            let detail = format!("{} bytes, manifest says {}", meta.len(), entry.bytes);
            return Err(AssetError::Changed { path, detail });
        }
        Ok(path)
    }

    /// Like [`Assets::path`], and also checks the file's sha256 against the manifest.
    pub fn verify(&self, name: &str) -> Result<PathBuf, AssetError> {
        let path = self.path(name)?;
        let found = sha256_file(&path)?;
        let expected = &self.files[name].sha256;
        if &found != expected {
            let detail = format!("sha256 {found}, manifest says {expected}");
            return Err(AssetError::Changed { path, detail });
        }
        Ok(path)
    }

    /// Checks every listed file; the first problem is returned.
    pub fn verify_all(&self) -> Result<(), AssetError> {
        self.files.keys().try_for_each(|name| self.verify(name).map(drop))
    }

    /// The ONNX Runtime shared library setup recorded (the one inside the onnxruntime wheel).
    pub fn ort_library(&self) -> Result<PathBuf, AssetError> {
        let name = self.ort_library.as_deref().ok_or_else(|| AssetError::Manifest {
            path: self.dir.join("manifest.json"),
            detail: "no \"ort_library\" entry".into(),
        })?;
        self.path(name)
    }

    /// Reads [`DIGITS`].
    pub fn digits(&self) -> Result<Digits, AssetError> {
        Digits::load(&self.path(DIGITS)?)
    }
}

/// Lowercase hex sha256 of a file, read in 1 MiB blocks.
pub fn sha256_file(path: &Path) -> Result<String, AssetError> {
    let io = |source| AssetError::Io { path: path.to_path_buf(), source };
    let mut file = fs::File::open(path).map_err(io)?;
    let mut hasher = Sha256::new();
    let mut block = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut block).map_err(io)?;
        if n == 0 {
            break;
        }
        hasher.update(&block[..n]);
    }
    Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// Reads a whole file, refusing files larger than `cap` bytes before allocating.
fn read_capped(path: &Path, cap: u64) -> Result<Vec<u8>, AssetError> {
    let io = |source| AssetError::Io { path: path.to_path_buf(), source };
    let file = fs::File::open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => AssetError::Missing { path: path.to_path_buf() },
        _ => io(e),
    })?;
    let len = file.metadata().map_err(io)?.len();
    if len > cap {
        return Err(AssetError::Malformed {
            path: path.to_path_buf(),
            detail: format!("{len} bytes, more than the {cap} accepted"),
        });
    }
    let mut out = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
    file.take(cap + 1).read_to_end(&mut out).map_err(io)?;
    Ok(out)
}

/// scikit-learn's digits: grey 8x8 images with pixel values 0..=16 and labels 0..=9.
///
/// File layout (`data/digits.bin`, integers little-endian): 8-byte magic `TRDIGIT1`, u32 count, u32 rows,
/// u32 cols, then `count*rows*cols` u8 pixels (image-major, row-major), then `count` u8 labels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Digits {
    /// Image height.
    pub rows: usize,
    /// Image width.
    pub cols: usize,
    /// All pixels, image after image, each row-major; values 0..=16.
    pub pixels: Vec<u8>,
    /// One label per image, 0..=9.
    pub labels: Vec<u8>,
}

impl Digits {
    /// The file's first 8 bytes.
    pub const MAGIC: &'static [u8; 8] = b"TRDIGIT1";
    /// Largest pixel value.
    pub const MAX_PIXEL: u8 = 16;

    /// Reads and validates a digits file.
    pub fn load(path: &Path) -> Result<Self, AssetError> {
        let bytes = read_capped(path, MAX_DIGITS_BYTES)?;
        Self::parse(&bytes).map_err(|detail| AssetError::Malformed { path: path.to_path_buf(), detail })
    }

    /// Parses the bytes of a digits file; the error says what is wrong.
    pub fn parse(bytes: &[u8]) -> Result<Self, String> {
        let header = bytes
            .get(..20)
            .ok_or_else(|| format!("{} bytes, shorter than the 20-byte header", bytes.len()))?;
        if &header[..8] != Self::MAGIC {
            return Err("bad magic (expected TRDIGIT1)".into());
        }
        let word = |at: usize| {
            let mut w = [0u8; 4];
            w.copy_from_slice(&header[at..at + 4]);
            u32::from_le_bytes(w) as usize
        };
        let (count, rows, cols) = (word(8), word(12), word(16));
        let pixel_len =
            count.checked_mul(rows).and_then(|n| n.checked_mul(cols)).ok_or("header sizes overflow")?;
        let want =
            pixel_len.checked_add(count).and_then(|n| n.checked_add(20)).ok_or("header sizes overflow")?;
        if bytes.len() != want {
            return Err(format!(
                "header says {count} images of {rows}x{cols} ({want} bytes), file has {}",
                bytes.len()
            ));
        }
        let pixels = bytes[20..20 + pixel_len].to_vec();
        let labels = bytes[20 + pixel_len..].to_vec();
        if let Some(p) = pixels.iter().find(|&&p| p > Self::MAX_PIXEL) {
            return Err(format!("pixel value {p} above {}", Self::MAX_PIXEL));
        }
        if let Some(l) = labels.iter().find(|&&l| l > 9) {
            return Err(format!("label {l} above 9"));
        }
        Ok(Self { rows, cols, pixels, labels })
    }

    /// Number of images.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// True when there are no images.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// The pixels of image `i` (row-major), or `None` past the end.
    pub fn image(&self, i: usize) -> Option<&[u8]> {
        let n = self.rows * self.cols;
        self.pixels.get(i * n..(i + 1) * n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digits_bytes(count: u32, rows: u32, cols: u32, pixels: &[u8], labels: &[u8]) -> Vec<u8> {
        let mut b = Digits::MAGIC.to_vec();
        for w in [count, rows, cols] {
            b.extend_from_slice(&w.to_le_bytes());
        }
        b.extend_from_slice(pixels);
        b.extend_from_slice(labels);
        b
    }

    #[test]
    fn digits_parse_roundtrip_and_rejects_bad_files() {
        let ok = digits_bytes(2, 1, 2, &[0, 16, 3, 4], &[7, 9]);
        let d = Digits::parse(&ok).unwrap();
        assert_eq!((d.len(), d.rows, d.cols), (2, 1, 2));
        assert_eq!(d.image(1), Some(&[3u8, 4][..]));
        assert_eq!(d.image(2), None);
        assert!(Digits::parse(&ok[..19]).unwrap_err().contains("header"));
        assert!(Digits::parse(&ok[..ok.len() - 1]).unwrap_err().contains("file has"));
        let mut magic = ok.clone();
        magic[0] = b'X';
        assert!(Digits::parse(&magic).unwrap_err().contains("magic"));
        let huge = digits_bytes(u32::MAX, u32::MAX, u32::MAX, &[], &[]);
        assert!(Digits::parse(&huge).is_err());
        let bright = digits_bytes(1, 1, 1, &[17], &[0]);
        assert!(Digits::parse(&bright).unwrap_err().contains("pixel value 17"));
        let label = digits_bytes(1, 1, 1, &[1], &[10]);
        assert!(Digits::parse(&label).unwrap_err().contains("label 10"));
    }

    #[test]
    fn manifest_paths_sizes_and_checksums() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("a.txt"), b"hello").unwrap();
        // sha256("hello")
        let sha = "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824";
        let manifest = format!(
            r#"{{"files": {{"a.txt": {{"sha256": "{sha}", "bytes": 5}}, "gone.txt": {{"sha256": "{sha}", "bytes": 5}}}}, "ort_library": "a.txt"}}"#
        );
        fs::write(dir.path().join("manifest.json"), manifest).unwrap();
        let assets = Assets::open(dir.path()).unwrap();
        assert_eq!(assets.verify("a.txt").unwrap(), dir.path().join("a.txt"));
        assert_eq!(assets.ort_library().unwrap(), dir.path().join("a.txt"));
        let missing = assets.path("gone.txt").unwrap_err().to_string();
        assert!(missing.contains("gone.txt") && missing.contains(SETUP_HINT), "{missing}");
        assert!(matches!(assets.path("other"), Err(AssetError::NotListed { .. })));
        fs::write(dir.path().join("a.txt"), b"HELLO").unwrap();
        let changed = assets.verify("a.txt").unwrap_err().to_string();
        assert!(changed.contains("sha256") && changed.contains("a.txt"), "{changed}");
        fs::write(dir.path().join("a.txt"), b"hello!").unwrap();
        assert!(matches!(assets.path("a.txt"), Err(AssetError::Changed { .. })));
        fs::write(dir.path().join("manifest.json"), b"{not json").unwrap();
        let bad = Assets::open(dir.path()).unwrap_err().to_string();
        assert!(bad.contains("manifest.json") && bad.contains(SETUP_HINT), "{bad}");
    }
}

//! Model files and the trained-model cache.
//!
//! Layout (little-endian): magic `TRVMOE02` (`TRVMOE` and a two-digit format version); ten u32 config
//! fields (patch, dim, heads, blocks, experts, top_k, hidden, proj, classes, capacity_factor as f32
//! bits); u64 parameter count; that many f32 in [`super::VMoeParams::tensors`] order; a 32-byte blake3
//! hash of everything before it. Readers cap the file size, refuse other format versions by name
//! (version 01 had no attention), validate the config, and check the count and hash before building
//! tensors.

use std::io::Read;
use std::path::{Path, PathBuf};

use super::VMoeError;
use super::model::{VMoe, VMoeConfig, VMoeParams};
use super::train::{Dataset, Recipe, TrainReport, train_new};
use crate::tensor::Tensor;

/// The file's first 8 bytes: [`MAGIC_PREFIX`] and the format version this build reads and writes.
pub const MAGIC: &[u8; 8] = b"TRVMOE02";
/// The magic's first 6 bytes, the same in every version.
pub const MAGIC_PREFIX: &[u8; 6] = b"TRVMOE";
/// Config fields in the header.
const CONFIG_WORDS: usize = 10;
/// Largest model file accepted.
pub const MAX_MODEL_BYTES: u64 = 64 * 1024 * 1024;
const HEADER: usize = 8 + CONFIG_WORDS * 4 + 8;

/// The bytes of a model file for `model`.
pub fn encode(model: &VMoe) -> Vec<u8> {
    let c = &model.config;
    let mut out = MAGIC.to_vec();
    for v in [c.patch, c.dim, c.heads, c.blocks, c.experts, c.top_k, c.hidden, c.proj, c.classes] {
        out.extend_from_slice(&(v as u32).to_le_bytes());
    }
    out.extend_from_slice(&c.capacity_factor.to_bits().to_le_bytes());
    out.extend_from_slice(&(model.params.numel() as u64).to_le_bytes());
    for (_, t) in model.params.tensors() {
        for v in t.f32_cow().iter() {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    let hash = blake3::hash(&out);
    out.extend_from_slice(hash.as_bytes());
    out
}

/// Parses model-file bytes; the error string says what is wrong.
pub fn decode(bytes: &[u8]) -> Result<VMoe, String> {
    if bytes.len() >= 8 && bytes[..6] == MAGIC_PREFIX[..] && bytes[..8] != MAGIC[..] {
        let version = String::from_utf8_lossy(&bytes[6..8]).into_owned();
        return Err(format!(
            "model file format version {version:?} is not supported (this build reads {:?}); retrain it",
            String::from_utf8_lossy(&MAGIC[6..])
        ));
    }
    if bytes.len() < HEADER + 32 {
        return Err(format!("{} bytes, shorter than header and checksum", bytes.len()));
    }
    if &bytes[..8] != MAGIC {
        return Err("bad magic (expected TRVMOE02)".into());
    }
    let (body, sum) = bytes.split_at(bytes.len() - 32);
    if blake3::hash(body).as_bytes() != sum {
        return Err("blake3 checksum does not match the contents".into());
    }
    let word = |i: usize| {
        let at = 8 + 4 * i;
        u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
    };
    let f = |i: usize| word(i) as usize;
    let config = VMoeConfig {
        patch: f(0),
        dim: f(1),
        heads: f(2),
        blocks: f(3),
        experts: f(4),
        top_k: f(5),
        hidden: f(6),
        proj: f(7),
        classes: f(8),
        capacity_factor: f32::from_bits(word(9)),
    };
    config.validate().map_err(|e| e.to_string())?;
    let mut n = [0u8; 8];
    n.copy_from_slice(&bytes[HEADER - 8..HEADER]);
    let count = u64::from_le_bytes(n);
    let want = config.param_count() as u64;
    if count != want {
        return Err(format!("header says {count} parameters, the config needs {want}"));
    }
    let payload = &body[HEADER..];
    if payload.len() as u64 != want * 4 {
        return Err(format!("{} payload bytes for {want} parameters", payload.len()));
    }
    let mut floats = payload.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
    let mut tensors = Vec::new();
    for shape in VMoe::shapes(&config) {
        let len: usize = shape.iter().product();
        let data: Vec<f32> = floats.by_ref().take(len).collect();
        tensors.push(Tensor::from_f32(&shape, data).map_err(|e| e.to_string())?);
    }
    let params = params_from_tensors(&config, tensors)?;
    VMoe::from_params(config, params).map_err(|e| e.to_string())
}

fn params_from_tensors(c: &VMoeConfig, tensors: Vec<Tensor>) -> Result<VMoeParams, String> {
    let mut it = tensors.into_iter();
    let mut next = || it.next().ok_or_else(|| "too few tensors".to_string());
    let (patch_w, patch_b, pos) = (next()?, next()?, next()?);
    let mut blocks = Vec::with_capacity(c.blocks);
    for _ in 0..c.blocks {
        let (attn_gamma, attn_beta) = (next()?, next()?);
        let attn = crate::ops::AttentionParams { wq: next()?, wk: next()?, wv: next()?, wo: next()? };
        let (ln_gamma, ln_beta, router) = (next()?, next()?, next()?);
        let mut experts = Vec::with_capacity(c.experts);
        for _ in 0..c.experts {
            experts.push(crate::ops::ExpertParams { w1: next()?, b1: next()?, w2: next()?, b2: next()? });
        }
        blocks.push(super::model::MoeBlock {
            attn_gamma,
            attn_beta,
            attn,
            ln_gamma,
            ln_beta,
            router,
            experts,
        });
    }
    Ok(VMoeParams {
        patch_w,
        patch_b,
        pos,
        blocks,
        final_gamma: next()?,
        final_beta: next()?,
        proj_w: next()?,
        proj_b: next()?,
        head_w: next()?,
        head_b: next()?,
    })
}

/// Writes `model` to `path` (through a temporary file renamed into place).
pub fn save_model(model: &VMoe, path: &Path) -> Result<(), VMoeError> {
    let io = |context, source| VMoeError::Io { context, path: path.to_path_buf(), source };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| io("creating the directory of", e))?;
    }
    // A name of its own per call, so concurrent savers of the same model never share a temporary.
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = path.with_extension(format!("tmp.{}.{n}", std::process::id()));
    std::fs::write(&tmp, encode(model)).map_err(|e| io("writing", e))?;
    std::fs::rename(&tmp, path).map_err(|e| io("renaming into", e))
}

/// Reads a model file, capped at [`MAX_MODEL_BYTES`]; errors name the file.
pub fn load_model(path: &Path) -> Result<VMoe, VMoeError> {
    let io = |source| VMoeError::Io { context: "reading", path: path.to_path_buf(), source };
    let file = std::fs::File::open(path).map_err(io)?;
    let mut bytes = Vec::new();
    file.take(MAX_MODEL_BYTES + 1).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > MAX_MODEL_BYTES {
        return Err(VMoeError::BadModelFile {
            path: path.to_path_buf(),
            detail: format!("more than the {MAX_MODEL_BYTES} bytes accepted"),
        });
    }
    decode(&bytes).map_err(|detail| VMoeError::BadModelFile { path: path.to_path_buf(), detail })
}

/// A directory of trained models keyed by name, config and recipe; models missing or unreadable are
/// (re)trained and saved.
#[derive(Clone, Debug)]
pub struct ModelZoo {
    dir: PathBuf,
}

/// Where a model came from.
#[derive(Clone, Debug, PartialEq)]
pub enum Provenance {
    /// Read from this file.
    Loaded(PathBuf),
    /// Trained now (and saved to the file).
    Trained(TrainReport),
}

impl ModelZoo {
    /// A zoo in `dir` (created on first save).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// The zoo in the setup cache: `.cache/models/vmoe/`.
    pub fn in_cache() -> Result<Self, VMoeError> {
        Ok(Self::new(crate::assets::Assets::locate()?.dir().join("models/vmoe")))
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file for a model called `name` with `config` trained by `recipe` on data tagged `data_tag`
    /// (keyed also by the file format version).
    pub fn path_for(&self, name: &str, config: &VMoeConfig, recipe: &Recipe, data_tag: &str) -> PathBuf {
        // The format version names the architecture too (02: attention, 16x16 grid), so files of
        // another architecture are never looked up even when a config prints the same.
        let key = format!("{}|{config:?}|{}|{data_tag}", String::from_utf8_lossy(MAGIC), recipe.tag());
        let short = &blake3::hash(key.as_bytes()).to_hex()[..16];
        self.dir.join(format!("{name}-{}-{short}.vmoe", recipe.tag()))
    }

    /// The model from its file, or trained on `data` and saved when the file is missing or bad.
    pub fn get_or_train(
        &self,
        name: &str,
        config: VMoeConfig,
        recipe: &Recipe,
        data_tag: &str,
        data: &Dataset,
    ) -> Result<(VMoe, Provenance), VMoeError> {
        let path = self.path_for(name, &config, recipe, data_tag);
        if let Some(model) = cached(&path, config, false) {
            return Ok((model, Provenance::Loaded(path)));
        }
        // One trainer per model across threads and processes (tests run in parallel on a cold
        // cache): the others wait on the lock and then load what it saved.
        let _lock = lock_file(&path)?;
        if let Some(model) = cached(&path, config, true) {
            return Ok((model, Provenance::Loaded(path)));
        }
        let (model, report) = train_new(config, data, recipe)?;
        save_model(&model, &path)?;
        Ok((model, Provenance::Trained(report)))
    }
}

/// The model cached at `path` if it loads with `config`; `warn`s why not (when asked) otherwise.
fn cached(path: &Path, config: VMoeConfig, warn: bool) -> Option<VMoe> {
    match load_model(path) {
        Ok(model) if model.config == config => return Some(model),
        Ok(_) if warn => {
            tracing::warn!(path = %path.display(), "cached model has another config; retraining")
        }
        Err(VMoeError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) if warn => tracing::warn!(error = %e, "cached model unusable; retraining"),
        _ => {}
    }
    None
}

/// An exclusive lock on `<path>.lock`, held until the returned file is dropped.
fn lock_file(path: &Path) -> Result<std::fs::File, VMoeError> {
    let lock = path.with_extension("lock");
    let io = |context, source| VMoeError::Io { context, path: lock.clone(), source };
    if let Some(dir) = lock.parent() {
        std::fs::create_dir_all(dir).map_err(|e| io("creating the directory of", e))?;
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock)
        .map_err(|e| io("opening", e))?;
    file.lock().map_err(|e| io("locking", e))?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::SmallRng;

    #[test]
    fn round_trip_and_rejections() {
        let m = VMoe::new(VMoeConfig::tiny(), &mut SmallRng::seed_from_u64(3)).unwrap();
        let bytes = encode(&m);
        assert_eq!(bytes.len(), HEADER + 4 * m.config.param_count() + 32);
        let back = decode(&bytes).unwrap();
        assert_eq!(back.config, m.config);
        for ((_, a), (_, b)) in back.params.tensors().iter().zip(m.params.tensors()) {
            assert_eq!(a.to_vec_f32(), b.to_vec_f32());
        }
        let mut flipped = bytes.clone();
        flipped[HEADER + 5] ^= 1;
        assert!(decode(&flipped).unwrap_err().contains("checksum"));
        assert!(decode(&bytes[..40]).unwrap_err().contains("shorter"));
        let mut magic = bytes.clone();
        magic[0] = b'X';
        assert!(decode(&magic).unwrap_err().contains("magic"));
        // A file of the previous format (no attention) or a future one is refused by version.
        for old in [b"TRVMOE01", b"TRVMOE99"] {
            let mut v = bytes.clone();
            v[..8].copy_from_slice(old);
            let err = decode(&v).unwrap_err();
            assert!(
                err.contains("version") && err.contains(&String::from_utf8_lossy(&old[6..]).to_string()),
                "{err}"
            );
        }
        // A header claiming a huge config is refused before allocating (hash recomputed to pass).
        let mut huge = bytes[..bytes.len() - 32].to_vec();
        huge[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        let h = blake3::hash(&huge);
        huge.extend_from_slice(h.as_bytes());
        assert!(decode(&huge).unwrap_err().contains("dim"));

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.vmoe");
        save_model(&m, &path).unwrap();
        assert_eq!(load_model(&path).unwrap().config, m.config);
        std::fs::write(&path, &flipped).unwrap();
        let err = load_model(&path).unwrap_err().to_string();
        assert!(err.contains("m.vmoe") && err.contains("checksum"), "{err}");
        let err = load_model(&dir.path().join("none.vmoe")).unwrap_err().to_string();
        assert!(err.contains("none.vmoe"), "{err}");
    }
}

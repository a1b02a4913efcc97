//! Memory-mapped initializers: a model whose large initializers are inline (`raw_data`) is
//! rewritten, streaming, into a small model file plus one external-data file
//! (`<dir>/model.onnx` + `<dir>/model.onnx.data`, each tensor at a page-aligned offset). ONNX
//! Runtime memory-maps external data on the CPU (private, read-only mapping of the file), so an
//! initializer that a kernel only reads in part (a word-embedding table read by `Gather`) stays
//! mostly on disk: only the rows the run touches become resident. Weights that a kernel prepacks
//! (MatMul B) are copied into ONNX Runtime's own memory and the mapping is dropped, as before.
//!
//! The rewrite never holds a tensor's bytes in memory: they are copied from the source file to the
//! data file through a small buffer; only the graph's other fields (nodes, small tensors) are
//! buffered to re-encode the lengths. Every length read from the file is checked against what is
//! left of its enclosing message before anything is allocated.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

/// Initializers whose `raw_data` is at least this many bytes go to the data file.
pub const MIN_EXTERNAL_BYTES: u64 = 64 << 10;
/// Alignment of each tensor in the data file (the page size ONNX Runtime maps by).
pub const DATA_ALIGN: u64 = 4096;
/// Name of the rewritten model inside its folder; the data file is this plus `.data`.
pub const MODEL_NAME: &str = "model.onnx";

/// Why a model could not be rewritten.
#[derive(Debug, thiserror::Error)]
pub enum MappedError {
    /// Reading the source or writing the rewrite failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The source is not a well-formed ONNX protobuf.
    #[error("{path}: not a well-formed ONNX model: {detail}")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What is wrong, and where.
        detail: String,
    },
}

/// What a rewrite did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Externalized {
    /// The rewritten model file.
    pub model: PathBuf,
    /// Initializers moved to the data file.
    pub tensors: usize,
    /// Bytes of tensor data moved (without alignment padding).
    pub bytes: u64,
}

/// Rewrites `src` into `dir` (created; its `model.onnx` and `model.onnx.data` are replaced).
pub fn externalize(src: &Path, dir: &Path) -> Result<Externalized, MappedError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| MappedError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let file = File::open(src).map_err(io(src))?;
    let len = file.metadata().map_err(io(src))?.len();
    let model_path = dir.join(MODEL_NAME);
    let data_name = format!("{MODEL_NAME}.data");
    let data_path = dir.join(&data_name);
    let mut w = Walker {
        r: BufReader::with_capacity(1 << 16, file),
        pos: 0,
        data: BufWriter::new(File::create(&data_path).map_err(io(&data_path))?),
        data_len: 0,
        data_name,
        tensors: 0,
        bytes: 0,
    };
    let mut model = Vec::new();
    w.model(len, &mut model).map_err(|e| match e {
        WalkError::Io(source) => MappedError::Io { path: src.to_path_buf(), source },
        WalkError::Bad(detail) => MappedError::Malformed { path: src.to_path_buf(), detail },
    })?;
    w.data.flush().map_err(io(&data_path))?;
    std::fs::write(&model_path, &model).map_err(io(&model_path))?;
    Ok(Externalized { model: model_path, tensors: w.tensors, bytes: w.bytes })
}

/// The rewrite of `src` in a folder beside it (`<src>.mapped/`), made once: reused while its
/// stamp (the source's length and modification time) matches, else made again. The folder is
/// written under a temporary name and renamed, so a reader never sees half a rewrite.
pub fn externalized_beside(src: &Path) -> Result<PathBuf, MappedError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| MappedError::Io { path, source }
    };
    let meta = std::fs::metadata(src).map_err(io(src))?;
    let mtime = meta.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
    let stamp = format!("{} {}", meta.len(), mtime.map_or(0, |d| d.as_nanos()));
    let mut name = src.file_name().map(std::ffi::OsStr::to_os_string).unwrap_or_default();
    name.push(".mapped");
    let dir = src.with_file_name(&name);
    if std::fs::read_to_string(dir.join("stamp")).is_ok_and(|s| s == stamp) {
        return Ok(dir.join(MODEL_NAME));
    }
    name.push(format!(".tmp-{}", std::process::id()));
    let tmp = src.with_file_name(name);
    let _ = std::fs::remove_dir_all(&tmp);
    externalize(src, &tmp)?;
    std::fs::write(tmp.join("stamp"), &stamp).map_err(io(&tmp))?;
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::rename(&tmp, &dir).map_err(io(&dir))?;
    Ok(dir.join(MODEL_NAME))
}

enum WalkError {
    Io(std::io::Error),
    Bad(String),
}

impl From<std::io::Error> for WalkError {
    fn from(e: std::io::Error) -> Self {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            WalkError::Bad("truncated".into())
        } else {
            WalkError::Io(e)
        }
    }
}

const WIRE_VARINT: u64 = 0;
const WIRE_FIXED64: u64 = 1;
const WIRE_LEN: u64 = 2;
const WIRE_FIXED32: u64 = 5;
/// ModelProto.graph, GraphProto.initializer, TensorProto.{raw_data, external_data, data_location}.
const MODEL_GRAPH: u64 = 7;
const GRAPH_INITIALIZER: u64 = 5;
const TENSOR_RAW_DATA: u64 = 9;
const TENSOR_EXTERNAL_DATA: u64 = 13;
const TENSOR_DATA_LOCATION: u64 = 14;
const LOCATION_EXTERNAL: u64 = 1;

struct Walker<R> {
    r: R,
    /// Bytes read from the source so far.
    pos: u64,
    data: BufWriter<File>,
    data_len: u64,
    data_name: String,
    tensors: usize,
    bytes: u64,
}

impl<R: Read> Walker<R> {
    fn byte(&mut self) -> Result<u8, WalkError> {
        let mut b = [0u8; 1];
        self.r.read_exact(&mut b)?;
        self.pos += 1;
        Ok(b[0])
    }

    fn varint(&mut self) -> Result<u64, WalkError> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.byte()?;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(WalkError::Bad(format!("varint longer than 10 bytes at byte {}", self.pos)))
    }

    /// Reads `n` bytes, `n` already checked against the enclosing message.
    fn bytes(&mut self, n: u64) -> Result<Vec<u8>, WalkError> {
        let mut v = Vec::new();
        let got = (&mut self.r).take(n).read_to_end(&mut v)? as u64;
        self.pos += got;
        if got != n {
            return Err(WalkError::Bad("truncated".into()));
        }
        Ok(v)
    }

    /// Reads one field's tag and, for length-delimited fields, its length (checked against `end`).
    fn field(&mut self, end: u64) -> Result<(u64, u64, u64), WalkError> {
        let tag = self.varint()?;
        let (number, wire) = (tag >> 3, tag & 7);
        let len = match wire {
            WIRE_VARINT => 0,
            WIRE_FIXED64 => 8,
            WIRE_FIXED32 => 4,
            WIRE_LEN => self.varint()?,
            other => return Err(WalkError::Bad(format!("wire type {other} at byte {}", self.pos))),
        };
        if wire != WIRE_VARINT && len > end.saturating_sub(self.pos) {
            return Err(WalkError::Bad(format!(
                "field {number} of {len} bytes at byte {} runs past its message",
                self.pos
            )));
        }
        Ok((number, wire, len))
    }

    /// Copies a field's payload (after its tag and length) to `out`, re-encoding the header.
    fn copy_field(&mut self, number: u64, wire: u64, len: u64, out: &mut Vec<u8>) -> Result<(), WalkError> {
        put_varint(out, (number << 3) | wire);
        if wire == WIRE_VARINT {
            put_varint(out, self.varint()?);
            return Ok(());
        }
        if wire == WIRE_LEN {
            put_varint(out, len);
        }
        out.extend(self.bytes(len)?);
        Ok(())
    }

    fn model(&mut self, end: u64, out: &mut Vec<u8>) -> Result<(), WalkError> {
        while self.pos < end {
            let (number, wire, len) = self.field(end)?;
            if number == MODEL_GRAPH && wire == WIRE_LEN {
                let mut graph = Vec::new();
                self.graph(self.pos + len, &mut graph)?;
                put_len_field(out, MODEL_GRAPH, &graph);
            } else {
                self.copy_field(number, wire, len, out)?;
            }
        }
        Ok(())
    }

    fn graph(&mut self, end: u64, out: &mut Vec<u8>) -> Result<(), WalkError> {
        while self.pos < end {
            let (number, wire, len) = self.field(end)?;
            if number == GRAPH_INITIALIZER && wire == WIRE_LEN && len >= MIN_EXTERNAL_BYTES {
                let mut tensor = Vec::new();
                self.tensor(self.pos + len, &mut tensor)?;
                put_len_field(out, GRAPH_INITIALIZER, &tensor);
            } else {
                self.copy_field(number, wire, len, out)?;
            }
        }
        if self.pos != end {
            return Err(WalkError::Bad(format!("graph ends at byte {}, not {end}", self.pos)));
        }
        Ok(())
    }

    fn tensor(&mut self, end: u64, out: &mut Vec<u8>) -> Result<(), WalkError> {
        let mut moved = None;
        while self.pos < end {
            let (number, wire, len) = self.field(end)?;
            if number == TENSOR_RAW_DATA && wire == WIRE_LEN && moved.is_none() {
                moved = Some(self.move_data(len)?);
            } else {
                self.copy_field(number, wire, len, out)?;
            }
        }
        if self.pos != end {
            return Err(WalkError::Bad(format!("tensor ends at byte {}, not {end}", self.pos)));
        }
        if let Some((offset, length)) = moved {
            for (key, value) in [
                ("location", self.data_name.clone()),
                ("offset", offset.to_string()),
                ("length", length.to_string()),
            ] {
                let mut entry = Vec::new();
                put_len_field(&mut entry, 1, key.as_bytes());
                put_len_field(&mut entry, 2, value.as_bytes());
                put_len_field(out, TENSOR_EXTERNAL_DATA, &entry);
            }
            put_varint(out, (TENSOR_DATA_LOCATION << 3) | WIRE_VARINT);
            put_varint(out, LOCATION_EXTERNAL);
        }
        Ok(())
    }

    /// Streams `len` bytes of raw data to the data file at the next aligned offset.
    fn move_data(&mut self, len: u64) -> Result<(u64, u64), WalkError> {
        let offset = self.data_len.div_ceil(DATA_ALIGN) * DATA_ALIGN;
        let pad = usize::try_from(offset - self.data_len).unwrap_or(0);
        self.data.write_all(&vec![0u8; pad]).map_err(WalkError::Io)?;
        let copied = std::io::copy(&mut (&mut self.r).take(len), &mut self.data)?;
        self.pos += copied;
        if copied != len {
            return Err(WalkError::Bad("truncated raw_data".into()));
        }
        self.data_len = offset + len;
        self.tensors += 1;
        self.bytes += len;
        Ok((offset, len))
    }
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_len_field(out: &mut Vec<u8>, number: u64, payload: &[u8]) {
    put_varint(out, (number << 3) | WIRE_LEN);
    put_varint(out, payload.len() as u64);
    out.extend_from_slice(payload);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::onnx::proto::ModelProto;
    use crate::onnx::writer::mlp_model;
    use crate::onnx::writer::tests::layer;
    use crate::onnx::{NamedTensor, OnnxSession, SessionConfig};
    use prost::Message;

    fn written_mlp() -> Vec<u8> {
        // 64 -> 512 -> 8: the first weight (128 KiB) goes external, the second (16 KiB) stays.
        mlp_model(&[layer(64, 512, 1), layer(512, 8, 2)], "x", "probs").unwrap()
    }

    #[test]
    fn a_rewritten_model_runs_with_the_same_outputs_and_its_large_tensors_external() {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("m.onnx");
        std::fs::write(&src, written_mlp()).unwrap();
        let done = externalize(&src, &d.path().join("out")).unwrap();
        assert_eq!(done.tensors, 1, "{done:?}");
        let m = ModelProto::decode(std::fs::read(&done.model).unwrap().as_slice()).unwrap();
        let g = m.graph.unwrap();
        let ext: Vec<_> = g.initializer.iter().filter(|t| t.data_location == Some(1)).collect();
        assert_eq!(ext.len(), 1);
        assert!(ext[0].raw_data.is_none());
        let x = NamedTensor::f32("x", vec![2, 64], (0..128).map(|i| (i as f32 * 0.37).sin()).collect());
        let cfg = SessionConfig::default();
        let a = OnnxSession::from_file(&src, &cfg).unwrap().run(std::slice::from_ref(&x)).unwrap();
        let b = OnnxSession::from_file(&done.model, &cfg).unwrap().run(std::slice::from_ref(&x)).unwrap();
        assert_eq!(a, b);
        let c = OnnxSession::from_file_mapped(&src, &cfg).unwrap().run(std::slice::from_ref(&x)).unwrap();
        assert_eq!(a, c);
    }

    #[test]
    fn truncated_or_garbage_sources_are_refused_by_name() {
        let d = tempfile::tempdir().unwrap();
        let bytes = written_mlp();
        let src = d.path().join("cut.onnx");
        std::fs::write(&src, &bytes[..bytes.len() / 2]).unwrap();
        let err = externalize(&src, &d.path().join("a")).unwrap_err();
        assert!(matches!(err, MappedError::Malformed { .. }), "{err}");
        std::fs::write(&src, [0x3f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]).unwrap();
        let err = externalize(&src, &d.path().join("b")).unwrap_err();
        assert!(err.to_string().contains("cut.onnx"), "{err}");
    }
}

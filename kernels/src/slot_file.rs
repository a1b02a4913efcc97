//! Fixed-size slots in one file, for a spill tier that rewrites its entries in place: slot `i`
//! lives at `i x stride` (the slot length rounded up to [`DIRECT_ALIGN`]), a write is one
//! positioned write (no fsync: nothing here must survive a crash), a read bypasses the page cache
//! ([`crate::direct_io`]) and is checked against the BLAKE3 of the slot's last write, kept in
//! memory. One file instead of a file per entry, because creating and deleting files by the
//! thousand costs kernel CPU (ext4 scans its recently deleted inodes on every create).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::direct_io::{DIRECT_ALIGN, read_range_streaming};
use crate::error::{KernelError, Result};

/// One slot file (see the module doc).
#[derive(Debug)]
pub struct SlotFile {
    path: PathBuf,
    file: File,
    slot_len: usize,
    stride: u64,
    /// Per slot: length and BLAKE3 of its last complete write (`None`: never written, or the
    /// last write failed).
    written: Vec<Option<(usize, blake3::Hash)>>,
}

impl SlotFile {
    /// Creates `path` (refused when it exists) for slots of at most `slot_len` bytes.
    pub fn create(path: &Path, slot_len: usize) -> Result<Self> {
        if slot_len == 0 {
            return Err(KernelError::invalid("slot file", "slots must hold at least one byte"));
        }
        let stride = slot_len
            .checked_next_multiple_of(DIRECT_ALIGN)
            .ok_or_else(|| KernelError::invalid("slot file", format!("slot length {slot_len} overflows")))?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(|e| KernelError::io("creating slot file", path, e))?;
        Ok(Self { path: path.to_path_buf(), file, slot_len, stride: stride as u64, written: Vec::new() })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes from one slot's start to the next.
    pub fn stride(&self) -> u64 {
        self.stride
    }

    /// Slots the file spans (the highest slot written, plus one).
    pub fn slots(&self) -> usize {
        self.written.len()
    }

    /// Writes `data` (at most the slot length) into `slot`, replacing what it held.
    pub fn write(&mut self, slot: u32, data: &[u8]) -> Result<()> {
        if data.len() > self.slot_len {
            return Err(KernelError::invalid(
                "slot file",
                format!(
                    "{} bytes do not fit a {}-byte slot of {}",
                    data.len(),
                    self.slot_len,
                    self.path.display()
                ),
            ));
        }
        let i = slot as usize;
        if self.written.len() <= i {
            self.written.resize(i + 1, None);
        }
        // Forget the old bytes first, so a write cut short is never read as valid.
        self.written[i] = None;
        self.file
            .write_all_at(data, u64::from(slot) * self.stride)
            .map_err(|e| KernelError::io("writing slot file", &self.path, e))?;
        self.written[i] = Some((data.len(), blake3::hash(data)));
        Ok(())
    }

    /// The bytes last written to `slot`, read with the page cache bypassed and checked.
    pub fn read(&self, slot: u32) -> Result<Vec<u8>> {
        let name = || format!("{}#{slot}", self.path.display());
        let Some((len, expected)) = self.written.get(slot as usize).copied().flatten() else {
            return Err(KernelError::UnknownBlob(name()));
        };
        let mut hasher = blake3::Hasher::new();
        let (bytes, _mode) =
            read_range_streaming(&self.path, u64::from(slot) * self.stride, len, &mut |p| {
                hasher.update(p);
            })?;
        let got = hasher.finalize();
        if bytes.len() != len || got != expected {
            return Err(KernelError::Corrupted {
                blob: name(),
                source_tier: "disk",
                expected: expected.to_hex().to_string(),
                actual: got.to_hex().to_string(),
            });
        }
        Ok(bytes.to_vec())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn slots_rewrite_in_place_and_a_changed_byte_is_caught() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("slots.bin");
        let mut f = SlotFile::create(&path, 5000).unwrap();
        assert!(SlotFile::create(&path, 5000).is_err(), "an existing file is refused");
        assert_eq!(f.stride(), 8192);
        let a: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8).collect();
        let b: Vec<u8> = (0..300u32).map(|i| (i % 13) as u8).collect();
        f.write(2, &a).unwrap();
        f.write(0, &b).unwrap();
        assert_eq!((f.read(2).unwrap(), f.read(0).unwrap()), (a.clone(), b.clone()));
        assert!(matches!(f.read(1), Err(KernelError::UnknownBlob(_))), "a slot never written");
        assert!(f.write(3, &vec![0; 5001]).is_err(), "longer than a slot");
        // Rewriting a slot keeps the file's size: no new space, no new file.
        f.write(2, &b).unwrap();
        assert_eq!(f.read(2).unwrap(), b);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 2 * 8192 + 5000);
        assert_eq!(f.slots(), 3);
        // A byte changed behind the file's back fails the check.
        let mut raw = std::fs::read(&path).unwrap();
        raw[2 * 8192] ^= 0xff;
        std::fs::write(&path, raw).unwrap();
        assert!(matches!(f.read(2), Err(KernelError::Corrupted { .. })));
        assert_eq!(f.read(0).unwrap(), b, "other slots are untouched");
    }
}

//! A checksummed append-only journal: what a scheduler has accepted and answered, on its own
//! node's disk, so that a restarted node resumes its jobs without losing or repeating work.
//!
//! Why a log and not an embedded database: a scheduler only appends ("accepted r", "answered r")
//! and replays everything once at start, so a log is the whole need; its torn-tail rules fit in
//! this file, and it adds no dependency to the build.
//!
//! Layout: an 8-byte magic, then records of `[u32 LE body length][first 8 bytes of the body's
//! BLAKE3][body]`. [`Journal::append`] returns only after `fdatasync`, so a caller acknowledges
//! work only once it is durable. At open, a damaged tail (a record cut short by a crash, or one
//! whose checksum fails with nothing valid after it) is reported by name, never replayed, and cut
//! off before the next append; damage with valid records after it is corruption and refused.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// First bytes of every journal file.
pub const MAGIC: &[u8; 8] = b"TRJRNL01";
/// Largest record body accepted (a length past it is damage, never an allocation).
pub const MAX_RECORD: usize = 1 << 20;
/// Largest journal file opened.
pub const MAX_JOURNAL: u64 = 1 << 30;
const HEADER: usize = 12;

/// Why a journal could not be used.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// The file could not be read or written.
    #[error("journal {path}: {source}")]
    Io {
        /// The journal file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// Not a journal, or a journal of another format.
    #[error("journal {path}: not a troupe journal (bad magic)")]
    BadMagic {
        /// The file.
        path: PathBuf,
    },
    /// Larger than any journal this node writes.
    #[error("journal {path}: {len} bytes exceeds the cap of {MAX_JOURNAL}")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        len: u64,
    },
    /// A damaged record with valid records after it: the file was altered, not torn by a crash.
    #[error("journal {path}: record at byte {offset} is corrupt ({detail}) and valid records follow it")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// Where the record starts.
        offset: u64,
        /// What is wrong.
        detail: String,
    },
    /// A record is larger than [`MAX_RECORD`] (refused when appending).
    #[error("journal {path}: a record of {len} bytes exceeds the cap of {MAX_RECORD}")]
    RecordTooLarge {
        /// The file.
        path: PathBuf,
        /// The record's size.
        len: usize,
    },
}

/// A damaged tail found at open: reported, not replayed, cut off before the next append.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TailDamage {
    /// Where the damaged record starts (the file is truncated here).
    pub offset: u64,
    /// What is wrong with it.
    pub detail: String,
}

impl std::fmt::Display for TailDamage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "damaged tail at byte {}: {}", self.offset, self.detail)
    }
}

/// What [`Journal::open`] read back.
#[derive(Debug, Default)]
pub struct Replay {
    /// The intact records, in append order.
    pub records: Vec<Vec<u8>>,
    /// The damaged tail, if there was one.
    pub damage: Option<TailDamage>,
}

/// An open journal, positioned for appending.
#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    file: File,
    records: u64,
}

fn checksum(body: &[u8]) -> [u8; 8] {
    let mut out = [0u8; 8];
    out.copy_from_slice(&blake3::hash(body).as_bytes()[..8]);
    out
}

/// Scans `bytes` (after the magic) into records, stopping at the first damaged one (its offset
/// and what is wrong).
fn scan(bytes: &[u8]) -> (Vec<Vec<u8>>, Option<(usize, String)>) {
    let mut records = Vec::new();
    let mut at = 0usize;
    while at < bytes.len() {
        let rest = &bytes[at..];
        if rest.len() < HEADER {
            return (
                records,
                Some((at, format!("record header cut short: {} of {HEADER} bytes", rest.len()))),
            );
        }
        let mut len_bytes = [0u8; 4];
        len_bytes.copy_from_slice(&rest[..4]);
        let len = u32::from_le_bytes(len_bytes) as usize;
        if len > MAX_RECORD {
            return (records, Some((at, format!("record length {len} exceeds the cap of {MAX_RECORD}"))));
        }
        let Some(body) = rest.get(HEADER..HEADER + len) else {
            let have = rest.len() - HEADER;
            return (records, Some((at, format!("record cut short: {have} of {len} body bytes"))));
        };
        if checksum(body) != rest[4..HEADER] {
            return (records, Some((at, "checksum mismatch".to_string())));
        }
        records.push(body.to_vec());
        at += HEADER + len;
    }
    (records, None)
}

/// Whether an intact record starts at the beginning of `bytes`.
fn first_record_intact(bytes: &[u8]) -> bool {
    let Some(len) = bytes.get(..4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize) else {
        return false;
    };
    len <= MAX_RECORD
        && bytes.get(HEADER..HEADER + len).is_some_and(|body| checksum(body) == bytes[4..HEADER])
}

impl Journal {
    /// Opens (or creates) the journal at `path` and reads back its intact records.
    pub fn open(path: &Path) -> Result<(Self, Replay), JournalError> {
        let io = |source| JournalError::Io { path: path.to_path_buf(), source };
        if let Some(dir) = path.parent()
            && !dir.as_os_str().is_empty()
        {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let mut file = OpenOptions::new().read(true).append(true).create(true).open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len > MAX_JOURNAL {
            return Err(JournalError::TooLarge { path: path.to_path_buf(), len });
        }
        let mut replay = Replay::default();
        if len == 0 {
            file.write_all(MAGIC).map_err(io)?;
            file.sync_data().map_err(io)?;
            return Ok((Self { path: path.to_path_buf(), file, records: 0 }, replay));
        }
        let mut bytes = Vec::with_capacity(len as usize);
        (&mut file).take(len).read_to_end(&mut bytes).map_err(io)?;
        if bytes.len() < MAGIC.len() || &bytes[..MAGIC.len()] != MAGIC {
            return Err(JournalError::BadMagic { path: path.to_path_buf() });
        }
        let body = &bytes[MAGIC.len()..];
        let (records, damage) = scan(body);
        if let Some((at, detail)) = damage {
            let offset = (MAGIC.len() + at) as u64;
            // Damage is a torn tail only if nothing valid follows it. One torn record leaves at
            // most one record's bytes behind it, so more than that is corruption outright.
            let rest = body.len() - at;
            let follows = rest > HEADER + MAX_RECORD
                || (at + 1..body.len()).any(|from| first_record_intact(&body[from..]));
            if follows {
                return Err(JournalError::Corrupt { path: path.to_path_buf(), offset, detail });
            }
            file.set_len(offset).map_err(io)?;
            file.sync_data().map_err(io)?;
            replay.damage = Some(TailDamage { offset, detail });
        }
        let n = records.len() as u64;
        replay.records = records;
        Ok((Self { path: path.to_path_buf(), file, records: n }, replay))
    }

    /// Appends `bodies` as records and returns once they are on disk (one `fdatasync`).
    pub fn append(&mut self, bodies: &[&[u8]]) -> Result<(), JournalError> {
        let mut buf = Vec::new();
        for body in bodies {
            if body.len() > MAX_RECORD {
                return Err(JournalError::RecordTooLarge { path: self.path.clone(), len: body.len() });
            }
            buf.extend_from_slice(&(body.len() as u32).to_le_bytes());
            buf.extend_from_slice(&checksum(body));
            buf.extend_from_slice(body);
        }
        let io = |source| JournalError::Io { path: self.path.clone(), source };
        self.file.write_all(&buf).map_err(io)?;
        self.file.sync_data().map_err(io)?;
        self.records += bodies.len() as u64;
        Ok(())
    }

    /// Records in the journal (replayed plus appended).
    pub fn len(&self) -> u64 {
        self.records
    }

    /// Whether the journal holds no record.
    pub fn is_empty(&self) -> bool {
        self.records == 0
    }

    /// The journal's file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_three(path: &Path) {
        let (mut j, replay) = Journal::open(path).unwrap();
        assert!(replay.records.is_empty() && replay.damage.is_none());
        j.append(&[b"one", b"two"]).unwrap();
        j.append(&[b"three"]).unwrap();
    }

    #[test]
    fn records_come_back_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        write_three(&path);
        let (j, replay) = Journal::open(&path).unwrap();
        assert_eq!(replay.records, vec![b"one".to_vec(), b"two".to_vec(), b"three".to_vec()]);
        assert!(replay.damage.is_none());
        assert_eq!(j.len(), 3);
    }

    #[test]
    fn a_torn_tail_is_named_not_replayed_and_cut_before_appending() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        write_three(&path);
        let full = std::fs::metadata(&path).unwrap().len();
        // cut the last record ("three": 12 + 5 bytes) in the middle of its body
        let f = OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(full - 2).unwrap();
        let (mut j, replay) = Journal::open(&path).unwrap();
        assert_eq!(replay.records, vec![b"one".to_vec(), b"two".to_vec()]);
        let damage = replay.damage.expect("the torn tail is reported");
        assert_eq!(damage.offset, full - 17);
        assert!(damage.to_string().contains("cut short: 3 of 5"), "{damage}");
        j.append(&[b"four"]).unwrap();
        let (_, replay) = Journal::open(&path).unwrap();
        assert_eq!(replay.records.last().unwrap(), b"four");
        assert!(replay.damage.is_none());
    }

    #[test]
    fn a_flipped_byte_in_the_last_record_is_tail_damage() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        write_three(&path);
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x01;
        std::fs::write(&path, &bytes).unwrap();
        let (_, replay) = Journal::open(&path).unwrap();
        assert_eq!(replay.records.len(), 2);
        assert!(replay.damage.unwrap().detail.contains("checksum mismatch"));
    }

    #[test]
    fn damage_with_valid_records_after_it_is_corruption() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        write_three(&path);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[MAGIC.len() + HEADER] ^= 0x01; // first record's body
        std::fs::write(&path, &bytes).unwrap();
        match Journal::open(&path) {
            Err(JournalError::Corrupt { offset, detail, .. }) => {
                assert_eq!(offset, MAGIC.len() as u64);
                assert!(detail.contains("checksum"));
            }
            other => panic!("expected corruption, got {other:?}"),
        }
    }

    #[test]
    fn a_foreign_file_and_a_huge_length_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        std::fs::write(&path, b"not a journal at all").unwrap();
        assert!(matches!(Journal::open(&path), Err(JournalError::BadMagic { .. })));
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&u32::MAX.to_le_bytes());
        bytes.extend_from_slice(&[0u8; 8]);
        std::fs::write(&path, &bytes).unwrap();
        let (_, replay) = Journal::open(&path).unwrap();
        assert!(replay.damage.unwrap().detail.contains("exceeds the cap"));
    }
}

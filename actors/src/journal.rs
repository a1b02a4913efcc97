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
//!
//! Compaction: [`Journal::compact`] rewrites the journal to the records its owner says are still
//! live, into `<name>.compacting` beside it (fsynced), renames that over the journal and fsyncs
//! the directory. A crash leaves the old journal or the new one, never a mix: a temp file found
//! at open is a rewrite that never got renamed, and is removed. When to compact is the owner's
//! call ([`troupe_policy::compaction::CompactionRule`] over [`Journal::bytes`] and
//! [`Journal::compacted_bytes`]); what is live, too.
//!
//! Logical records larger than [`MAX_RECORD`] (a coadapt upload with its images) are cut into
//! [`pieces`], appended together under one sync, and joined back by [`join_pieces`]; a crash in
//! the middle of such an append leaves a prefix of the pieces, which is named and left out (it
//! was never acknowledged), never replayed as data.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use rkyv::{Archive, Deserialize, Serialize};

/// First bytes of every journal file.
pub const MAGIC: &[u8; 8] = b"TRJRNL01";
/// Largest record body accepted (a length past it is damage, never an allocation).
pub const MAX_RECORD: usize = 1 << 20;
/// Largest journal file opened.
pub const MAX_JOURNAL: u64 = 1 << 30;
const HEADER: usize = 12;
/// Suffix of the temp file a compaction writes beside the journal.
pub const COMPACTING_SUFFIX: &str = ".compacting";

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
    /// A compaction's live records would make a journal past [`MAX_JOURNAL`] (nothing changed).
    #[error("journal {path}: compacting to {len} bytes of live records exceeds the cap of {MAX_JOURNAL}")]
    LiveTooLarge {
        /// The journal file.
        path: PathBuf,
        /// Bytes the live records would take.
        len: u64,
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
    /// The file's size.
    bytes: u64,
    /// Its size right after the last compaction (0 if none since open).
    compacted: u64,
    /// A compaction's rename is not known durable yet (its directory sync failed): synced before
    /// the next append, which fails if it cannot be, so nothing is acknowledged into a file a
    /// crash could take back.
    dir_unsynced: bool,
}

/// Where a compaction of the journal at `path` writes before renaming.
pub fn compacting_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(COMPACTING_SUFFIX);
    path.with_file_name(name)
}

/// Appends one record's header and body to `out`.
fn frame(out: &mut Vec<u8>, body: &[u8]) {
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&checksum(body));
    out.extend_from_slice(body);
}

/// Makes a rename in `dir` durable.
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// The directory holding `path` (`.` for a bare file name).
fn dir_of(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
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
        // A compaction that never got renamed: the journal itself is the old one, whole.
        let stale = compacting_path(path);
        match std::fs::remove_file(&stale) {
            Ok(()) => tracing::warn!(path = %stale.display(), "removed an unfinished journal compaction"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(JournalError::Io { path: stale, source }),
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
            let bytes = MAGIC.len() as u64;
            return Ok((
                Self { path: path.to_path_buf(), file, records: 0, bytes, compacted: 0, dir_unsynced: false },
                replay,
            ));
        }
        let mut bytes = Vec::with_capacity(len as usize);
        (&mut file).take(len).read_to_end(&mut bytes).map_err(io)?;
        if bytes.len() < MAGIC.len() || &bytes[..MAGIC.len()] != MAGIC {
            return Err(JournalError::BadMagic { path: path.to_path_buf() });
        }
        let body = &bytes[MAGIC.len()..];
        let mut size = len;
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
            size = offset;
            replay.damage = Some(TailDamage { offset, detail });
        }
        let n = records.len() as u64;
        replay.records = records;
        Ok((
            Self {
                path: path.to_path_buf(),
                file,
                records: n,
                bytes: size,
                compacted: 0,
                dir_unsynced: false,
            },
            replay,
        ))
    }

    /// Appends `bodies` as records and returns once they are on disk (one `fdatasync`).
    pub fn append(&mut self, bodies: &[&[u8]]) -> Result<(), JournalError> {
        let mut buf = Vec::new();
        for body in bodies {
            if body.len() > MAX_RECORD {
                return Err(JournalError::RecordTooLarge { path: self.path.clone(), len: body.len() });
            }
            frame(&mut buf, body);
        }
        let io = |source| JournalError::Io { path: self.path.clone(), source };
        if self.dir_unsynced {
            sync_dir(dir_of(&self.path)).map_err(io)?;
            self.dir_unsynced = false;
        }
        self.file.write_all(&buf).map_err(io)?;
        self.file.sync_data().map_err(io)?;
        self.records += bodies.len() as u64;
        self.bytes += buf.len() as u64;
        Ok(())
    }

    /// Rewrites the journal to hold exactly `live` (in order), atomically: written to
    /// [`compacting_path`] and synced, renamed over the journal, the directory synced. On an
    /// error before the rename nothing changed; after it (the directory sync failed), the journal
    /// is the new one and the next append syncs the directory first.
    pub fn compact<B: AsRef<[u8]>>(&mut self, live: impl IntoIterator<Item = B>) -> Result<(), JournalError> {
        let tmp = compacting_path(&self.path);
        let at_tmp = |source| JournalError::Io { path: tmp.clone(), source };
        match std::fs::remove_file(&tmp) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(at_tmp(e)),
            _ => {}
        }
        let file = OpenOptions::new().read(true).append(true).create_new(true).open(&tmp).map_err(at_tmp)?;
        let written = (|| {
            let mut out = BufWriter::new(&file);
            out.write_all(MAGIC).map_err(at_tmp)?;
            let (mut records, mut bytes) = (0u64, MAGIC.len() as u64);
            let mut buf = Vec::new();
            for body in live {
                let body = body.as_ref();
                if body.len() > MAX_RECORD {
                    return Err(JournalError::RecordTooLarge { path: self.path.clone(), len: body.len() });
                }
                bytes += (HEADER + body.len()) as u64;
                if bytes > MAX_JOURNAL {
                    return Err(JournalError::LiveTooLarge { path: self.path.clone(), len: bytes });
                }
                buf.clear();
                frame(&mut buf, body);
                out.write_all(&buf).map_err(at_tmp)?;
                records += 1;
            }
            out.flush().map_err(at_tmp)?;
            drop(out);
            file.sync_all().map_err(at_tmp)?;
            Ok((records, bytes))
        })();
        let (records, bytes) = match written {
            Ok(w) => w,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(e);
            }
        };
        let io = |source| JournalError::Io { path: self.path.clone(), source };
        if let Err(e) = std::fs::rename(&tmp, &self.path) {
            let _ = std::fs::remove_file(&tmp);
            return Err(io(e));
        }
        // The path names the new file now: append to it whatever the directory sync says.
        self.file = file;
        self.records = records;
        self.bytes = bytes;
        self.compacted = bytes;
        self.dir_unsynced = true;
        sync_dir(dir_of(&self.path)).map_err(io)?;
        self.dir_unsynced = false;
        Ok(())
    }

    /// The file's size in bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The file's size right after the last [`Journal::compact`] (0 if none since it was opened).
    pub fn compacted_bytes(&self) -> u64 {
        self.compacted
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

/// One piece of a logical record (see [`pieces`]).
#[derive(Archive, Serialize, Deserialize, Debug)]
struct Piece {
    /// Tells one logical record's pieces from the next one's.
    seq: u64,
    index: u32,
    count: u32,
    bytes: Vec<u8>,
}

/// Bytes of a logical record carried per piece; the piece's own fields fit in the rest of
/// [`MAX_RECORD`].
pub const PIECE_BYTES: usize = MAX_RECORD - 1024;

/// Cuts one logical record into journal records of at most [`MAX_RECORD`] bytes each, to be
/// appended together ([`Journal::append`]: one sync) or compacted together; `seq` tells
/// consecutive logical records apart.
pub fn pieces(seq: u64, body: &[u8]) -> Vec<Vec<u8>> {
    let chunks: Vec<&[u8]> = if body.is_empty() { vec![body] } else { body.chunks(PIECE_BYTES).collect() };
    let count = chunks.len() as u32;
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let piece = Piece { seq, index: i as u32, count, bytes: c.to_vec() };
            rkyv::to_bytes::<rkyv::rancor::Error>(&piece).map(|b| b.to_vec()).unwrap_or_default()
        })
        .collect()
}

/// What [`join_pieces`] read back.
#[derive(Debug, Default)]
pub struct Joined {
    /// The whole logical records, in append order.
    pub records: Vec<Vec<u8>>,
    /// Logical records cut short by a crash in their append (never acknowledged), each named.
    pub torn: Vec<String>,
}

/// Joins the records written by [`pieces`] back into logical records of at most `max_body`
/// bytes (checked before growing one). A logical record whose pieces stop early is named in
/// [`Joined::torn`] and left out; a piece that does not decode, or that follows no earlier piece
/// of its record, is corruption and an error naming the record.
pub fn join_pieces(records: &[Vec<u8>], max_body: usize) -> Result<Joined, String> {
    struct Open {
        seq: u64,
        count: u32,
        next: u32,
        body: Vec<u8>,
    }
    let torn = |o: &Open| format!("logical record {} has {} of its {} pieces", o.seq, o.next, o.count);
    let mut out = Joined::default();
    let mut open: Option<Open> = None;
    for (i, r) in records.iter().enumerate() {
        let p: Piece =
            crate::decode::decode("journal piece", r, MAX_RECORD, &mut crate::decode::plain_budget())
                .map_err(|e| format!("record {i}: {e}"))?;
        if p.index >= p.count || p.bytes.len() > PIECE_BYTES {
            return Err(format!("record {i}: piece {} of {} with {} bytes", p.index, p.count, p.bytes.len()));
        }
        if (p.count as usize - 1).saturating_mul(PIECE_BYTES) > max_body {
            return Err(format!(
                "record {i}: a logical record of {} pieces exceeds the cap of {max_body} bytes",
                p.count
            ));
        }
        if p.index == 0 {
            if let Some(o) = open.take() {
                out.torn.push(torn(&o));
            }
            open = Some(Open { seq: p.seq, count: p.count, next: 0, body: Vec::new() });
        }
        match open.as_mut() {
            Some(o) if o.seq == p.seq && o.count == p.count && o.next == p.index => {
                if o.body.len() + p.bytes.len() > max_body {
                    return Err(format!(
                        "record {i}: logical record {} exceeds the cap of {max_body} bytes",
                        p.seq
                    ));
                }
                o.body.extend_from_slice(&p.bytes);
                o.next += 1;
            }
            _ => {
                return Err(format!(
                    "record {i}: piece {} of logical record {} follows no earlier piece of it",
                    p.index, p.seq
                ));
            }
        }
        if let Some(o) = open.take_if(|o| o.next == o.count) {
            out.records.push(o.body);
        }
    }
    if let Some(o) = open {
        out.torn.push(torn(&o));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_records_go_in_pieces_and_a_cut_short_one_is_named_not_replayed() {
        let big: Vec<u8> = (0..(2 * PIECE_BYTES + 77)).map(|i| (i % 251) as u8).collect();
        let mut recs = pieces(0, b"small");
        recs.extend(pieces(1, &big));
        recs.extend(pieces(2, b""));
        assert_eq!(recs.len(), 5);
        assert!(recs.iter().all(|r| r.len() <= MAX_RECORD));
        let j = join_pieces(&recs, 4 * PIECE_BYTES).unwrap();
        assert_eq!(j.records, vec![b"small".to_vec(), big.clone(), Vec::new()]);
        assert!(j.torn.is_empty());
        // a crash after the first two of the big record's three pieces, then a later append
        let mut cut = pieces(0, b"small");
        cut.extend(pieces(1, &big).into_iter().take(2));
        cut.extend(pieces(3, b"after"));
        let j = join_pieces(&cut, 4 * PIECE_BYTES).unwrap();
        assert_eq!(j.records, vec![b"small".to_vec(), b"after".to_vec()]);
        assert_eq!(j.torn, vec!["logical record 1 has 2 of its 3 pieces".to_string()]);
        // ... and at the very end
        let j = join_pieces(&cut[..3], 4 * PIECE_BYTES).unwrap();
        assert_eq!(j.torn.len(), 1);
        // a piece out of its place is corruption; so is a record past the cap
        let mut bad = pieces(1, &big);
        bad.remove(1);
        let why = join_pieces(&bad, 4 * PIECE_BYTES).unwrap_err();
        assert!(why.contains("piece 2 of logical record 1 follows no earlier piece"), "{why}");
        let why = join_pieces(&pieces(1, &big), PIECE_BYTES).unwrap_err();
        assert!(why.contains("exceeds the cap"), "{why}");
        let why = join_pieces(&[b"not a piece".to_vec()], 1 << 20).unwrap_err();
        assert!(why.starts_with("record 0: "), "{why}");
    }

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

    #[test]
    fn compaction_keeps_only_the_live_records_and_appends_go_on_after_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        let (mut j, _) = Journal::open(&path).unwrap();
        for i in 0..100u32 {
            j.append(&[&i.to_le_bytes()]).unwrap();
        }
        let before = std::fs::metadata(&path).unwrap().len();
        assert_eq!(j.bytes(), before);
        assert_eq!(j.compacted_bytes(), 0);
        j.compact([b"seven".as_slice(), b"nine".as_slice()]).unwrap();
        let after = std::fs::metadata(&path).unwrap().len();
        assert_eq!(after, (MAGIC.len() + 2 * HEADER + 9) as u64);
        assert_eq!((j.bytes(), j.compacted_bytes(), j.len()), (after, after, 2));
        assert!(!compacting_path(&path).exists(), "the temp file was renamed");
        j.append(&[b"ten"]).unwrap();
        let (j, replay) = Journal::open(&path).unwrap();
        assert_eq!(replay.records, vec![b"seven".to_vec(), b"nine".to_vec(), b"ten".to_vec()]);
        assert!(replay.damage.is_none());
        assert_eq!(j.bytes(), std::fs::metadata(&path).unwrap().len());
    }

    #[test]
    fn a_stale_compaction_temp_file_is_removed_and_the_old_journal_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        write_three(&path);
        // a crash mid-compaction: a partial rewrite beside the intact old journal
        let tmp = compacting_path(&path);
        let mut partial = MAGIC.to_vec();
        frame(&mut partial, b"two");
        partial.extend_from_slice(&[1, 2, 3]);
        std::fs::write(&tmp, &partial).unwrap();
        let (mut j, replay) = Journal::open(&path).unwrap();
        assert_eq!(replay.records, vec![b"one".to_vec(), b"two".to_vec(), b"three".to_vec()]);
        assert!(replay.damage.is_none());
        assert!(!tmp.exists(), "open removes the unfinished compaction");
        // and a compaction after it starts from a clean temp file
        std::fs::write(&tmp, b"junk").unwrap();
        j.compact([b"three"]).unwrap();
        let (_, replay) = Journal::open(&path).unwrap();
        assert_eq!(replay.records, vec![b"three".to_vec()]);
    }

    #[test]
    fn a_torn_tail_after_a_compaction_is_still_detected() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        write_three(&path);
        let (mut j, _) = Journal::open(&path).unwrap();
        j.compact([b"two".as_slice(), b"three"]).unwrap();
        j.append(&[b"four!"]).unwrap();
        let full = j.bytes();
        drop(j);
        OpenOptions::new().write(true).open(&path).unwrap().set_len(full - 1).unwrap();
        let (_, replay) = Journal::open(&path).unwrap();
        assert_eq!(replay.records, vec![b"two".to_vec(), b"three".to_vec()]);
        let damage = replay.damage.expect("the torn tail is reported");
        assert_eq!(damage.offset, full - (HEADER as u64 + 5));
        assert!(damage.detail.contains("cut short: 4 of 5"), "{damage}");
    }

    #[test]
    fn a_refused_compaction_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        write_three(&path);
        let (mut j, _) = Journal::open(&path).unwrap();
        let big = vec![0u8; MAX_RECORD + 1];
        assert!(matches!(j.compact([big.as_slice()]), Err(JournalError::RecordTooLarge { .. })));
        assert!(!compacting_path(&path).exists());
        j.append(&[b"four"]).unwrap();
        let (_, replay) = Journal::open(&path).unwrap();
        assert_eq!(replay.records.len(), 4);
    }
}

//! The edge's journal: what it accepted (uploads, camera reports) and answered (each adapted
//! phase's reply), on the edge node's disk, so that an edge node killed and started again
//! resumes the adaptations it held, answers a camera's repeat of an answered phase with the
//! kept reply, and still knows every camera's progress. Records go through the runtime's
//! [`Journal`] in [`pieces`] (an upload may be larger than one journal record), and every upload
//! and report in a record is decoded and checked as if a peer had sent it.

use std::path::{Path, PathBuf};

use rkyv::{Archive, Deserialize, Serialize};
use troupe_policy::compaction::CompactionRule;

use super::wire::{DecodeBudget, MAX_WIRE_BYTES, encode};
use crate::journal::{Journal, join_pieces, pieces};

/// Largest logical record: an upload of the largest message accepted, plus its key.
const MAX_EDGE_RECORD: usize = MAX_WIRE_BYTES + 4096;

/// One fact of the edge's job.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub(crate) enum EdgeRecord {
    /// Upload `key` was accepted; `request` is its encoded `UploadRequest`.
    Accepted {
        /// The store's key.
        key: u64,
        /// The upload as the camera sent it.
        request: Vec<u8>,
    },
    /// Upload `key` was answered (adapted or refused).
    Answered {
        /// The store's key.
        key: u64,
    },
    /// A camera's phase was adapted; its reply is kept for a restarted camera's repeat.
    Kept {
        /// The camera.
        camera: String,
        /// The phase's adaptation index.
        adaptation: u32,
        /// The phase's drift frame.
        drift_frame: u64,
        /// The encoded reply.
        reply: Vec<u8>,
        /// The pool's peak use so far.
        peak_used: u64,
    },
    /// A camera's latest progress; `report` is its encoded `StreamReport`.
    Report {
        /// The report as the camera sent it.
        report: Vec<u8>,
    },
}

/// The edge's open journal.
pub(crate) struct EdgeJournal {
    journal: Journal,
    seq: u64,
    rule: CompactionRule,
}

/// What [`EdgeJournal::open`] read back.
pub(crate) struct Reopened {
    /// The journal, positioned for appending.
    pub journal: EdgeJournal,
    /// Its records, in append order.
    pub records: Vec<EdgeRecord>,
    /// A damaged tail or appends cut short by a crash: named, not replayed.
    pub damage: Vec<String>,
}

fn decode(bytes: &[u8]) -> Result<EdgeRecord, String> {
    let mut budget = DecodeBudget::new(crate::decode::DECODED_PER_WIRE_BYTE * MAX_EDGE_RECORD as u64);
    crate::decode::decode("coadapt journal record", bytes, MAX_EDGE_RECORD, &mut budget)
        .map_err(|e| e.to_string())
}

impl EdgeJournal {
    /// Opens (or creates) the journal at `path` and reads back its records.
    pub fn open(path: &Path) -> Result<Reopened, String> {
        let (journal, replay) = Journal::open(path).map_err(|e| e.to_string())?;
        let mut damage: Vec<String> = replay.damage.iter().map(ToString::to_string).collect();
        let joined = join_pieces(&replay.records, MAX_EDGE_RECORD)
            .map_err(|e| format!("journal {}: {e}", path.display()))?;
        damage.extend(joined.torn);
        let records = joined
            .records
            .iter()
            .map(|r| decode(r))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("journal {}: {e}", path.display()))?;
        let seq = records.len() as u64;
        Ok(Reopened {
            journal: EdgeJournal { journal, seq, rule: CompactionRule::default() },
            records,
            damage,
        })
    }

    /// Appends `records` and returns once they are on disk (one sync for all).
    pub fn append(&mut self, records: &[EdgeRecord]) -> Result<(), String> {
        let mut out = Vec::new();
        for r in records {
            out.extend(pieces(self.seq, &encode(r)));
            self.seq += 1;
        }
        let bodies: Vec<&[u8]> = out.iter().map(Vec::as_slice).collect();
        self.journal.append(&bodies).map_err(|e| e.to_string())
    }

    /// Whether the compaction rule says the journal is due for a rewrite.
    pub fn due(&self) -> bool {
        self.rule.due(self.journal.bytes(), self.journal.compacted_bytes())
    }

    /// Rewrites the journal to exactly `live`.
    pub fn compact(&mut self, live: &[EdgeRecord]) -> Result<(), String> {
        let mut out = Vec::new();
        for (seq, r) in live.iter().enumerate() {
            out.extend(pieces(seq as u64, &encode(r)));
        }
        self.seq = live.len() as u64;
        self.journal.compact(&out).map_err(|e| e.to_string())
    }

    /// The journal's file.
    pub fn path(&self) -> PathBuf {
        self.journal.path().to_path_buf()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_through_the_file_and_a_compaction() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("edge.journal");
        let big = EdgeRecord::Accepted { key: 3, request: vec![7; 3 << 20] };
        let kept = EdgeRecord::Kept {
            camera: "cam".into(),
            adaptation: 1,
            drift_frame: 9,
            reply: vec![1, 2, 3],
            peak_used: 5,
        };
        {
            let mut j = EdgeJournal::open(&path).unwrap().journal;
            j.append(std::slice::from_ref(&big)).unwrap();
            j.append(&[EdgeRecord::Answered { key: 3 }, kept.clone()]).unwrap();
        }
        let r = EdgeJournal::open(&path).unwrap();
        assert_eq!(r.records, vec![big, EdgeRecord::Answered { key: 3 }, kept.clone()]);
        assert!(r.damage.is_empty());
        let mut j = r.journal;
        j.compact(std::slice::from_ref(&kept)).unwrap();
        j.append(&[EdgeRecord::Report { report: vec![4] }]).unwrap();
        drop(j);
        let r = EdgeJournal::open(&path).unwrap();
        assert_eq!(r.records, vec![kept, EdgeRecord::Report { report: vec![4] }]);
    }
}

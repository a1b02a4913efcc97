//! The simulated disk's crash faults (simulation only): what a crash leaves on a node's journal.
//!
//! A journal ([`crate::journal`]) acknowledges an append only after `fdatasync`, and a
//! compaction renames its synced temp file over the journal, so what a crash can leave is the
//! append in progress, cut anywhere, or a compaction's temp file never renamed: [`tear_journal`]
//! writes exactly that ([`Tear`]), drawn per crash by
//! [`with_process_faults`](troupe_policy::sim::faults::with_process_faults). Everything
//! acknowledged stays: a model of a disk that loses unsynced writes needs no more than this.

use std::io::Write;
use std::path::{Path, PathBuf};

use troupe_policy::sim::faults::Tear;

use crate::journal::{COMPACTING_SUFFIX, MAGIC};

/// Bytes of a journal record's header: its body's length (u32 LE) and the first 8 bytes of the
/// body's BLAKE3.
const RECORD_HEADER: usize = 12;

/// Where simulated worlds keep their files: in memory (`/dev/shm`) when the machine has one
/// and `TMPDIR` is not set, as a journal's syncs on a real disk cost milliseconds each and most
/// of a seed's wall time; otherwise the temp folder.
pub fn sim_disk_root() -> PathBuf {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() && std::env::var_os("TMPDIR").is_none() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

/// A name part of this process's own (the same for every call in it): its pid and a random
/// word, so a recurring pid never meets a killed process's simulated world (and its journals).
pub fn process_tag() -> &'static str {
    static TAG: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TAG.get_or_init(|| {
        use std::hash::BuildHasher;
        let word = std::collections::hash_map::RandomState::new().hash_one(std::process::id());
        format!("{}-{:08x}", std::process::id(), word >> 32)
    })
}

/// Leaves `tear` on journal `journal`, as a crash in the middle of an append or a compaction
/// would; whether it wrote anything (a journal not written yet, or a clean crash, is left alone).
pub fn tear_journal(journal: &Path, tear: Tear) -> Result<bool, String> {
    if !journal.exists() {
        return Ok(false);
    }
    let body: Vec<u8> = (0..64u8).map(|b| b.wrapping_mul(37)).collect();
    let mut header = u32::try_from(body.len()).unwrap_or(u32::MAX).to_le_bytes().to_vec();
    header.extend(&blake3::hash(&body).as_bytes()[..RECORD_HEADER - 4]);
    let torn: Vec<u8> = match tear {
        Tear::Clean => return Ok(false),
        Tear::Header(n) => header[..usize::from(n).min(RECORD_HEADER - 1)].to_vec(),
        Tear::Body(per_mille) => {
            let cut = body.len() * usize::from(per_mille.min(999)) / 1000;
            [header.as_slice(), &body[..cut]].concat()
        }
        Tear::BadChecksum => {
            let mut bad = header.clone();
            bad[4] ^= 0xff;
            [bad.as_slice(), &body].concat()
        }
        Tear::Compacting => {
            let mut tmp = journal.as_os_str().to_owned();
            tmp.push(COMPACTING_SUFFIX);
            let tmp = PathBuf::from(tmp);
            let half = [MAGIC.as_slice(), &header, &body[..body.len() / 2]].concat();
            return std::fs::write(&tmp, half)
                .map(|()| true)
                .map_err(|e| format!("writing {}: {e}", tmp.display()));
        }
    };
    std::fs::OpenOptions::new()
        .append(true)
        .open(journal)
        .and_then(|mut f| f.write_all(&torn))
        .map(|()| true)
        .map_err(|e| format!("tearing {}: {e}", journal.display()))
}

/// [`tear_journal`] on every journal (`*.journal`) in `dir`, in name order; how many it tore.
pub fn tear_journals_in(dir: &Path, tear: Tear) -> Result<usize, String> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Ok(0) };
    let mut journals: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "journal"))
        .collect();
    journals.sort();
    journals.iter().try_fold(0, |n, j| Ok(n + usize::from(tear_journal(j, tear)?)))
}

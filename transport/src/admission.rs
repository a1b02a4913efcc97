//! Who may join: the checks a node applies to a peer's certificate after TLS verified it
//! (chain to the cluster CA, validity period) and before the peer counts as joined.
//!
//! - **Admin identities never join**: a hello with `member = true` from a certificate with the
//!   `admin` role is refused, whatever the configuration.
//! - **Revocation list**: a text file, one entry per line: a node name (revokes every
//!   certificate issued for that name) or `serial:HEX` (revokes one certificate; colons and a
//!   `0x` prefix are accepted). Blank lines and `#` comments are ignored. Reloaded on SIGHUP by
//!   `troupe node`, which then disconnects peers that are now revoked.
//! - **Allow-list** (`peers_only`): only the listed node names may join; non-member admin tools
//!   (`troupe status`) are still served.

use std::collections::BTreeSet;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::identity::{CertInfo, normalize_serial, validate_node_name};
use crate::roles::Role;

/// Largest revocation file read.
pub const MAX_REVOCATION_BYTES: u64 = 4 << 20;
/// Prefix of a serial-number entry in the revocation file.
pub const SERIAL_PREFIX: &str = "serial:";

/// Why a peer was refused admission; each message names the peer and the rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The node name is on the revocation list.
    #[error("certificate of {name} is revoked (the name {name} is on the revocation list)")]
    RevokedName {
        /// The peer.
        name: String,
    },
    /// The certificate's serial is on the revocation list.
    #[error("certificate of {name} is revoked (serial {serial} is on the revocation list)")]
    RevokedSerial {
        /// The peer.
        name: String,
        /// Its certificate's serial.
        serial: String,
    },
    /// `peers_only` is set and the peer is not listed.
    #[error("node {name} is not in this node's peers allow-list (peers_only)")]
    NotAllowed {
        /// The peer.
        name: String,
    },
    /// An admin identity asked to join as a member.
    #[error(
        "{name} holds an admin certificate: admin identities may query status but never join as a member"
    )]
    AdminMember {
        /// The peer.
        name: String,
    },
    /// A client identity asked to join as a member.
    #[error("{name} holds a client certificate: clients may send requests but never join as a member")]
    ClientMember {
        /// The peer.
        name: String,
    },
}

/// Why a revocation file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum RevocationError {
    /// Reading or writing failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file is larger than the cap.
    #[error("{path}: {len} bytes exceeds the {MAX_REVOCATION_BYTES}-byte cap")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        len: u64,
    },
    /// A line is neither a node name nor a serial entry.
    #[error("{path}:{line}: {entry:?} is neither a node name nor `serial:HEX`")]
    BadEntry {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The entry.
        entry: String,
    },
}

/// Revoked node names and certificate serials.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Revocations {
    names: BTreeSet<String>,
    serials: BTreeSet<String>,
}

/// Parses one entry: `Some(Ok(name))`, `Some(Err(serial))`, or `None` when it is neither.
fn parse_entry(entry: &str) -> Option<Result<String, String>> {
    if let Some(hex) = entry.strip_prefix(SERIAL_PREFIX) {
        let serial = normalize_serial(hex);
        let ok = !serial.is_empty() && serial.len() <= 42 && serial.bytes().all(|b| b.is_ascii_hexdigit());
        return ok.then_some(Err(serial));
    }
    validate_node_name(entry).ok().map(|_| Ok(entry.to_string()))
}

impl Revocations {
    /// Parses the file's text; `path` only names the file in errors.
    pub fn parse(path: &Path, text: &str) -> Result<Self, RevocationError> {
        let mut r = Self::default();
        for (i, line) in text.lines().enumerate() {
            let entry = line.split('#').next().unwrap_or("").trim();
            if entry.is_empty() {
                continue;
            }
            match parse_entry(entry) {
                Some(Ok(name)) => r.names.insert(name),
                Some(Err(serial)) => r.serials.insert(serial),
                None => {
                    return Err(RevocationError::BadEntry {
                        path: path.to_path_buf(),
                        line: i + 1,
                        entry: entry.to_string(),
                    });
                }
            };
        }
        Ok(r)
    }

    /// Reads and parses a revocation file (size-capped).
    pub fn load(path: &Path) -> Result<Self, RevocationError> {
        let io = |source| RevocationError::Io { path: path.to_path_buf(), source };
        let len = fs::metadata(path).map_err(io)?.len();
        if len > MAX_REVOCATION_BYTES {
            return Err(RevocationError::TooLarge { path: path.to_path_buf(), len });
        }
        let text = fs::read_to_string(path).map_err(io)?;
        Self::parse(path, &text)
    }

    /// Appends `entry` (a node name or `serial:HEX`) to the file, creating it if needed.
    pub fn append(path: &Path, entry: &str) -> Result<(), RevocationError> {
        let entry = entry.trim();
        if parse_entry(entry).is_none() {
            return Err(RevocationError::BadEntry {
                path: path.to_path_buf(),
                line: 0,
                entry: entry.to_string(),
            });
        }
        let io = |source| RevocationError::Io { path: path.to_path_buf(), source };
        let mut f = fs::OpenOptions::new().create(true).append(true).open(path).map_err(io)?;
        f.write_all(format!("{entry}\n").as_bytes()).map_err(io)
    }

    /// Whether nothing is revoked.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty() && self.serials.is_empty()
    }

    /// The refusal for peer `name` presenting `cert`, if it is revoked.
    pub fn check(&self, name: &str, cert: &CertInfo) -> Result<(), Refusal> {
        if self.names.contains(name) {
            return Err(Refusal::RevokedName { name: name.to_string() });
        }
        if self.serials.contains(&cert.serial) {
            return Err(Refusal::RevokedSerial { name: name.to_string(), serial: cert.serial.clone() });
        }
        Ok(())
    }
}

/// A node's admission rules.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Admission {
    /// Revoked names and serials.
    pub revoked: Revocations,
    /// With `Some`, only these node names may join (`peers_only`).
    pub allow: Option<BTreeSet<String>>,
}

impl Admission {
    /// Checks peer `name`, presenting `cert`, joining as a member or not.
    pub fn check(&self, name: &str, cert: &CertInfo, member: bool) -> Result<(), Refusal> {
        let admin = cert.roles.contains(Role::Admin);
        if member && admin {
            return Err(Refusal::AdminMember { name: name.to_string() });
        }
        if member && cert.roles.contains(Role::Client) {
            return Err(Refusal::ClientMember { name: name.to_string() });
        }
        self.revoked.check(name, cert)?;
        if let Some(allow) = &self.allow
            && !allow.contains(name)
            && (member || !admin)
        {
            return Err(Refusal::NotAllowed { name: name.to_string() });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::roles::RoleSet;

    fn cert(serial: &str, roles: RoleSet) -> CertInfo {
        CertInfo {
            names: vec![],
            roles,
            unknown_roles: vec![],
            serial: serial.into(),
            not_after: std::time::UNIX_EPOCH,
        }
    }

    #[test]
    fn revocation_file_names_serials_comments_and_errors() {
        let p = Path::new("revoked.txt");
        let r = Revocations::parse(p, "# revoked\nworker-3\n\nserial:0A:BC  # lost laptop\n").unwrap();
        let none = RoleSet::EMPTY;
        assert!(matches!(r.check("worker-3", &cert("01", none)), Err(Refusal::RevokedName { .. })));
        let e = r.check("worker-1", &cert("0abc", none)).unwrap_err();
        assert!(e.to_string().contains("serial 0abc"), "{e}");
        assert!(r.check("worker-1", &cert("0abd", none)).is_ok());
        let e = Revocations::parse(p, "ok-name\nNot A Name\n").unwrap_err().to_string();
        assert!(e.contains("revoked.txt:2") && e.contains("Not A Name"), "{e}");
        assert!(Revocations::parse(p, "serial:xyz").is_err());
    }

    #[test]
    fn admin_never_joins_and_allow_list_spares_admin_tools() {
        let admin = cert("01", RoleSet::only(Role::Admin));
        let exec = cert("02", RoleSet::only(Role::Executor));
        let open = Admission::default();
        assert!(matches!(open.check("admin", &admin, true), Err(Refusal::AdminMember { .. })));
        let client = cert("03", RoleSet::only(Role::Client));
        assert!(matches!(open.check("client", &client, true), Err(Refusal::ClientMember { .. })));
        assert!(open.check("client", &client, false).is_ok(), "a client may connect as a non-member");
        assert!(open.check("admin", &admin, false).is_ok());
        let listed = Admission { allow: Some(["a".to_string()].into()), ..Admission::default() };
        assert!(listed.check("a", &exec, true).is_ok());
        let e = listed.check("b", &exec, true).unwrap_err().to_string();
        assert!(e.contains("node b") && e.contains("allow-list"), "{e}");
        assert!(listed.check("admin", &admin, false).is_ok());
        assert!(listed.check("b", &exec, false).is_err(), "a non-admin tool is still refused");
    }

    #[test]
    fn append_writes_entries_that_load_back() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("revoked.txt");
        Revocations::append(&p, "node-9").unwrap();
        Revocations::append(&p, "serial:ff").unwrap();
        assert!(Revocations::append(&p, "no way").is_err());
        let r = Revocations::load(&p).unwrap();
        assert!(r.check("node-9", &cert("01", RoleSet::EMPTY)).is_err());
        assert!(r.check("x", &cert("ff", RoleSet::EMPTY)).is_err());
    }
}

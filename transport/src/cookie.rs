//! The cluster cookie: a random per-cluster secret that ractor_cluster sessions authenticate
//! with, on top of mutual TLS (a node of another cluster that somehow got a certificate of this
//! CA still needs it). `troupe keys init` writes it to the keys folder as `cookie`: 32 random
//! bytes in hex, mode 0600.

use std::fs;
use std::path::Path;

use crate::identity::{IdentityError, crypto_provider};

/// File name of the cookie in a keys folder.
pub const COOKIE_FILE: &str = "cookie";
/// Random bytes in a cookie.
pub const COOKIE_BYTES: usize = 32;

/// A new cookie: [`COOKIE_BYTES`] bytes from the TLS provider's secure random source, hex.
pub fn generate_cookie() -> Result<String, IdentityError> {
    let mut bytes = [0u8; COOKIE_BYTES];
    crypto_provider()
        .secure_random
        .fill(&mut bytes)
        .map_err(|_| IdentityError::Tls("the system random source failed".into()))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Writes a new cookie into `dir` unless one exists; returns the cookie in the folder.
pub fn ensure_cookie(dir: &Path) -> Result<String, IdentityError> {
    let path = dir.join(COOKIE_FILE);
    if path.exists() {
        return read_cookie(dir);
    }
    let cookie = generate_cookie()?;
    let io = |source| IdentityError::Io { path: path.clone(), source };
    fs::create_dir_all(dir).map_err(io)?;
    {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        // create_new + 0600 from the start: the secret is never readable by others
        let mut f =
            fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path).map_err(io)?;
        f.write_all(format!("{cookie}\n").as_bytes()).map_err(io)?;
    }
    Ok(cookie)
}

/// Reads the cookie in `dir`, checking it looks like one.
pub fn read_cookie(dir: &Path) -> Result<String, IdentityError> {
    let path = dir.join(COOKIE_FILE);
    let io = |source| IdentityError::Io { path: path.clone(), source };
    let len = fs::metadata(&path).map_err(io)?.len();
    if len > 1024 {
        return Err(IdentityError::BadPem {
            path,
            what: "cookie",
            detail: format!("{len} bytes is too large"),
        });
    }
    let text = fs::read_to_string(&path).map_err(io)?;
    let cookie = text.trim();
    if cookie.len() < 32 || !cookie.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(IdentityError::BadPem {
            path,
            what: "cookie",
            detail: "expected at least 32 hex digits (write one with `troupe keys init`)".into(),
        });
    }
    Ok(cookie.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cookies_are_random_private_and_reread() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let ca = ensure_cookie(a.path()).unwrap();
        let cb = ensure_cookie(b.path()).unwrap();
        assert_eq!(ca.len(), 2 * COOKIE_BYTES);
        assert_ne!(ca, cb);
        assert_eq!(ensure_cookie(a.path()).unwrap(), ca, "an existing cookie is kept");
        use std::os::unix::fs::PermissionsExt;
        let mode = fs::metadata(a.path().join(COOKIE_FILE)).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        fs::write(a.path().join(COOKIE_FILE), "troupe").unwrap();
        let e = read_cookie(a.path()).unwrap_err().to_string();
        assert!(e.contains("cookie") && e.contains("hex"), "{e}");
    }
}

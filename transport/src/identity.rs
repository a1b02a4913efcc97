//! Cluster identity: a cluster CA, node certificates signed by it, and the rustls configurations
//! that make every connection mutually authenticated against that CA (nothing is switched off).
//!
//! On disk (`troupe keys`): `ca.crt`, `ca.key`, and `NAME.crt` / `NAME.key` per node, PEM.
//!
//! A node certificate carries its node name as a DNS SAN (plus [`ANY_NODE`]) and its roles as
//! SAN URIs `troupe-role:ROLE` ([`crate::roles`]). Why SAN URIs and not a private X.509
//! extension: the SAN is signed by the CA like any other field, standard tools print it
//! (`openssl x509 -text`), x509-parser decodes it without a hand-written DER reader, and webpki
//! ignores URI names when it matches server names, so roles cannot change who a node is (the
//! same convention as SPIFFE IDs). Every certificate has a validity period; rustls' webpki
//! verifier refuses one outside it, on both ends of a connection.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::roles::{MAX_ROLES, ROLE_URI_PREFIX, Role, RoleSet, validate_role_name};

/// ALPN protocol id of troupe's QUIC connections.
pub const ALPN: &[u8] = b"troupe/1";
/// Largest PEM file read from disk (certificates and keys are a few KiB).
const MAX_PEM_BYTES: u64 = 64 << 10;

/// Why an identity could not be made, read or used.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// A node name that cannot be a DNS name in a certificate.
    #[error(
        "invalid node name {0:?}: use 1-63 characters of a-z, 0-9 and '-', not starting or ending with '-'"
    )]
    InvalidName(String),
    /// A key or certificate file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A file is larger than any certificate or key.
    #[error("{path}: {len} bytes is too large for a PEM certificate or key (cap {MAX_PEM_BYTES})")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        len: u64,
    },
    /// A file holds no usable PEM item of the expected kind.
    #[error("{path}: not a PEM {what}: {detail}")]
    BadPem {
        /// The file.
        path: PathBuf,
        /// Certificate or private key.
        what: &'static str,
        /// The parser's message.
        detail: String,
    },
    /// Certificate generation failed.
    #[error("certificate generation failed: {0}")]
    Rcgen(#[from] rcgen::Error),
    /// rustls refused the configuration.
    #[error("TLS configuration: {0}")]
    Tls(String),
    /// The keys directory already holds a CA (refusing to overwrite it).
    #[error("{0} already holds a cluster CA; refusing to overwrite it")]
    CaExists(PathBuf),
    /// A validity period that ends before it starts, or too far out to encode.
    #[error("invalid validity period: {0}")]
    BadValidity(String),
}

/// Default validity of a node certificate, in days.
pub const DEFAULT_NODE_DAYS: u32 = 365;
/// Default validity of the cluster CA, in days.
pub const DEFAULT_CA_DAYS: u32 = 3650;
/// Longest validity accepted, in days (100 years).
pub const MAX_DAYS: u32 = 36_500;
/// A fresh certificate is valid from this long before now (tolerates small clock skew).
const BACKDATE: Duration = Duration::from_secs(300);

/// When a certificate is valid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Validity {
    /// Valid from.
    pub not_before: SystemTime,
    /// Valid until.
    pub not_after: SystemTime,
}

impl Validity {
    /// From a few minutes ago until `days` days from now.
    pub fn days_from_now(days: u32) -> Result<Self, IdentityError> {
        if days == 0 || days > MAX_DAYS {
            return Err(IdentityError::BadValidity(format!("{days} days: use 1 to {MAX_DAYS}")));
        }
        let now = SystemTime::now();
        let not_before = now.checked_sub(BACKDATE).unwrap_or(now);
        let not_after = now + Duration::from_secs(u64::from(days) * 86_400);
        Ok(Self { not_before, not_after })
    }

    fn apply(&self, params: &mut CertificateParams) -> Result<(), IdentityError> {
        if self.not_after <= self.not_before {
            return Err(IdentityError::BadValidity("not_after is not after not_before".into()));
        }
        params.not_before = offset_date_time(self.not_before)?;
        params.not_after = offset_date_time(self.not_after)?;
        Ok(())
    }
}

fn offset_date_time(t: SystemTime) -> Result<time::OffsetDateTime, IdentityError> {
    let secs = match t.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_secs()).unwrap_or(i64::MAX),
    };
    time::OffsetDateTime::from_unix_timestamp(secs).map_err(|e| IdentityError::BadValidity(e.to_string()))
}

/// What a node certificate grants and for how long.
#[derive(Clone, Copy, Debug)]
pub struct IssueOptions {
    /// The roles written into the certificate.
    pub roles: RoleSet,
    /// The validity period.
    pub validity: Validity,
}

impl IssueOptions {
    /// `roles`, valid for [`DEFAULT_NODE_DAYS`] from now.
    pub fn new(roles: RoleSet) -> Result<Self, IdentityError> {
        Ok(Self { roles, validity: Validity::days_from_now(DEFAULT_NODE_DAYS)? })
    }
}

/// A name every node certificate also carries, so a client can dial an address without knowing
/// which node is there (it learns the name from the hello ack). No node may be called this.
pub const ANY_NODE: &str = "troupe-node";

/// Checks that `name` can be a node name (a DNS label, not [`ANY_NODE`]).
pub fn validate_node_name(name: &str) -> Result<(), IdentityError> {
    let ok = name != ANY_NODE
        && !name.is_empty()
        && name.len() <= 63
        && !name.starts_with('-')
        && !name.ends_with('-')
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if ok { Ok(()) } else { Err(IdentityError::InvalidName(name.to_string())) }
}

fn read_capped(path: &Path) -> Result<Vec<u8>, IdentityError> {
    let io = |source| IdentityError::Io { path: path.to_path_buf(), source };
    let len = fs::metadata(path).map_err(io)?.len();
    if len > MAX_PEM_BYTES {
        return Err(IdentityError::TooLarge { path: path.to_path_buf(), len });
    }
    fs::read(path).map_err(io)
}

fn write_file(path: &Path, contents: &str, private: bool) -> Result<(), IdentityError> {
    let io = |source| IdentityError::Io { path: path.to_path_buf(), source };
    fs::write(path, contents).map_err(io)?;
    if private {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(path, fs::Permissions::from_mode(0o600)).map_err(io)?;
    }
    Ok(())
}

fn read_cert(path: &Path) -> Result<CertificateDer<'static>, IdentityError> {
    CertificateDer::from_pem_slice(&read_capped(path)?).map_err(|e| IdentityError::BadPem {
        path: path.to_path_buf(),
        what: "certificate",
        detail: e.to_string(),
    })
}

fn read_key_pem(path: &Path) -> Result<String, IdentityError> {
    String::from_utf8(read_capped(path)?).map_err(|e| IdentityError::BadPem {
        path: path.to_path_buf(),
        what: "private key",
        detail: e.to_string(),
    })
}

/// The cluster certificate authority: it signs every node certificate.
pub struct ClusterCa {
    cert_pem: String,
    key_pem: String,
}

impl ClusterCa {
    /// Generates a new CA for the cluster called `cluster`, valid for [`DEFAULT_CA_DAYS`].
    pub fn generate(cluster: &str) -> Result<Self, IdentityError> {
        Self::generate_with(cluster, Validity::days_from_now(DEFAULT_CA_DAYS)?)
    }

    /// Generates a new CA valid for `validity`.
    pub fn generate_with(cluster: &str, validity: Validity) -> Result<Self, IdentityError> {
        let key = KeyPair::generate()?;
        let mut params = ca_params(cluster)?;
        validity.apply(&mut params)?;
        let cert = params.self_signed(&key)?;
        Ok(Self { cert_pem: cert.pem(), key_pem: key.serialize_pem() })
    }

    /// Writes `ca.crt` and `ca.key` (mode 0600) into `dir`, refusing to overwrite a CA.
    pub fn write(&self, dir: &Path) -> Result<(), IdentityError> {
        fs::create_dir_all(dir).map_err(|source| IdentityError::Io { path: dir.to_path_buf(), source })?;
        let crt = dir.join("ca.crt");
        if crt.exists() {
            return Err(IdentityError::CaExists(dir.to_path_buf()));
        }
        write_file(&dir.join("ca.key"), &self.key_pem, true)?;
        write_file(&crt, &self.cert_pem, false)
    }

    /// Loads `ca.crt` and `ca.key` from `dir`.
    pub fn load(dir: &Path) -> Result<Self, IdentityError> {
        let crt = dir.join("ca.crt");
        let cert_pem = String::from_utf8(read_capped(&crt)?).map_err(|e| IdentityError::BadPem {
            path: crt.clone(),
            what: "certificate",
            detail: e.to_string(),
        })?;
        let key_pem = read_key_pem(&dir.join("ca.key"))?;
        let ca = Self { cert_pem, key_pem };
        ca.issuer()?; // validate now, with the file names in the error
        Ok(ca)
    }

    fn issuer(&self) -> Result<Issuer<'static, KeyPair>, IdentityError> {
        let key = KeyPair::from_pem(&self.key_pem)?;
        Ok(Issuer::from_ca_cert_pem(&self.cert_pem, key)?)
    }

    /// The CA certificate in PEM.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// Issues a certificate for node `name` with no role, valid for [`DEFAULT_NODE_DAYS`].
    pub fn issue_node(&self, name: &str) -> Result<NodeIdentity, IdentityError> {
        self.issue(name, &IssueOptions::new(RoleSet::EMPTY)?)
    }

    /// Issues a certificate for node `name` (server and client auth, DNS SAN = name, one SAN URI
    /// per role) with the given roles and validity.
    pub fn issue(&self, name: &str, options: &IssueOptions) -> Result<NodeIdentity, IdentityError> {
        validate_node_name(name)?;
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(vec![name.to_string(), ANY_NODE.to_string()])?;
        for role in options.roles.iter() {
            let uri: rcgen::string::Ia5String = role.uri().try_into()?;
            params.subject_alt_names.push(SanType::URI(uri));
        }
        options.validity.apply(&mut params)?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages =
            vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params.signed_by(&key, &self.issuer()?)?;
        Ok(NodeIdentity {
            name: name.to_string(),
            cert: cert.der().clone(),
            key_der: key.serialize_der(),
            ca: CertificateDer::from_pem_slice(self.cert_pem.as_bytes())
                .map_err(|e| IdentityError::Tls(e.to_string()))?,
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

fn ca_params(cluster: &str) -> Result<CertificateParams, IdentityError> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.distinguished_name.push(DnType::CommonName, format!("troupe cluster CA {cluster}"));
    params.distinguished_name.push(DnType::OrganizationName, "troupe");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages =
        vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    Ok(params)
}

/// A node's certificate, key and the CA it trusts.
pub struct NodeIdentity {
    /// The node's name (its certificate's SAN).
    pub name: String,
    /// The node certificate (DER).
    pub cert: CertificateDer<'static>,
    key_der: Vec<u8>,
    /// The cluster CA certificate (DER): the only root this node trusts.
    pub ca: CertificateDer<'static>,
    cert_pem: String,
    key_pem: String,
}

impl NodeIdentity {
    /// Writes `NAME.crt` and `NAME.key` (0600) into `dir`.
    pub fn write(&self, dir: &Path) -> Result<(), IdentityError> {
        write_file(&dir.join(format!("{}.key", self.name)), &self.key_pem, true)?;
        write_file(&dir.join(format!("{}.crt", self.name)), &self.cert_pem, false)
    }

    /// Loads node `name`'s identity and the CA certificate from `dir`.
    pub fn load(dir: &Path, name: &str) -> Result<Self, IdentityError> {
        validate_node_name(name)?;
        let crt = dir.join(format!("{name}.crt"));
        let key_path = dir.join(format!("{name}.key"));
        let cert = read_cert(&crt)?;
        let key_pem = read_key_pem(&key_path)?;
        let key_der = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
            .map_err(|e| IdentityError::BadPem {
                path: key_path.clone(),
                what: "private key",
                detail: e.to_string(),
            })?
            .secret_der()
            .to_vec();
        let cert_pem = String::from_utf8_lossy(&read_capped(&crt)?).into_owned();
        Ok(Self {
            name: name.to_string(),
            cert,
            key_der,
            ca: read_cert(&dir.join("ca.crt"))?,
            cert_pem,
            key_pem,
        })
    }

    /// What this node's own certificate says (roles, serial, validity). Its role names are
    /// local input (a file this process was given), so custom ones are interned
    /// ([`Role::named`]), unlike those of a peer's certificate ([`CertInfo::parse`]).
    pub fn info(&self) -> Option<CertInfo> {
        CertInfo::parse_with(&self.cert, |name| Role::named(name).ok())
    }

    /// The roles in this node's certificate.
    pub fn roles(&self) -> RoleSet {
        self.info().map(|i| i.roles).unwrap_or_default()
    }

    fn key(&self) -> Result<PrivateKeyDer<'static>, IdentityError> {
        PrivateKeyDer::try_from(self.key_der.clone()).map_err(|e| IdentityError::Tls(e.to_string()))
    }

    fn roots(&self) -> Result<Arc<rustls::RootCertStore>, IdentityError> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.ca.clone()).map_err(|e| IdentityError::Tls(format!("cluster CA: {e}")))?;
        Ok(Arc::new(roots))
    }

    /// Server side: presents this node's certificate, requires a client certificate chaining to
    /// the cluster CA.
    pub fn server_config(
        &self,
        transport: Arc<quinn::TransportConfig>,
    ) -> Result<quinn::ServerConfig, IdentityError> {
        let provider = crypto_provider();
        let verifier =
            rustls::server::WebPkiClientVerifier::builder_with_provider(self.roots()?, provider.clone())
                .build()
                .map_err(|e| IdentityError::Tls(e.to_string()))?;
        let mut tls = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| IdentityError::Tls(e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(vec![self.cert.clone()], self.key()?)
            .map_err(|e| IdentityError::Tls(e.to_string()))?;
        tls.alpn_protocols = vec![ALPN.to_vec()];
        let quic = QuicServerConfig::try_from(tls).map_err(|e| IdentityError::Tls(e.to_string()))?;
        let mut cfg = quinn::ServerConfig::with_crypto(Arc::new(quic));
        cfg.transport_config(transport);
        Ok(cfg)
    }

    /// Client side: trusts only the cluster CA and presents this node's certificate.
    pub fn client_config(
        &self,
        transport: Arc<quinn::TransportConfig>,
    ) -> Result<quinn::ClientConfig, IdentityError> {
        let mut tls = rustls::ClientConfig::builder_with_provider(crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| IdentityError::Tls(e.to_string()))?
            .with_root_certificates(self.roots()?)
            .with_client_auth_cert(vec![self.cert.clone()], self.key()?)
            .map_err(|e| IdentityError::Tls(e.to_string()))?;
        tls.alpn_protocols = vec![ALPN.to_vec()];
        let quic = QuicClientConfig::try_from(tls).map_err(|e| IdentityError::Tls(e.to_string()))?;
        let mut cfg = quinn::ClientConfig::new(Arc::new(quic));
        cfg.transport_config(transport);
        Ok(cfg)
    }
}

/// The crypto provider every troupe TLS config uses (ring; never the process default, which
/// may be ambiguous when both ring and aws-lc-rs are linked). TLS 1.3's AES-128-GCM comes first:
/// it is the suite every QUIC stack must offer, and with 10 AES rounds instead of 14 it costs
/// less per byte than AES-256-GCM, which ring would otherwise pick; a peer that offers only the
/// others still gets them.
pub fn crypto_provider() -> Arc<rustls::crypto::CryptoProvider> {
    use rustls::crypto::ring::cipher_suite::{
        TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384, TLS13_CHACHA20_POLY1305_SHA256,
    };
    let mut provider = rustls::crypto::ring::default_provider();
    provider.cipher_suites =
        vec![TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384, TLS13_CHACHA20_POLY1305_SHA256];
    Arc::new(provider)
}

/// DNS names in the subject alternative names of a peer's end-entity certificate.
pub fn certificate_names(cert: &CertificateDer<'_>) -> Vec<String> {
    let Ok((_, x509)) = x509_parser::parse_x509_certificate(cert.as_ref()) else {
        return Vec::new();
    };
    let Ok(Some(san)) = x509.subject_alternative_name() else {
        return Vec::new();
    };
    san.value
        .general_names
        .iter()
        .filter_map(|n| match n {
            x509_parser::extensions::GeneralName::DNSName(s) => Some((*s).to_string()),
            _ => None,
        })
        .collect()
}

/// Names in the certificate a QUIC peer presented (empty if none).
pub fn peer_certificate_names(conn: &quinn::Connection) -> Vec<String> {
    peer_certificate(conn).map(|c| c.names).unwrap_or_default()
}

/// What a node certificate says about its holder.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertInfo {
    /// DNS names in the subject alternative names.
    pub names: Vec<String>,
    /// Roles from the `troupe-role:` SAN URIs that this process knew when the certificate was
    /// parsed (see [`CertInfo::parse`]; invalid names are ignored).
    pub roles: RoleSet,
    /// Valid role names in the certificate that this process did not know when it was parsed
    /// (at most [`MAX_ROLES`], never interned): [`CertInfo::current_roles`] looks them up
    /// again, so a rule that names a role after the peer connected still sees it.
    pub unknown_roles: Vec<String>,
    /// The serial number, lowercase hex without separators or leading zero bytes.
    pub serial: String,
    /// End of the validity period.
    pub not_after: SystemTime,
}

impl CertInfo {
    /// Parses a DER certificate, such as a peer's (`None` if it does not parse). Its role names
    /// are mapped to the roles this process already knows ([`Role::known`]); the others are
    /// never interned, only kept aside in [`CertInfo::unknown_roles`]: a role no local rule
    /// names can grant nothing, and a peer's certificate must not fill this process's role table.
    pub fn parse(cert: &CertificateDer<'_>) -> Option<Self> {
        Self::parse_with(cert, Role::known)
    }

    /// [`CertInfo::roles`] plus those of [`CertInfo::unknown_roles`] this process has come to
    /// know since (by a local rule or certificate naming them).
    pub fn current_roles(&self) -> RoleSet {
        self.unknown_roles.iter().filter_map(|n| Role::known(n)).fold(self.roles, RoleSet::with)
    }

    /// [`CertInfo::parse`], resolving each role name with `role`.
    fn parse_with(cert: &CertificateDer<'_>, role: impl Fn(&str) -> Option<Role>) -> Option<Self> {
        let (_, x509) = x509_parser::parse_x509_certificate(cert.as_ref()).ok()?;
        let mut names = Vec::new();
        let mut roles = RoleSet::EMPTY;
        let mut unknown_roles = Vec::new();
        if let Ok(Some(san)) = x509.subject_alternative_name() {
            for n in &san.value.general_names {
                match n {
                    x509_parser::extensions::GeneralName::DNSName(s) => names.push((*s).to_string()),
                    x509_parser::extensions::GeneralName::URI(u) => {
                        let Some(name) = u.strip_prefix(ROLE_URI_PREFIX) else { continue };
                        match role(name) {
                            Some(r) => roles = roles.with(r),
                            None if validate_role_name(name).is_ok()
                                && unknown_roles.len() < MAX_ROLES
                                && !unknown_roles.iter().any(|n| n == name) =>
                            {
                                unknown_roles.push(name.to_string())
                            }
                            None => {}
                        }
                    }
                    _ => {}
                }
            }
        }
        let ts = x509.validity().not_after.timestamp();
        let not_after = match u64::try_from(ts) {
            Ok(s) => UNIX_EPOCH + Duration::from_secs(s),
            Err(_) => UNIX_EPOCH,
        };
        Some(Self {
            names,
            roles,
            unknown_roles,
            serial: normalize_serial(&hex(x509.raw_serial())),
            not_after,
        })
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A serial number as written by people (`0A:1b:...`, `0x0a1b`) in [`CertInfo::serial`] form.
pub fn normalize_serial(s: &str) -> String {
    let s = s.trim();
    let s = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")).unwrap_or(s);
    let hex: String = s.chars().filter(|c| *c != ':').collect::<String>().to_ascii_lowercase();
    let trimmed = hex.trim_start_matches('0');
    // keep whole bytes: an odd number of digits gets its leading zero back
    if trimmed.len() % 2 == 1 { format!("0{trimmed}") } else { trimmed.to_string() }
}

/// The certificate a QUIC peer presented, parsed (`None` if it presented none).
pub fn peer_certificate(conn: &quinn::Connection) -> Option<CertInfo> {
    conn.peer_identity()
        .and_then(|id| id.downcast::<Vec<CertificateDer<'static>>>().ok())
        .and_then(|chain| chain.first().and_then(CertInfo::parse))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_dns_labels() {
        assert!(validate_node_name("expert-1").is_ok());
        for bad in ["", "-a", "a-", "Upper", "a.b", "a b", ANY_NODE, &"x".repeat(64)] {
            assert!(validate_node_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn ca_round_trip_and_issue() {
        let dir = tempfile::tempdir().unwrap();
        let ca = ClusterCa::generate("test").unwrap();
        ca.write(dir.path()).unwrap();
        assert!(matches!(ca.write(dir.path()), Err(IdentityError::CaExists(_))));
        let ca = ClusterCa::load(dir.path()).unwrap();
        let node = ca.issue_node("worker-1").unwrap();
        node.write(dir.path()).unwrap();
        let back = NodeIdentity::load(dir.path(), "worker-1").unwrap();
        assert_eq!(certificate_names(&back.cert), vec!["worker-1".to_string(), ANY_NODE.to_string()]);
        assert_eq!(back.ca, node.ca);
        assert_eq!(back.roles(), RoleSet::EMPTY);
        let e = NodeIdentity::load(dir.path(), "worker-2").err().unwrap();
        assert!(e.to_string().contains("worker-2.crt"), "{e}");
    }

    #[test]
    fn roles_serial_and_validity_round_trip() {
        let ca = ClusterCa::generate("test").unwrap();
        let roles = RoleSet::parse_list("scheduler,camera").unwrap();
        let opts = IssueOptions { roles, validity: Validity::days_from_now(30).unwrap() };
        let node = ca.issue("cam-1", &opts).unwrap();
        let info = node.info().unwrap();
        assert_eq!(info.roles, roles);
        assert_eq!(info.names, vec!["cam-1".to_string(), ANY_NODE.to_string()]);
        assert!(!info.serial.is_empty() && !info.serial.starts_with("00"), "{}", info.serial);
        let days = info.not_after.duration_since(SystemTime::now()).unwrap().as_secs() / 86_400;
        assert!((29..=30).contains(&days), "{days}");
        assert!(Validity::days_from_now(0).is_err());
        assert_eq!(normalize_serial("00:0A:bc"), "0abc");
        assert_eq!(normalize_serial("0x0abc"), "0abc");
    }

    #[test]
    fn custom_roles_round_trip_and_peers_cannot_add_names() {
        let ca = ClusterCa::generate("test").unwrap();
        let app = Role::named("identity-test-app").unwrap();
        let opts = IssueOptions::new(RoleSet::only(app).with(Role::Client)).unwrap();
        let node = ca.issue("app-1", &opts).unwrap();
        let info = CertInfo::parse(&node.cert).unwrap();
        assert_eq!(info.roles, RoleSet::only(app).with(Role::Client));
        assert_eq!(info.roles.to_string(), "client,identity-test-app");
        // a certificate whose roles this process never named: as a peer's, they are dropped
        // and not interned; as this node's own (local input), they are interned
        let dir = tempfile::tempdir().unwrap();
        ca.write(dir.path()).unwrap();
        let mut params = CertificateParams::new(vec!["stranger".to_string()]).unwrap();
        for name in ["identity-test-unseen", "Not A Role", "client"] {
            let uri: rcgen::string::Ia5String = format!("{ROLE_URI_PREFIX}{name}").try_into().unwrap();
            params.subject_alt_names.push(SanType::URI(uri));
        }
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &ca.issuer().unwrap()).unwrap();
        let peer = CertInfo::parse(cert.der()).unwrap();
        assert_eq!(peer.roles, RoleSet::only(Role::Client));
        assert_eq!(peer.unknown_roles, vec!["identity-test-unseen".to_string()]);
        assert_eq!(peer.current_roles(), RoleSet::only(Role::Client));
        assert_eq!(Role::known("identity-test-unseen"), None, "a peer's certificate interned a name");
        fs::write(dir.path().join("stranger.crt"), cert.pem()).unwrap();
        fs::write(dir.path().join("stranger.key"), key.serialize_pem()).unwrap();
        let own = NodeIdentity::load(dir.path(), "stranger").unwrap().roles();
        let unseen = Role::known("identity-test-unseen").expect("own certificate's role interned");
        assert_eq!(own, RoleSet::only(Role::Client).with(unseen));
        // once known here, the role counts for the peer parsed before
        assert_eq!(peer.current_roles(), RoleSet::only(Role::Client).with(unseen));
    }

    #[test]
    fn garbage_key_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        ClusterCa::generate("t").unwrap().write(dir.path()).unwrap();
        fs::write(dir.path().join("ca.key"), "not a key").unwrap();
        let e = ClusterCa::load(dir.path()).err().unwrap();
        assert!(!e.to_string().is_empty());
        fs::write(dir.path().join("ca.crt"), vec![b'x'; 100_000]).unwrap();
        let e = ClusterCa::load(dir.path()).err().unwrap();
        assert!(e.to_string().contains("too large"), "{e}");
    }
}

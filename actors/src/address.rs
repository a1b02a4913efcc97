//! A node's address as people write it: `IP:port` or `host:port` (a DNS name, `localhost`),
//! resolved when it is dialed, so a host that moves to another IP is found again on the next
//! redial.

use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;

/// Longest host name accepted (DNS's limit).
pub const MAX_HOST: usize = 253;

/// `IP:port` or `host:port`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum HostPort {
    /// A literal socket address (nothing to resolve).
    Ip(SocketAddr),
    /// A host name and a port, resolved at each dial.
    Name {
        /// The host name.
        host: String,
        /// The UDP port.
        port: u16,
    },
}

/// Why an address is not usable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddressError {
    /// Not `IP:port` or `host:port`.
    #[error("address {given:?} is not IP:port or host:port: {why}")]
    Syntax {
        /// What was given.
        given: String,
        /// What is wrong with it.
        why: String,
    },
    /// The host name did not resolve.
    #[error("host {host:?} did not resolve: {why}")]
    Unresolved {
        /// The host name.
        host: String,
        /// The resolver's answer.
        why: String,
    },
}

impl HostPort {
    /// The socket address now: a literal as it is, a name through the system resolver (the
    /// first address it gives, IPv4 before IPv6).
    pub async fn resolve(&self) -> Result<SocketAddr, AddressError> {
        match self {
            HostPort::Ip(a) => Ok(*a),
            HostPort::Name { host, port } => {
                let found = tokio::net::lookup_host((host.as_str(), *port))
                    .await
                    .map_err(|e| AddressError::Unresolved { host: host.clone(), why: e.to_string() })?;
                pick(host, found)
            }
        }
    }

    /// [`HostPort::resolve`] without a runtime (config loading, command-line flags).
    pub fn resolve_now(&self) -> Result<SocketAddr, AddressError> {
        match self {
            HostPort::Ip(a) => Ok(*a),
            HostPort::Name { host, port } => {
                let found = std::net::ToSocketAddrs::to_socket_addrs(&(host.as_str(), *port))
                    .map_err(|e| AddressError::Unresolved { host: host.clone(), why: e.to_string() })?;
                pick(host, found)
            }
        }
    }
}

fn pick(host: &str, found: impl Iterator<Item = SocketAddr>) -> Result<SocketAddr, AddressError> {
    let all: Vec<SocketAddr> = found.collect();
    all.iter()
        .find(|a| a.is_ipv4())
        .or(all.first())
        .copied()
        .ok_or_else(|| AddressError::Unresolved { host: host.to_string(), why: "no addresses".into() })
}

impl From<SocketAddr> for HostPort {
    fn from(a: SocketAddr) -> Self {
        HostPort::Ip(a)
    }
}

impl FromStr for HostPort {
    type Err = AddressError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Ok(a) = s.parse::<SocketAddr>() {
            return Ok(HostPort::Ip(a));
        }
        let bad = |why: &str| AddressError::Syntax { given: s.to_string(), why: why.to_string() };
        let (host, port) = s.rsplit_once(':').ok_or_else(|| bad("no :port"))?;
        let port: u16 = port.parse().map_err(|_| bad("the port is not a number from 0 to 65535"))?;
        if host.is_empty() || host.len() > MAX_HOST {
            return Err(bad(&format!("the host must be 1-{MAX_HOST} characters")));
        }
        let label_ok = |l: &str| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        };
        if !host.trim_end_matches('.').split('.').all(label_ok) {
            return Err(bad("a host name is dot-separated labels of letters, digits and '-'"));
        }
        Ok(HostPort::Name { host: host.to_string(), port })
    }
}

impl fmt::Display for HostPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HostPort::Ip(a) => write!(f, "{a}"),
            HostPort::Name { host, port } => write!(f, "{host}:{port}"),
        }
    }
}

impl serde::Serialize for HostPort {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for HostPort {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Deserializes a socket address given as `IP:port` or `host:port`, resolving a name once (for
/// an address a node binds at start, such as its `listen`).
pub fn deserialize_resolved<'de, D: serde::Deserializer<'de>>(d: D) -> Result<SocketAddr, D::Error> {
    let hp: HostPort = serde::Deserialize::deserialize(d)?;
    hp.resolve_now().map_err(serde::de::Error::custom)
}

/// Parses a command-line `IP:port` or `host:port` and resolves it (clap's `value_parser`).
pub fn parse_resolved(s: &str) -> Result<SocketAddr, AddressError> {
    s.parse::<HostPort>()?.resolve_now()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals_names_and_mistakes() {
        let ip: HostPort = "127.0.0.1:7000".parse().unwrap();
        assert_eq!(ip, HostPort::Ip("127.0.0.1:7000".parse().unwrap()));
        let v6: HostPort = "[::1]:7000".parse().unwrap();
        assert!(matches!(v6, HostPort::Ip(a) if a.is_ipv6()));
        let name: HostPort = "node-1.example.org:7101".parse().unwrap();
        assert_eq!(name, HostPort::Name { host: "node-1.example.org".into(), port: 7101 });
        assert_eq!(name.to_string(), "node-1.example.org:7101");
        for bad in ["localhost", "localhost:", ":7000", "localhost:70000", "bad host:1", "-a:1", "a..b:1"] {
            let e = bad.parse::<HostPort>().unwrap_err().to_string();
            assert!(e.contains(bad), "{bad}: {e}");
        }
    }

    #[test]
    fn localhost_resolves_and_a_missing_name_is_named() {
        let a = "localhost:7000".parse::<HostPort>().unwrap().resolve_now().unwrap();
        assert!(a.ip().is_loopback() && a.port() == 7000, "{a}");
        let e = "no-such-host.invalid:7000".parse::<HostPort>().unwrap().resolve_now().unwrap_err();
        assert!(e.to_string().contains("no-such-host.invalid"), "{e}");
    }

    #[tokio::test]
    async fn resolving_in_a_runtime_agrees() {
        let hp: HostPort = "localhost:7001".parse().unwrap();
        assert_eq!(hp.resolve().await.unwrap(), hp.resolve_now().unwrap());
    }
}

//! The application handshake that follows TLS: a node counts a peer as joined only after its
//! hello (name, protocol version) was checked against its certificate and acknowledged.

use rkyv::{Archive, Deserialize, Serialize};

use crate::frame::PROTOCOL_VERSION;

/// First frame on a new connection, sent by the dialing node.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The sender's node name; must appear in its certificate.
    pub node: String,
    /// The sender's protocol version.
    pub protocol: u32,
    /// False for a tool (e.g. `troupe status`) that talks to the node but is not a cluster member.
    pub member: bool,
    /// Random per endpoint, so per node process: a peer that comes back under its name with another one restarted.
    pub incarnation: u64,
}

/// The accepting node's answer.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct HelloAck {
    /// The acceptor's node name.
    pub node: String,
    /// The acceptor's protocol version.
    pub protocol: u32,
    /// Whether the peer was admitted.
    pub accepted: bool,
    /// Why not, when refused.
    pub reason: String,
    /// The acceptor's incarnation (see [`Hello::incarnation`]).
    pub incarnation: u64,
}

/// Checks a hello against the names in the sender's certificate; `Err` carries the reason.
pub fn check_hello(node: &str, protocol: u32, cert_names: &[String]) -> Result<(), String> {
    if protocol != u32::from(PROTOCOL_VERSION) {
        return Err(format!(
            "protocol version {protocol} is not supported (this node speaks {PROTOCOL_VERSION})"
        ));
    }
    if crate::identity::validate_node_name(node).is_err() {
        return Err(format!("invalid node name {node:?} in hello"));
    }
    if !cert_names.iter().any(|n| n == node) {
        return Err(format!("hello names node {node:?} but its certificate is for {cert_names:?}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_must_match_certificate_and_version() {
        let names = vec!["a".to_string()];
        assert!(check_hello("a", 1, &names).is_ok());
        assert!(check_hello("b", 1, &names).unwrap_err().contains("certificate is for"));
        assert!(check_hello("a", 2, &names).unwrap_err().contains("protocol version 2"));
        assert!(check_hello("A!", 1, &names).unwrap_err().contains("invalid node name"));
    }
}

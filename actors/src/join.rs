//! Joining through one seed: a node started with `--join HOST:PORT` dials the seed, asks it for
//! the members it is connected to ([`MEMBERS_SERVICE`]) and dials each of them, so that no node
//! has to list every peer. Every node serves the list; a joined node is in it for the next one.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tracing::{debug, info, warn};
use troupe_transport::{Link, NodeId, QuicNode};

use crate::address::HostPort;
use crate::service::{Allow, ServiceSpec, Services, to_body, with_archived};

/// The service every node serves: the members it is connected to, with their addresses.
pub const MEMBERS_SERVICE: &str = "troupe-members";
/// Its one method (any member may call it).
pub const LIST: &str = "list";
/// Most members one answer may name (an answer with more is refused as a whole).
pub const MAX_LISTED: usize = 4096;
/// How often a joined node asks the seed again (members that joined since are dialed then).
pub const REFRESH: Duration = Duration::from_secs(10);
/// How long one ask of the seed may take.
const ASK_TIMEOUT: Duration = Duration::from_secs(5);

/// One member as the list names it: `(name, address)`.
type Listed = (String, String);

/// Serves [`MEMBERS_SERVICE`] on `services`: this node's connected members and the addresses
/// their connections come from (a node's one UDP socket both listens and dials, so that is
/// where it listens).
pub fn serve_members(services: &Services, link: &QuicNode) {
    let link = link.clone();
    let handler: crate::service::Handler = Arc::new(move |_caller, _method, _body| {
        let listed: Vec<Listed> = link
            .peers()
            .into_iter()
            .filter_map(|p| link.peer_address(&p).map(|a| (p.to_string(), a.to_string())))
            .take(MAX_LISTED)
            .collect();
        let body = to_body(&listed);
        Box::pin(async move { body })
    });
    services.register(MEMBERS_SERVICE, ServiceSpec::new().method(LIST, Allow::AnyMember), handler);
}

/// Checks a members list from a peer: at most [`MAX_LISTED`], each name a node name and each
/// address a socket address.
fn parse_listed(body: &[u8]) -> Result<Vec<(NodeId, SocketAddr)>, String> {
    with_archived::<Vec<Listed>, _>(body, |a| {
        if a.len() > MAX_LISTED {
            return Err(format!("{} members listed, the cap is {MAX_LISTED}", a.len()));
        }
        a.iter()
            .map(|e| {
                let (name, addr) = (e.0.as_str(), e.1.as_str());
                if name.is_empty() || name.len() > troupe_transport::service::MAX_NAME {
                    return Err(format!("a member name of {} bytes", name.len()));
                }
                let addr: SocketAddr =
                    addr.parse().map_err(|_| format!("member {name:?} has address {addr:?}"))?;
                Ok((NodeId::new(name), addr))
            })
            .collect()
    })
}

/// Dials the seed until it answers, then every member it lists (and the seed itself, by name),
/// each kept redialed by `dial`'s future as configured peers are; asks again every [`REFRESH`].
pub async fn join_loop<F>(
    link: QuicNode,
    services: Services,
    seed: HostPort,
    redial: Duration,
    dial: impl Fn(NodeId, HostPort) -> F + Send + 'static,
) where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let me = link.local_id().clone();
    // the dialers live as long as this loop: aborting it (node shutdown) stops them too
    let mut dialers = tokio::task::JoinSet::new();
    let mut dialed: HashSet<NodeId> = HashSet::new();
    let mut known_seed: Option<(NodeId, SocketAddr)> = None;
    loop {
        match ask_seed(&link, &services, &seed, known_seed.as_ref()).await {
            Ok((seed_name, seed_addr, members)) => {
                known_seed = Some((seed_name.clone(), seed_addr));
                let new: Vec<(NodeId, SocketAddr)> = std::iter::once((seed_name, seed_addr))
                    .chain(members)
                    .filter(|(n, _)| *n != me && !dialed.contains(n))
                    // a seed cannot grow the dialers past one list's cap by naming new members
                    // at every refresh
                    .take(MAX_LISTED.saturating_sub(dialed.len()))
                    .collect();
                if !new.is_empty() {
                    info!(%seed, members = ?new.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), "joined through the seed: dialing its members");
                }
                for (name, addr) in new {
                    dialed.insert(name.clone());
                    dialers.spawn(dial(name, addr.into()));
                }
                tokio::time::sleep(REFRESH).await;
            }
            Err(e) => {
                debug!(%seed, error = %e, "the seed did not answer; will retry");
                tokio::time::sleep(redial).await;
            }
        }
    }
}

/// The seed's name and address, and the members it lists (connecting first unless the seed
/// found before is still connected).
async fn ask_seed(
    link: &QuicNode,
    services: &Services,
    seed: &HostPort,
    known: Option<&(NodeId, SocketAddr)>,
) -> Result<(NodeId, SocketAddr, Vec<(NodeId, SocketAddr)>), String> {
    let (name, addr) = match known {
        Some((name, addr)) if link.peers().contains(name) => (name.clone(), *addr),
        _ => {
            let addr = seed.resolve().await.map_err(|e| e.to_string())?;
            (link.connect_any(addr).await.map_err(|e| e.to_string())?, addr)
        }
    };
    let body = services
        .call(&name, MEMBERS_SERVICE, LIST, Vec::new(), ASK_TIMEOUT)
        .await
        .map_err(|e| e.to_string())?;
    let members =
        parse_listed(&body).inspect_err(|e| warn!(%seed, error = %e, "the seed's members list refused"))?;
    Ok((name, addr, members))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_members_list_is_checked() {
        let good: Vec<Listed> = vec![("a".into(), "127.0.0.1:7000".into())];
        let parsed = parse_listed(&to_body(&good).unwrap()).unwrap();
        assert_eq!(parsed, vec![(NodeId::new("a"), "127.0.0.1:7000".parse().unwrap())]);
        let bad_addr: Vec<Listed> = vec![("a".into(), "nowhere".into())];
        assert!(parse_listed(&to_body(&bad_addr).unwrap()).unwrap_err().contains("nowhere"));
        let too_many: Vec<Listed> =
            (0..=MAX_LISTED).map(|i| (format!("n{i}"), "127.0.0.1:1".into())).collect();
        assert!(parse_listed(&to_body(&too_many).unwrap()).unwrap_err().contains("cap"));
        assert!(parse_listed(b"not an archive").is_err());
    }
}

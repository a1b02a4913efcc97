//! `troupe up --netns`: every node of a topology in its own network namespace, on its own
//! address, so that nodes reach each other the way separate hosts do.
//!
//! Layout, for topology `T` with nodes `0..n`: one bridge `trpbrH` in the root namespace with
//! `10.213.H.1/24`, where `H` (1..=250) is a hash of `T` (so that two topologies run side by side
//! get different subnets and bridge names); namespace `troupe-T-NODE` per node, joined to the
//! bridge by a veth pair (`trpHhI` on the bridge, `trpHnI` inside) and holding `10.213.H.(I+2)`.
//! The root namespace reaches every node through the bridge's address (`troupe status` needs no
//! namespace of its own). Nodes listen on [`NODE_PORT`] (each namespace has its own ports).
//! Nodes are addressed by host name, as on real hosts: each namespace gets an `/etc/hosts` of its
//! own (`/etc/netns/NS/hosts`, which `ip netns exec` mounts over `/etc/hosts`) naming every node
//! `NODE.troupe` ([`NsHost::hostname`]), and every node but the first joins through the first
//! (`join = "FIRST.troupe:7400"`) instead of listing its peers.
//!
//! [`Namespaces::create`] refuses to start when a namespace or the bridge of the topology exists
//! already (another run, or a killed one: [`clean`] removes them); the returned guard removes
//! everything it made when dropped (after `up` stopped the nodes, on job end, error or ctrl-c).
//! Making namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2's `ip`; without
//! them the error says which is missing.

use std::net::{Ipv4Addr, SocketAddr};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// UDP port every node listens on inside its namespace.
pub const NODE_PORT: u16 = 7400;
/// Most nodes in one namespaced topology (host addresses .2 to .251 of the /24).
pub const MAX_NODES: usize = 250;
/// Second octet of every namespaced subnet (`10.213.H.0/24`).
const SUBNET_OCTET: u8 = 213;
/// Longest namespace name made (`troupe-T-NODE`; the name is a file under /run/netns).
const MAX_NS_NAME: usize = 200;

/// One node's place: its namespace, the veth pair's two ends and its address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NsHost {
    /// The node's name.
    pub node: String,
    /// Namespace name (`troupe-T-NODE`).
    pub ns: String,
    /// The veth end on the bridge, in the root namespace.
    pub host_if: String,
    /// The veth end inside the namespace.
    pub ns_if: String,
    /// The node's address (inside its namespace, reachable from the root one).
    pub addr: Ipv4Addr,
    /// Its host name in every namespace's `/etc/hosts` (`NODE.troupe`, `_` written `-`).
    pub hostname: String,
}

impl NsHost {
    /// The node's listen address.
    pub fn listen(&self) -> SocketAddr {
        SocketAddr::from((self.addr, NODE_PORT))
    }
}

/// The namespaces, bridge and addresses of one topology (a pure plan; nothing made yet).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetnsPlan {
    /// Prefix of every namespace name of the topology (`troupe-T-`).
    pub prefix: String,
    /// The bridge in the root namespace.
    pub bridge: String,
    /// The bridge's address (the root namespace's side of the subnet).
    pub bridge_addr: Ipv4Addr,
    /// One per node, in topology order.
    pub hosts: Vec<NsHost>,
}

/// FNV-1a: a stable hash of the topology name, for its subnet and interface names.
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// The topology's subnet index `H` (1..=250).
fn subnet_index(topology: &str) -> u8 {
    // 1..=250 fits in a u8
    u8::try_from(fnv1a(topology) % 250 + 1).unwrap_or(1)
}

/// Plans the namespaces of `topology` with `nodes`, refusing names `ip` cannot carry.
pub fn plan(topology: &str, nodes: &[&str]) -> Result<NetnsPlan> {
    let ok_chars =
        |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
    if !ok_chars(topology) || topology.starts_with('.') {
        bail!(
            "--netns: topology name {topology:?}: use letters, digits, '-', '_' or '.' only (it names namespaces)"
        );
    }
    if nodes.len() > MAX_NODES {
        bail!("--netns: {} nodes; at most {MAX_NODES} fit one namespaced subnet", nodes.len());
    }
    let h = subnet_index(topology);
    let prefix = format!("troupe-{topology}-");
    let mut hosts = Vec::with_capacity(nodes.len());
    for (i, node) in nodes.iter().enumerate() {
        let ns = format!("{prefix}{node}");
        if !ok_chars(node) || ns.len() > MAX_NS_NAME {
            bail!(
                "--netns: node {node:?}: namespace name {ns:?} is not a valid name of at most {MAX_NS_NAME} bytes"
            );
        }
        // i < 250, so i + 2 <= 251
        let last = u8::try_from(i + 2).unwrap_or(u8::MAX);
        hosts.push(NsHost {
            node: (*node).to_owned(),
            ns,
            host_if: format!("trp{h}h{i}"),
            ns_if: format!("trp{h}n{i}"),
            addr: Ipv4Addr::new(10, SUBNET_OCTET, h, last),
            hostname: format!("{}.troupe", node.replace('_', "-")),
        });
    }
    Ok(NetnsPlan {
        prefix,
        bridge: format!("trpbr{h}"),
        bridge_addr: Ipv4Addr::new(10, SUBNET_OCTET, h, 1),
        hosts,
    })
}

/// Runs `ip ARGS`, returning its stdout; the error carries `ip`'s message.
fn ip(args: &[&str]) -> Result<String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .with_context(|| format!("--netns needs iproute2's `ip` (running `ip {}`)", args.join(" ")))?;
    if !out.status.success() {
        bail!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Checks that namespaces can be made here: root, and `ip` present.
pub fn preflight() -> Result<()> {
    // SAFETY: geteuid has no preconditions and touches no memory.
    let euid = unsafe { libc::geteuid() };
    if euid != 0 {
        bail!(
            "--netns: network namespaces are not permitted: making them needs root (CAP_NET_ADMIN, \
             CAP_SYS_ADMIN), and this process runs as uid {euid}"
        );
    }
    ip(&["-V"]).context("--netns needs iproute2's `ip`")?;
    Ok(())
}

/// Names of the existing namespaces that start with `prefix`.
fn existing(prefix: &str) -> Result<Vec<String>> {
    let list = ip(&["netns", "list"])?;
    Ok(list
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(prefix))
        .map(str::to_owned)
        .collect())
}

/// True when the link `name` exists in the root namespace.
fn link_exists(name: &str) -> bool {
    Command::new("ip").args(["link", "show", name]).output().is_ok_and(|o| o.status.success())
}

/// Removes the namespaces (their veth pairs go with them) and the bridge of the topology
/// planned as `plan`, whoever made them; node processes a killed run left inside them are
/// killed first (a namespace outlives its name while a process is in it). Returns what was
/// removed.
pub fn clean(plan: &NetnsPlan) -> Result<Vec<String>> {
    let mut removed = Vec::new();
    for ns in existing(&plan.prefix)? {
        for pid in ip(&["netns", "pids", &ns])?.split_whitespace().filter_map(|p| p.parse::<i32>().ok()) {
            // SAFETY: sending a signal touches no memory; the pid is a process inside the
            // topology's own namespace (a node of the killed run).
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
            removed.push(format!("process {pid} in {ns}"));
        }
        ip(&["netns", "del", &ns])?;
        removed.push(format!("namespace {ns}"));
    }
    for h in &plan.hosts {
        let dir = hosts_dir(&h.ns);
        if dir.exists() {
            std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
            removed.push(format!("hosts file {}", dir.display()));
        }
    }
    if link_exists(&plan.bridge) {
        ip(&["link", "del", &plan.bridge])?;
        removed.push(format!("bridge {}", plan.bridge));
    }
    Ok(removed)
}

/// The namespaces and bridge of a running topology; dropping it removes them.
#[derive(Debug)]
pub struct Namespaces {
    /// What was planned (and made).
    pub plan: NetnsPlan,
    made_bridge: bool,
    made: Vec<String>,
    hosts_dirs: Vec<std::path::PathBuf>,
}

/// Where `ip netns exec NS` finds the files it mounts over `/etc` (`hosts` among them).
fn hosts_dir(ns: &str) -> std::path::PathBuf {
    std::path::Path::new("/etc/netns").join(ns)
}

impl Namespaces {
    /// Makes the bridge and every node's namespace, veth pair and address. Refuses when any of
    /// them exists already; whatever was made is removed again when a step fails.
    pub fn create(plan: NetnsPlan) -> Result<Self> {
        preflight()?;
        let stale = existing(&plan.prefix)?;
        if !stale.is_empty() || link_exists(&plan.bridge) {
            let mut what = stale;
            if link_exists(&plan.bridge) {
                what.push(format!("bridge {}", plan.bridge));
            }
            bail!(
                "--netns: {} exist already (another `troupe up --netns` of this topology is running, or one \
                 was killed); remove them with `troupe up --netns-clean TOPOLOGY`",
                what.join(", ")
            );
        }
        let mut made = Self { plan, made_bridge: false, made: Vec::new(), hosts_dirs: Vec::new() };
        made.build()?;
        Ok(made)
    }

    fn build(&mut self) -> Result<()> {
        let p = self.plan.clone();
        let bridge_cidr = format!("{}/24", p.bridge_addr);
        ip(&["link", "add", &p.bridge, "type", "bridge"])?;
        self.made_bridge = true;
        ip(&["addr", "add", &bridge_cidr, "dev", &p.bridge])?;
        ip(&["link", "set", &p.bridge, "up"])?;
        for h in &p.hosts {
            ip(&["netns", "add", &h.ns])?;
            self.made.push(h.ns.clone());
            ip(&["link", "add", &h.host_if, "type", "veth", "peer", "name", &h.ns_if])?;
            ip(&["link", "set", &h.ns_if, "netns", &h.ns])?;
            ip(&["link", "set", &h.host_if, "master", &p.bridge])?;
            ip(&["link", "set", &h.host_if, "up"])?;
            let cidr = format!("{}/24", h.addr);
            ip(&["-n", &h.ns, "addr", "add", &cidr, "dev", &h.ns_if])?;
            ip(&["-n", &h.ns, "link", "set", &h.ns_if, "up"])?;
            ip(&["-n", &h.ns, "link", "set", "lo", "up"])?;
        }
        let mut hosts = String::from("127.0.0.1 localhost\n");
        for h in &p.hosts {
            hosts.push_str(&format!("{} {}\n", h.addr, h.hostname));
        }
        for h in &p.hosts {
            let dir = hosts_dir(&h.ns);
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            self.hosts_dirs.push(dir.clone());
            std::fs::write(dir.join("hosts"), &hosts)
                .with_context(|| format!("writing {}/hosts", dir.display()))?;
        }
        Ok(())
    }

    /// The namespace of node `name`, if it has one.
    pub fn namespace_of(&self, name: &str) -> Option<&str> {
        self.plan.hosts.iter().find(|h| h.node == name).map(|h| h.ns.as_str())
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for dir in &self.hosts_dirs {
            if let Err(e) = std::fs::remove_dir_all(dir) {
                eprintln!("[up] removing {}: {e}", dir.display());
            }
        }
        for ns in self.made.iter().rev() {
            if let Err(e) = ip(&["netns", "del", ns]) {
                eprintln!("[up] removing namespace {ns}: {e:#}");
            }
        }
        // a host veth end left behind (its namespace failed to take the peer) goes too
        for h in &self.plan.hosts {
            if link_exists(&h.host_if) {
                let _ = ip(&["link", "del", &h.host_if]);
            }
        }
        if self.made_bridge
            && let Err(e) = ip(&["link", "del", &self.plan.bridge])
        {
            eprintln!("[up] removing bridge {}: {e:#}", self.plan.bridge);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_names_addresses_and_fits_interface_name_limits() {
        let p = plan("hello", &["scheduler", "expert-1"]).unwrap();
        assert_eq!(p.prefix, "troupe-hello-");
        assert_eq!(p.hosts[1].ns, "troupe-hello-expert-1");
        assert_eq!(p.hosts[0].addr.octets()[..3], p.bridge_addr.octets()[..3]);
        assert_eq!((p.hosts[0].addr.octets()[3], p.hosts[1].addr.octets()[3]), (2, 3));
        assert_eq!(p.hosts[0].listen().port(), NODE_PORT);
        assert_eq!(p.hosts[1].hostname, format!("{}.troupe", p.hosts[1].node.replace('_', "-")));
        // Linux interface names hold at most 15 bytes
        assert!(p.hosts.iter().all(|h| h.host_if.len() <= 15 && h.ns_if.len() <= 15));
        assert!(p.bridge.len() <= 15);
        assert_eq!(plan("hello", &["a"]).unwrap().bridge, p.bridge, "the same topology, the same subnet");
    }

    #[test]
    fn plan_refuses_bad_names_and_too_many_nodes() {
        assert!(plan("a/b", &["x"]).unwrap_err().to_string().contains("topology name"));
        assert!(plan("t", &["x y"]).unwrap_err().to_string().contains("node \"x y\""));
        let many: Vec<String> = (0..=MAX_NODES).map(|i| format!("n{i}")).collect();
        let refs: Vec<&str> = many.iter().map(String::as_str).collect();
        assert!(plan("t", &refs).unwrap_err().to_string().contains("at most 250"));
    }
}

//! `troupe node` configuration: TOML, unknown fields rejected, validated with errors that name
//! the file, the field and what is wrong.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use troupe_actors::HostPort;

/// Largest config file read (configs are a few KiB).
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// One node's configuration.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// The node's name; its certificate must carry it.
    pub name: String,
    /// UDP address to listen on: `IP:port` or `host:port` (resolved once, at start).
    #[serde(deserialize_with = "troupe_actors::address::deserialize_resolved")]
    pub listen: SocketAddr,
    /// Directory with `ca.crt`, `NAME.crt`, `NAME.key` (relative to the config file).
    pub keys: PathBuf,
    /// ractor_cluster cookie, a per-cluster secret; default: the `cookie` file `troupe keys init`
    /// wrote into the keys folder.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cookie: Option<String>,
    /// Who may join: revocation list, allow-list.
    #[serde(default)]
    pub security: SecuritySection,
    /// Peers this node dials.
    #[serde(default)]
    pub peers: Vec<PeerConfig>,
    /// A member to join through (`IP:port` or `host:port`): the node dials it and then every
    /// member it lists, so `peers` may stay empty (`troupe node --join` sets it too).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub join: Option<HostPort>,
    /// Heartbeats and failure detection.
    #[serde(default)]
    pub membership: MembershipSection,
    /// Root supervisor restart intensity.
    #[serde(default)]
    pub supervision: SupervisionSection,
    /// Transport limits.
    #[serde(default)]
    pub transport: TransportSection,
    /// Delay, jitter and loss this node adds to what it sends (off by default).
    #[serde(default, skip_serializing_if = "LinksSection::is_off")]
    pub links: LinksSection,
    /// Devices (one device actor each).
    #[serde(default)]
    pub devices: Vec<DeviceConfig>,
    /// Actors the root supervisor starts.
    #[serde(default)]
    pub actors: Vec<ActorConfig>,
    /// A job this node runs; the node exits when it ends.
    #[serde(default)]
    pub job: Option<JobConfig>,
    /// The fault switch (off unless sites are named): seeded, per-site injected panics.
    #[serde(default, skip_serializing_if = "FaultsSection::is_off")]
    pub faults: FaultsSection,
    /// Prometheus metrics over HTTP (off unless `listen` is set).
    #[serde(default, skip_serializing_if = "MetricsSection::is_off")]
    pub metrics: MetricsSection,
}

/// `[metrics]`: serve Prometheus text at `http://LISTEN/metrics`. Off by default.
///
/// Access rule: local scrape only. The endpoint has no authentication, so `listen` must be a
/// loopback address (`127.0.0.1:PORT` or `[::1]:PORT`); any other address is refused when the
/// config is validated. Port 0 picks a free port, which the node logs.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsSection {
    /// TCP address the metrics endpoint binds to (loopback only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<SocketAddr>,
}

impl MetricsSection {
    /// True when metrics are not served.
    pub fn is_off(&self) -> bool {
        self.listen.is_none()
    }
}

/// `[faults]`: the node's fault switch. Each named site panics when its rule says so; sites not
/// named never fire.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct FaultsSection {
    /// Seed of probabilistic sites (same seed, same faults).
    pub seed: u64,
    /// The sites that fire.
    pub sites: Vec<FaultSiteConfig>,
}

/// One fault site's rule (see `troupe_policy::fault`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FaultSiteConfig {
    /// Site name, e.g. `coe.scheduler`.
    pub site: String,
    /// Fire at this hit (1-based).
    #[serde(default)]
    pub after: Option<u64>,
    /// Then every this many hits (0 = once).
    #[serde(default)]
    pub every: u64,
    /// Or: probability per hit.
    #[serde(default)]
    pub probability: f64,
    /// At most this many firings.
    #[serde(default = "one")]
    pub times: u64,
}

fn one() -> u64 {
    1
}

impl FaultsSection {
    /// True when no site is named (the switch is off).
    pub fn is_off(&self) -> bool {
        self.sites.is_empty()
    }

    /// The plan the node installs.
    pub fn plan(&self) -> troupe_policy::FaultPlan {
        self.sites
            .iter()
            .fold(troupe_policy::FaultPlan::new(self.seed), |p, s| p.with_site(&s.site, s.rule()))
    }
}

impl FaultSiteConfig {
    fn rule(&self) -> troupe_policy::SiteRule {
        troupe_policy::SiteRule {
            after: self.after,
            every: self.every,
            probability: self.probability,
            times: self.times,
        }
    }
}

/// `[security]`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct SecuritySection {
    /// Revocation list (relative to the config file): one node name or `serial:HEX` per line,
    /// `#` comments; checked at every hello and reloaded on SIGHUP (peers now revoked are
    /// disconnected). The file must exist when set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub revoked: Option<PathBuf>,
    /// When true, only the nodes listed in `peers` may join (admin tools such as `troupe status`
    /// are still answered).
    pub peers_only: bool,
}

/// A peer to dial.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PeerConfig {
    /// Its node name.
    pub name: String,
    /// Its address: `IP:port` or `host:port` (resolved again at every dial).
    pub addr: HostPort,
}

/// `[membership]`.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct MembershipSection {
    /// Heartbeat period in milliseconds.
    pub heartbeat_ms: u64,
    /// Silence in milliseconds after which a member is down.
    pub timeout_ms: u64,
}

impl Default for MembershipSection {
    fn default() -> Self {
        Self { heartbeat_ms: 200, timeout_ms: 1500 }
    }
}

/// `[supervision]`.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct SupervisionSection {
    /// Restarts allowed per period.
    pub max_restarts: u32,
    /// Period in seconds.
    pub period_s: u64,
}

impl Default for SupervisionSection {
    fn default() -> Self {
        Self { max_restarts: 3, period_s: 5 }
    }
}

/// `[transport]`.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct TransportSection {
    /// Largest frame body accepted from a peer, in MiB.
    pub max_frame_mb: u32,
    /// QUIC idle timeout in milliseconds.
    pub idle_timeout_ms: u64,
    /// Most MiB one peer connection may hold buffered (frames being received on all its streams
    /// plus frames received and not yet consumed); past it the connection is closed. Default 256:
    /// three 64 MiB tensors in flight fit; a peer cannot make the node hold more.
    pub max_peer_buffer_mb: u32,
    /// Most unidirectional streams a peer may have open at once (it needs three: one per channel).
    pub max_peer_streams: u32,
}

impl Default for TransportSection {
    fn default() -> Self {
        Self {
            max_frame_mb: 128,
            idle_timeout_ms: 10_000,
            max_peer_buffer_mb: (troupe_transport::DEFAULT_CONN_BUDGET >> 20) as u32,
            max_peer_streams: troupe_transport::quic::DEFAULT_MAX_UNI_STREAMS,
        }
    }
}

impl TransportSection {
    /// The per-connection budget in bytes.
    pub fn peer_buffer_bytes(&self) -> u64 {
        u64::from(self.max_peer_buffer_mb) << 20
    }
}

/// `[links]`: a link's round-trip time, jitter and loss, applied in user space by the
/// transport (these kernels have no `netem`; see `troupe_transport::impaired`). Each node delays
/// what it sends by `rtt_ms / 2 ± jitter_ms` and drops `loss_pct` percent of it, so two nodes
/// with the same section see `rtt_ms` between them. All zero (the default): off, and the
/// transport uses its plain socket.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LinksSection {
    /// Round-trip time between two nodes, in milliseconds (at most 10 000).
    pub rtt_ms: u64,
    /// One-way spread around `rtt_ms / 2`, in milliseconds (at most `rtt_ms / 2`).
    pub jitter_ms: u64,
    /// Percent of the datagrams each node sends that are lost (0 to 50).
    pub loss_pct: f64,
    /// Seed of the per-datagram draws (`troupe up` gives node `i` the topology's seed + i).
    pub seed: u64,
}

impl LinksSection {
    /// True when nothing is delayed or dropped.
    pub fn is_off(&self) -> bool {
        self.rtt_ms == 0 && self.jitter_ms == 0 && self.loss_pct == 0.0
    }

    /// The transport's impairment: `None` when off, an error naming the bound when out of range.
    pub fn impairment(
        &self,
    ) -> Result<Option<troupe_policy::LinkImpairment>, troupe_policy::impair::ImpairError> {
        if self.is_off() {
            return Ok(None);
        }
        troupe_policy::LinkImpairment::new(self.rtt_ms, self.jitter_ms, self.loss_pct, self.seed).map(Some)
    }
}

/// `[[devices]]`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct DeviceConfig {
    /// Device actor name.
    pub name: String,
    /// "cpu" or "cuda:N".
    pub kind: String,
    /// Memory budget in MiB.
    pub memory_mb: u64,
}

/// `[[actors]]`: an actor the root supervisor starts (kinds: see [`crate::kinds`]).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ActorConfig {
    /// Actor kind, e.g. "hello-expert".
    pub kind: String,
    /// Registered name (defaults to the kind).
    #[serde(default)]
    pub name: Option<String>,
    /// Kind-specific settings, checked by the workload that owns the kind.
    #[serde(default, skip_serializing_if = "toml::Table::is_empty")]
    pub params: toml::Table,
}

impl ActorConfig {
    /// The name the actor registers under: `name`, else the kind.
    pub fn actor_name(&self) -> &str {
        self.name.as_deref().unwrap_or(&self.kind)
    }
}

/// `[job]`: work this node runs once the cluster is up (kinds: see [`crate::kinds`]).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct JobConfig {
    /// Job kind, e.g. "hello".
    pub kind: String,
    /// Give up after this many seconds.
    #[serde(default = "default_job_timeout")]
    pub timeout_s: u64,
    /// Kind-specific settings, checked by the workload that owns the kind.
    #[serde(default, skip_serializing_if = "toml::Table::is_empty")]
    pub params: toml::Table,
}

fn default_job_timeout() -> u64 {
    120
}

/// What checks the kind and `params` of `[[actors]]` and `[job]` entries: the kinds a node binary
/// knows (`crate::kinds::Kinds`). Each returns `Err((field, problem))`, the field from the entry on.
pub trait KindCheck {
    /// Checks one `[[actors]]` entry.
    fn check_actor(&self, a: &ActorConfig) -> Result<(), (String, String)>;
    /// Checks the `[job]`.
    fn check_job(&self, j: &JobConfig) -> Result<(), (String, String)>;
}

/// A config problem, naming the file and the field.
#[derive(Debug, thiserror::Error)]
#[error("{file}: {}{problem}", field_prefix(.field))]
pub struct ConfigError {
    /// The config file.
    pub file: String,
    /// The field (dotted path) or "file".
    pub field: String,
    /// What is wrong.
    pub problem: String,
}

/// `FIELD: ` before a field's problem; nothing before a problem with the whole file (it is
/// named already).
fn field_prefix(field: &str) -> String {
    if field == "file" { String::new() } else { format!("{field}: ") }
}

/// Parses `text`: on failure the full path of the field the parser stopped at (from
/// serde's own path, never cut out of the message; `file` for a syntax error) and the parser's
/// message with its snippet of the file.
pub fn parse_toml<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, (String, String)> {
    let with_snippet = |mut e: toml::de::Error| {
        e.set_input(Some(text));
        e.to_string().trim_end().to_string()
    };
    let de = toml::Deserializer::parse(text).map_err(|e| ("file".to_string(), with_snippet(e)))?;
    serde_path_to_error::deserialize(de).map_err(|e| {
        let field = field_path(e.path());
        (field.unwrap_or_else(|| "file".into()), with_snippet(e.into_inner()))
    })
}

/// A serde path as a config field (`actors[0].params.ram_budget_mb`); `None` at the root.
pub fn field_path(path: &serde_path_to_error::Path) -> Option<String> {
    (path.iter().count() > 0).then(|| path.to_string())
}

impl NodeConfig {
    /// Reads, parses and validates a config file, its actors and job against `kinds`; relative
    /// paths resolve against its folder.
    pub fn load(path: &Path, kinds: &dyn KindCheck) -> Result<Self, ConfigError> {
        let file = path.display().to_string();
        let err =
            |field: &str, problem: String| ConfigError { file: file.clone(), field: field.into(), problem };
        let meta = std::fs::metadata(path).map_err(|e| err("file", e.to_string()))?;
        if meta.len() > MAX_CONFIG_BYTES {
            return Err(err(
                "file",
                format!("{} bytes is larger than the {MAX_CONFIG_BYTES}-byte cap", meta.len()),
            ));
        }
        let text = std::fs::read_to_string(path).map_err(|e| err("file", e.to_string()))?;
        let mut cfg: NodeConfig = parse_toml(&text).map_err(|(field, problem)| err(&field, problem))?;
        let base = path.parent().unwrap_or(Path::new("."));
        if cfg.keys.is_relative() {
            cfg.keys = base.join(&cfg.keys);
        }
        if let Some(r) = &cfg.security.revoked
            && r.is_relative()
        {
            cfg.security.revoked = Some(base.join(r));
        }
        cfg.validate(kinds).map_err(|(field, problem)| err(&field, problem))?;
        Ok(cfg)
    }

    /// Checks values that parse but make no sense, the actors and job against `kinds`:
    /// `Err((field, problem))`.
    pub fn validate(&self, kinds: &dyn KindCheck) -> Result<(), (String, String)> {
        let bad = |f: &str, p: String| Err((f.to_string(), p));
        if let Err(e) = troupe_transport::identity::validate_node_name(&self.name) {
            return bad("name", e.to_string());
        }
        for (i, f) in self.faults.sites.iter().enumerate() {
            if f.site.is_empty() {
                return bad(&format!("faults.sites[{i}].site"), "must name a site".into());
            }
            if let Err(e) = f.rule().validate() {
                return bad(&format!("faults.sites[{i}]"), e);
            }
        }
        if let Some(addr) = self.metrics.listen
            && !addr.ip().is_loopback()
        {
            return bad(
                "metrics.listen",
                format!(
                    "{addr} is not a loopback address; the metrics endpoint has no authentication and \
                     serves local scrapes only (use 127.0.0.1:PORT and a local agent or tunnel)"
                ),
            );
        }
        let m = self.membership;
        if m.heartbeat_ms == 0 {
            return bad("membership.heartbeat_ms", "must be at least 1".into());
        }
        if m.timeout_ms <= m.heartbeat_ms {
            return bad(
                "membership.timeout_ms",
                format!("must be greater than heartbeat_ms ({}), or every member flaps down", m.heartbeat_ms),
            );
        }
        if self.transport.max_frame_mb == 0 || self.transport.max_frame_mb > 4095 {
            return bad("transport.max_frame_mb", "must be between 1 and 4095".into());
        }
        if self.transport.max_peer_buffer_mb < self.transport.max_frame_mb {
            return bad(
                "transport.max_peer_buffer_mb",
                format!(
                    "must be at least max_frame_mb ({}), or a peer's largest frame can never arrive",
                    self.transport.max_frame_mb
                ),
            );
        }
        if !(3..=1024).contains(&self.transport.max_peer_streams) {
            return bad("transport.max_peer_streams", "must be between 3 (one per channel) and 1024".into());
        }
        if self.transport.idle_timeout_ms <= m.heartbeat_ms {
            return bad("transport.idle_timeout_ms", "must be greater than membership.heartbeat_ms".into());
        }
        if let Err(e) = self.links.impairment() {
            return bad("links", e.to_string());
        }
        if self.supervision.period_s == 0 {
            return bad("supervision.period_s", "must be at least 1".into());
        }
        for (i, p) in self.peers.iter().enumerate() {
            if let Err(e) = troupe_transport::identity::validate_node_name(&p.name) {
                return bad(&format!("peers[{i}].name"), e.to_string());
            }
            if p.name == self.name {
                return bad(&format!("peers[{i}].name"), "a node cannot be its own peer".into());
            }
        }
        for (i, d) in self.devices.iter().enumerate() {
            if d.kind != "cpu" && !d.kind.starts_with("cuda:") {
                return bad(
                    &format!("devices[{i}].kind"),
                    format!("unknown device kind {:?} (use \"cpu\" or \"cuda:N\")", d.kind),
                );
            }
            if d.memory_mb == 0 {
                return bad(&format!("devices[{i}].memory_mb"), "must be at least 1".into());
            }
        }
        for (i, a) in self.actors.iter().enumerate() {
            kinds.check_actor(a).map_err(|(f, p)| (format!("actors[{i}].{f}"), p))?;
        }
        if let Some(j) = &self.job {
            kinds.check_job(j).map_err(|(f, p)| (format!("job.{f}"), p))?;
        }
        Ok(())
    }

    /// The ractor_cluster cookie: the config's, else the keys folder's `cookie` file.
    pub fn cookie(&self) -> Result<String, troupe_transport::IdentityError> {
        match &self.cookie {
            Some(c) => Ok(c.clone()),
            None => troupe_transport::cookie::read_cookie(&self.keys),
        }
    }

    /// The admission rules `[security]` asks for (reads the revocation file).
    pub fn admission(&self) -> Result<troupe_transport::Admission, troupe_transport::RevocationError> {
        let revoked = match &self.security.revoked {
            Some(p) => troupe_transport::Revocations::load(p)?,
            None => troupe_transport::Revocations::default(),
        };
        let allow = self.security.peers_only.then(|| self.peers.iter().map(|p| p.name.clone()).collect());
        Ok(troupe_transport::Admission { revoked, allow })
    }

    /// Heartbeat period.
    pub fn heartbeat(&self) -> Duration {
        Duration::from_millis(self.membership.heartbeat_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kinds::Kinds;

    fn load(path: &Path) -> Result<NodeConfig, ConfigError> {
        NodeConfig::load(path, &Kinds::builtin())
    }

    fn write(dir: &Path, text: &str) -> PathBuf {
        let p = dir.join("node.toml");
        std::fs::write(&p, text).unwrap();
        p
    }

    const GOOD: &str = "name = \"a\"\nlisten = \"127.0.0.1:7000\"\nkeys = \"keys\"\n";

    #[test]
    fn metrics_are_off_by_default_and_refuse_a_non_loopback_address() {
        let d = tempfile::tempdir().unwrap();
        let c = load(&write(d.path(), GOOD)).unwrap();
        assert!(c.metrics.is_off());
        let local = format!("{GOOD}[metrics]\nlisten = \"127.0.0.1:9100\"\n");
        let c = load(&write(d.path(), &local)).unwrap();
        assert_eq!(c.metrics.listen, Some("127.0.0.1:9100".parse().unwrap()));
        let open = format!("{GOOD}[metrics]\nlisten = \"0.0.0.0:9100\"\n");
        let e = load(&write(d.path(), &open)).unwrap_err().to_string();
        assert!(e.contains("metrics.listen") && e.contains("0.0.0.0:9100") && e.contains("loopback"), "{e}");
    }

    #[test]
    fn links_are_off_by_default_and_out_of_range_values_are_named() {
        let d = tempfile::tempdir().unwrap();
        let c = load(&write(d.path(), GOOD)).unwrap();
        assert!(c.links.is_off());
        assert_eq!(c.links.impairment().unwrap(), None);
        let on = format!("{GOOD}[links]\nrtt_ms = 40\nloss_pct = 1\n");
        let c = load(&write(d.path(), &on)).unwrap();
        let imp = c.links.impairment().unwrap().unwrap();
        assert_eq!((imp.one_way, imp.loss_ppm), (Duration::from_millis(20), 10_000));
        for (bad, named) in [
            ("rtt_ms = 20000", "rtt_ms"),
            ("rtt_ms = 10\njitter_ms = 6", "jitter_ms"),
            ("loss_pct = 60", "loss_pct"),
        ] {
            let text = format!("{GOOD}[links]\n{bad}\n");
            let e = load(&write(d.path(), &text)).unwrap_err().to_string();
            assert!(e.contains("links") && e.contains(named), "{bad}: {e}");
        }
    }

    #[test]
    fn good_config_resolves_keys_next_to_the_file() {
        let d = tempfile::tempdir().unwrap();
        let c = load(&write(d.path(), GOOD)).unwrap();
        assert_eq!(c.keys, d.path().join("keys"));
        assert_eq!(c.membership, MembershipSection::default());
    }

    #[test]
    fn security_section_resolves_the_list_and_builds_the_allow_list() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("revoked.txt"), "old-node\n").unwrap();
        let text = format!(
            "{GOOD}[security]\nrevoked = \"revoked.txt\"\npeers_only = true\n[[peers]]\nname = \"b\"\naddr = \"127.0.0.1:7001\"\n"
        );
        let c = load(&write(d.path(), &text)).unwrap();
        assert_eq!(c.security.revoked.as_deref(), Some(d.path().join("revoked.txt").as_path()));
        let a = c.admission().unwrap();
        assert_eq!(a.allow, Some(["b".to_string()].into()));
        assert!(!a.revoked.is_empty());
        std::fs::remove_file(d.path().join("revoked.txt")).unwrap();
        let e = c.admission().unwrap_err().to_string();
        assert!(e.contains("revoked.txt"), "a missing list is an error naming it: {e}");
        let e = c.cookie().unwrap_err().to_string();
        assert!(e.contains("cookie"), "{e}");
    }

    #[test]
    fn host_names_in_listen_peers_and_join() {
        let d = tempfile::tempdir().unwrap();
        let text = "name = \"a\"\nlisten = \"localhost:7000\"\nkeys = \"k\"\njoin = \"seed.example.org:7101\"\n\
                    [[peers]]\nname = \"b\"\naddr = \"node-b.example.org:7102\"\n";
        let c = load(&write(d.path(), text)).unwrap();
        assert!(c.listen.ip().is_loopback() && c.listen.port() == 7000, "{}", c.listen);
        assert_eq!(c.peers[0].addr.to_string(), "node-b.example.org:7102");
        assert_eq!(c.join.map(|j| j.to_string()).as_deref(), Some("seed.example.org:7101"));
    }

    #[test]
    fn errors_name_file_field_and_problem() {
        let d = tempfile::tempdir().unwrap();
        let e = load(&write(d.path(), &format!("{GOOD}colour = \"red\"\n"))).unwrap_err();
        assert!(e.to_string().contains("node.toml") && e.field == "colour", "{e}");
        let e =
            load(&write(d.path(), &format!("{GOOD}[membership]\nheartbeat_ms = 500\ntimeout_ms = 100\n")))
                .unwrap_err();
        assert_eq!(e.field, "membership.timeout_ms", "{e}");
        let e = load(&write(d.path(), &format!("{GOOD}[[actors]]\nkind = \"dragon\"\n"))).unwrap_err();
        assert_eq!(e.field, "actors[0].kind");
        assert!(e.problem.contains("dragon"));
        let e = load(&write(d.path(), "name = \"a\"\nlisten = \"nowhere\"\nkeys = \"k\"\n")).unwrap_err();
        assert!(e.to_string().contains("listen") || e.to_string().contains("address"), "{e}");
        let e = load(&write(
            d.path(),
            "name = \"a\"\nlisten = \"localhost:7000\"\nkeys = \"k\"\n[[peers]]\nname = \"b\"\naddr = \"bad host:1\"\n",
        ))
        .unwrap_err();
        assert_eq!(e.field, "peers[0].addr", "{e}");
        assert!(e.problem.contains("bad host:1"), "{e}");
        let e = load(&d.path().join("missing.toml")).unwrap_err();
        assert!(e.to_string().contains("missing.toml"), "{e}");
        let e = load(&write(d.path(), &format!("{GOOD}[transport]\nmax_peer_buffer_mb = 64\n"))).unwrap_err();
        assert_eq!(e.field, "transport.max_peer_buffer_mb", "{e}");
        assert!(e.problem.contains("max_frame_mb (128)"), "{e}");
        let c = load(&write(
            d.path(),
            &format!("{GOOD}[transport]\nmax_frame_mb = 16\nmax_peer_buffer_mb = 64\nmax_peer_streams = 8\n"),
        ))
        .unwrap();
        assert_eq!((c.transport.peer_buffer_bytes(), c.transport.max_peer_streams), (64 << 20, 8));
    }

    #[test]
    fn a_bad_value_is_named_by_its_full_path_with_the_parsers_snippet() {
        let d = tempfile::tempdir().unwrap();
        let e =
            load(&write(d.path(), &format!("{GOOD}[membership]\nheartbeat_ms = \"fast\"\n"))).unwrap_err();
        assert_eq!(e.field, "membership.heartbeat_ms", "{e}");
        assert!(
            e.problem.contains('\n') && e.problem.contains("heartbeat_ms = \"fast\""),
            "keeps the snippet: {e}"
        );
        let e = load(&write(
            d.path(),
            &format!(
                "{GOOD}[[actors]]\nkind = \"pipeline-worker\"\n[actors.params]\nram_budget_mb = \"lots\"\n"
            ),
        ))
        .unwrap_err();
        assert_eq!(e.field, "actors[0].params.ram_budget_mb", "{e}");
    }
}

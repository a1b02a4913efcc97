//! Renders a node's status for `troupe status`.

use std::fmt::Write;

use troupe_actors::wire::NodeStatus;

/// The machine-readable report `troupe status --json` prints: the same fields as the text one,
/// under stable keys, bytes as integers.
pub fn json(s: &NodeStatus) -> serde_json::Value {
    serde_json::json!({
        "node": s.node,
        "members": s.members.iter().map(|m| serde_json::json!({
            "name": m.name,
            "status": m.status,
            "last_heard_ms_ago": m.last_heard_ms_ago,
            "rtt_ms": m.rtt_us.map(|us| us as f64 / 1e3),
        })).collect::<Vec<_>>(),
        "actors": s.actors,
        "devices": s.devices.iter().map(|d| serde_json::json!({
            "name": d.name,
            "kind": d.kind,
            "budget_bytes": d.budget_bytes,
            "used_bytes": d.used_bytes,
            "fragmentation": d.fragmentation,
        })).collect::<Vec<_>>(),
    })
}

/// A plain-text report: members, actors, device budgets.
pub fn render(s: &NodeStatus) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "node {}", s.node);
    let _ = writeln!(out, "members ({}):", s.members.len());
    for m in &s.members {
        let rtt = m.rtt_us.map_or_else(|| "rtt -".to_string(), |us| format!("rtt {:.1} ms", us as f64 / 1e3));
        let _ = writeln!(
            out,
            "  {:<20} {:<5} last heard {} ms ago, {rtt}",
            m.name, m.status, m.last_heard_ms_ago
        );
    }
    let _ = writeln!(out, "actors ({}):", s.actors.len());
    for a in &s.actors {
        let _ = writeln!(out, "  {a}");
    }
    let _ = writeln!(out, "devices ({}):", s.devices.len());
    for d in &s.devices {
        let _ = writeln!(
            out,
            "  {:<12} {:<7} {:>8.1} / {:>8.1} MiB used, fragmentation {:.3}",
            d.name,
            d.kind,
            d.used_bytes as f64 / 1048576.0,
            d.budget_bytes as f64 / 1048576.0,
            d.fragmentation
        );
    }
    out
}

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
        "residency": s.residency.iter().map(|r| serde_json::json!({
            "executor": r.executor,
            "device_experts": r.device_experts,
            "device_bytes": r.device_bytes,
            "host_experts": r.host_experts,
            "host_bytes": r.host_bytes,
        })).collect::<Vec<_>>(),
        "queues": s.queues.iter().map(|q| serde_json::json!({
            "workload": q.workload,
            "queue": q.queue,
            "depth": q.depth,
        })).collect::<Vec<_>>(),
        "stages": s.stages.iter().map(|w| serde_json::json!({
            "worker": w.worker,
            "stage": w.stage,
        })).collect::<Vec<_>>(),
        "pools": s.pools.iter().map(|p| serde_json::json!({
            "pool": p.pool,
            "budget_bytes": p.budget_bytes,
            "used_bytes": p.used_bytes,
            "fragmentation": p.fragmentation,
            "history": p.history.iter().map(|&(t, u)| [t, u]).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "mailboxes": s.mailboxes.iter().map(|m| serde_json::json!({
            "actor": m.actor,
            "depth": m.depth,
            "max_depth": m.max_depth,
        })).collect::<Vec<_>>(),
    })
}

/// A plain-text report: members, actors, device budgets, then the live figures.
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
    render_live(&mut out, s);
    out
}

/// The workloads' live figures (residency, queues, mailboxes, stages, pools), each section only when the
/// node has something to show in it.
fn render_live(out: &mut String, s: &NodeStatus) {
    if !s.residency.is_empty() {
        let _ = writeln!(out, "expert residency ({}):", s.residency.len());
        for r in &s.residency {
            let _ = writeln!(
                out,
                "  {:<20} device {} experts {:.1} MiB, host {} experts {:.1} MiB",
                r.executor,
                r.device_experts,
                r.device_bytes as f64 / 1048576.0,
                r.host_experts,
                r.host_bytes as f64 / 1048576.0
            );
        }
    }
    if !s.queues.is_empty() {
        let _ = writeln!(out, "queues ({}):", s.queues.len());
        for q in &s.queues {
            let _ = writeln!(out, "  {:<10} {:<16} {}", q.workload, q.queue, q.depth);
        }
    }
    if !s.mailboxes.is_empty() {
        let _ = writeln!(out, "mailboxes ({}):", s.mailboxes.len());
        for m in &s.mailboxes {
            let _ = writeln!(out, "  {:<26} {} queued, at most {}", m.actor, m.depth, m.max_depth);
        }
    }
    if !s.stages.is_empty() {
        let _ = writeln!(out, "pipeline workers ({}):", s.stages.len());
        for w in &s.stages {
            let stage = w.stage.map_or_else(|| "no stage live".to_string(), |st| format!("stage {st}"));
            let _ = writeln!(out, "  {:<20} {stage}", w.worker);
        }
    }
    if !s.pools.is_empty() {
        let _ = writeln!(out, "pools ({}):", s.pools.len());
        for p in &s.pools {
            let _ = writeln!(
                out,
                "  {:<24} {:>8.1} / {:>8.1} MiB used, fragmentation {:.3}",
                p.pool,
                p.used_bytes as f64 / 1048576.0,
                p.budget_bytes as f64 / 1048576.0,
                p.fragmentation
            );
        }
    }
}

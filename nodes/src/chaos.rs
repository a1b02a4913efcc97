//! `troupe chaos TOPOLOGY --seed S --faults N`: runs a topology twice on loopback, fault-free and
//! then under a seeded fault schedule, and reports each fault, how it was recovered, and whether
//! every workload's outputs equal the fault-free run's.
//!
//! 1. The fault-free run (`WORKDIR/fault-free`) records the progress lines the jobs print
//!    (`coe: completed 50 of`, `pipeline: 10 of`): these are the milestones kills are keyed to,
//!    so a kill lands while the work it disturbs is under way however fast the machine is.
//! 2. [`troupe_policy::chaos::schedule`] draws the faults from the seed (pure: the same seed and
//!    topology give the same schedule): SIGKILLs of nodes whose actors and job all recover from a
//!    restart (pipeline workers, cameras, executors, and the job nodes of the journaled jobs: the
//!    coe scheduler and the pipeline foreman resume from their journals), each restarted after a
//!    drawn delay within the membership timeout, and fault-switch panics of the job nodes'
//!    schedulers at a drawn hit, written into their configs' `[faults]`.
//! 3. The chaos run (`WORKDIR/chaos`) performs the kills and restarts as the milestones appear.
//! 4. The report lists each fault with the lines that show its recovery, and compares outputs.
//!
//! Every job's `out` (and journal) is moved into the run's folder, so the two runs' outputs
//! sit side by side. Exits 0 only if every job succeeded in both runs, every fault fired and
//! every workload's outputs equal the fault-free run's.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use troupe_policy::Micros;
use troupe_policy::chaos::{ChaosNode, ChaosSite, ChaosSpec, Fault, schedule};

use crate::config::{FaultSiteConfig, FaultsSection};
use crate::up::{Cluster, JobTracker, Launch, NodeBinary, Topology, prepare, prepare_steps};

// Every built-in actor kind recovers from a kill. The edge journals what it accepted and answered
// (the chaos run gives it a journal of its own), and a restarted edge resumes from it; a
// restarted camera streams again from its first frame, and the edge answers its repeated uploads
// with the adaptation of that drift phase already made or under way, and its report replaces the
// old incarnation's (`troupe_policy::adapt::replay`). What decides whether a node may be killed is
// its job.

/// Job kinds whose node may be killed mid-job: what they accepted and answered is journaled (the
/// chaos run gives each a journal of its own), and a restarted node resumes the job from it.
const JOURNALED_JOBS: &[&str] = &["coe", "pipeline", "coadapt"];

/// Which progress lines disturb an actor kind's or a job kind's work: killing a node with this
/// actor or job when a job prints a line starting with the prefix lands mid-work. A node that
/// runs a job is killed only at its own job's milestones, which come while that job is surely
/// under way (its co-hosted actors' work may go on after its job ended, and a job node killed
/// then would run its finished job again).
const MILESTONES: &[(&str, &str)] = &[
    ("pipeline-worker", "pipeline: "),
    ("coe-executor", "coe: completed "),
    ("coadapt-edge", "upload accepted camera="),
    ("pipeline", "pipeline: "),
    ("coe", "coe: completed "),
    ("coadapt", "upload accepted camera="),
];

/// The fault-switch sites of a node, with the hit range a fault-free run of the example
/// topologies surely reaches: (job kind or actor kind, site, first hit, last hit). Measured on
/// the campus in debug: coe.scheduler fired at hit 19 and not at 77.
const SITES: &[(&str, &str, u64, u64)] = &[
    #[cfg(feature = "onnx")]
    ("coe", troupe_actors::coe::serve::FAULT_SITE, 5, 25),
    #[cfg(feature = "onnx")]
    ("pipeline", troupe_actors::pipeline::FAULT_SITE, 5, 20),
    ("coadapt-edge", troupe_actors::coadapt::edge::FAULT_SITE, 2, 5),
];

/// Shortest and longest delay from a kill to the restart, within the campus's membership
/// timeout: a node back before the failure detector's timeout is not declared down, and the
/// pipeline foreman notices the new incarnation by the pid its telemetry answers with, gives up
/// the calls out to the dead one and joins the new one, so the worker serves again in the same
/// job. (A node declared lost first is started again at once.)
const RESTART_DELAY_MS: (u64, u64) = (200, 1500);

/// After a restart, how long a kill whose milestone came while the node was down waits for the
/// node to rejoin before it is performed anyway.
const REKILL_GRACE: Duration = Duration::from_secs(2);

/// What a node logs when its fault switch fires a panic.
const PANIC_FIRED: &str = "fault switch: injecting a panic";

/// One line a node printed, stamped with the run's clock.
#[derive(Clone, Debug)]
struct Line {
    at: Duration,
    node: String,
    text: String,
}

/// What one run of the topology left behind.
struct RunResult {
    /// Every job succeeded.
    ok: bool,
    /// The jobs' ends: (node, succeeded).
    jobs: Vec<(String, bool)>,
    lines: Vec<Line>,
    /// What happened to each kill: (milestone time, kill time, restart time), by schedule index.
    kills: BTreeMap<usize, (Duration, Duration, Option<Duration>)>,
}

/// Runs `troupe chaos`.
pub async fn run(path: &Path, seed: u64, faults: usize, workdir: Option<PathBuf>) -> Result<ExitCode> {
    let exe = std::env::current_exe().context("locating the troupe binary")?;
    let probe = Topology::load(path)?;
    prepare_steps(&exe, &probe.prepare).await?;
    let workdir = workdir.unwrap_or_else(|| PathBuf::from(".cache/chaos").join(&probe.name));
    std::fs::create_dir_all(&workdir).with_context(|| format!("creating {}", workdir.display()))?;
    let workdir = workdir.canonicalize()?;

    println!("[chaos] fault-free run of {} in {}", probe.name, workdir.join("fault-free").display());
    let free_dir = workdir.join("fault-free");
    let free = run_once(&exe, path, &free_dir, &[]).await?;
    if !free.ok {
        bail!("the fault-free run failed (jobs: {:?}); see the logs in {}", free.jobs, free_dir.display());
    }

    let spec = spec_for(&Topology::load(path)?, &free.lines, seed, faults);
    let plan = schedule(&spec)?;
    println!("[chaos] seed {seed}: {} faults", plan.len());
    for (i, f) in plan.iter().enumerate() {
        println!("[chaos]   {}: {}", i + 1, describe(f));
    }
    let chaos_dir = workdir.join("chaos");
    let chaos = run_once(&exe, path, &chaos_dir, &plan).await?;

    let topology = Topology::load(path)?;
    let mut report = String::new();
    report.push_str(&format!(
        "chaos report: topology {}, seed {seed}, {} faults\n",
        topology.name,
        plan.len()
    ));
    let mut all_fired = true;
    for (i, f) in plan.iter().enumerate() {
        let (line, fired) = recovery(i, f, &chaos);
        all_fired &= fired;
        report.push_str(&format!("  fault {}: {line}\n", i + 1));
    }
    report.push_str("jobs:\n");
    for (node, ok) in &chaos.jobs {
        report.push_str(&format!("  {node}: {}\n", if *ok { "succeeded" } else { "FAILED" }));
    }
    report.push_str("outputs:\n");
    let mut all_equal = true;
    for n in topology.nodes.iter().filter(|n| n.job.is_some()) {
        let kind = n.job.as_ref().map_or("", |j| j.kind.as_str());
        let (equal, detail) = compare(kind, &n.name, &free_dir, &free, &chaos_dir, &chaos);
        all_equal &= equal;
        report.push_str(&format!(
            "  {kind} (job on {}): outputs equal the fault-free run: {} ({detail})\n",
            n.name,
            if equal { "yes" } else { "no" }
        ));
    }
    let ok = chaos.ok && all_fired && all_equal;
    report.push_str(&format!(
        "verdict: {}\n",
        if ok { "every job succeeded, every fault fired and was recovered, outputs equal" } else { "FAILED" }
    ));
    print!("{report}");
    let file = workdir.join("report.txt");
    std::fs::write(&file, &report).with_context(|| format!("writing {}", file.display()))?;
    println!("[chaos] report written to {}", file.display());
    Ok(if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// One line naming a fault.
fn describe(f: &Fault) -> String {
    match f {
        Fault::Kill { node, milestone, restart_after } => format!(
            "kill -9 {node} when a job prints \"{milestone}\", restart it {} ms later",
            restart_after.as_millis()
        ),
        Fault::Panic { site, node, after_hits } => {
            format!("panic the actor at fault site {site} on {node} at its hit {after_hits}")
        }
    }
}

/// The schedule's inputs: the topology's nodes (job, restart safety, milestones seen in the
/// fault-free run's `lines`) and its fault sites.
fn spec_for(topology: &Topology, lines: &[Line], seed: u64, faults: usize) -> ChaosSpec {
    let mut seen: Vec<String> = Vec::new();
    for l in lines {
        if let Some(m) = milestone_of(&l.text)
            && !seen.contains(&m)
        {
            seen.push(m);
        }
    }
    let nodes = topology
        .nodes
        .iter()
        .map(|n| {
            let job = n.job.as_ref().map(|j| j.kind.as_str());
            let kinds: Vec<&str> = match job {
                Some(j) => vec![j],
                None => n.actors.iter().map(|a| a.kind.as_str()).collect(),
            };
            let prefixes: Vec<&str> =
                MILESTONES.iter().filter(|(k, _)| kinds.contains(k)).map(|(_, p)| *p).collect();
            ChaosNode {
                name: n.name.clone(),
                restart_safe: job.is_none_or(|j| JOURNALED_JOBS.contains(&j)),
                milestones: {
                    let mut m: Vec<String> =
                        seen.iter().filter(|m| prefixes.iter().any(|p| m.starts_with(p))).cloned().collect();
                    // one order whatever order the fault-free run printed them in (cameras
                    // upload in any order), so a seed draws the same milestone on every machine
                    m.sort_by_key(|m| milestone_order(m));
                    m
                },
            }
        })
        .collect();
    let mut sites = Vec::new();
    for n in &topology.nodes {
        let mut kinds: Vec<&str> = n.actors.iter().map(|a| a.kind.as_str()).collect();
        kinds.extend(n.job.as_ref().map(|j| j.kind.as_str()));
        for (kind, site, first, last) in SITES {
            if kinds.contains(kind) {
                sites.push(ChaosSite {
                    site: (*site).into(),
                    node: n.name.clone(),
                    first_hit: *first,
                    last_hit: *last,
                });
            }
        }
    }
    ChaosSpec {
        seed,
        faults,
        nodes,
        sites,
        restart_min: Micros::from_millis(RESTART_DELAY_MS.0),
        restart_max: Micros::from_millis(RESTART_DELAY_MS.1),
    }
}

/// A milestone's place in a node's list: by prefix, then by count (`coe: completed 25 of` before
/// `... 100 of`), then by name.
fn milestone_order(m: &str) -> (String, u64, String) {
    let digits = m.find(|c: char| c.is_ascii_digit()).unwrap_or(m.len());
    let count: String = m[digits..].chars().take_while(char::is_ascii_digit).collect();
    (m[..digits].to_owned(), count.parse().unwrap_or(0), m.to_owned())
}

/// The milestone a progress line marks (`coe: completed 50 of`, `pipeline: 10 of`, `upload
/// accepted camera=phone-1`), if any.
fn milestone_of(line: &str) -> Option<String> {
    let line = message(line);
    let (_, p) = MILESTONES.iter().find(|(_, p)| line.starts_with(p))?;
    let rest = &line[p.len()..];
    if p.ends_with('=') {
        // a named event (the value after `=`): every one is a milestone
        let value = rest.split_whitespace().next()?;
        return Some(format!("{p}{value}"));
    }
    let (k, rest) = rest.split_once(" of ")?;
    let total: String = rest.chars().take_while(char::is_ascii_digit).collect();
    (k.parse::<u64>().is_ok() && k != total).then(|| format!("{p}{k} of"))
}

/// Runs the topology once in `dir` with the `plan`'s panics in the configs and its kills
/// performed as their milestones appear; returns when every job ended.
async fn run_once(exe: &Path, path: &Path, dir: &Path, plan: &[Fault]) -> Result<RunResult> {
    let mut topology = Topology::load(path)?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    for n in &mut topology.nodes {
        if let Some(job) = &mut n.job
            && matches!(job.kind.as_str(), "coe" | "pipeline")
        {
            let out = dir.join(format!("{}-{}.out", n.name, job.kind));
            let journal = dir.join(format!("{}-{}.journal", n.name, job.kind));
            let _ = std::fs::remove_file(&out);
            let _ = std::fs::remove_file(&journal);
            job.params.insert("out".into(), toml::Value::String(out.display().to_string()));
            job.params.insert("journal".into(), toml::Value::String(journal.display().to_string()));
        }
        for a in n.actors.iter_mut().filter(|a| a.kind == "coadapt-edge") {
            let journal = dir.join(format!("{}-edge.journal", n.name));
            let _ = std::fs::remove_file(&journal);
            a.params.insert("journal".into(), toml::Value::String(journal.display().to_string()));
        }
        let panics: Vec<FaultSiteConfig> = plan
            .iter()
            .filter_map(|f| match f {
                Fault::Panic { site, node, after_hits } if *node == n.name => Some(FaultSiteConfig {
                    site: site.clone(),
                    after: Some(*after_hits),
                    every: 0,
                    probability: 0.0,
                    times: 1,
                }),
                _ => None,
            })
            .collect();
        if !panics.is_empty() {
            n.faults = FaultsSection { seed: n.faults.seed, sites: panics };
        }
    }
    let configs = prepare(&topology, dir)?;
    let (lines_tx, mut lines_rx) = tokio::sync::mpsc::unbounded_channel();
    let (mut cluster, mut jobs_rx) =
        Cluster::start(&topology, dir, configs, Launch::console(NodeBinary::troupe_at(exe), Some(lines_tx)))?;
    let t0 = Instant::now();
    let mut tracker = JobTracker::new(&cluster.job_nodes);
    let mut lines: Vec<Line> = Vec::new();
    // kills whose milestone was printed, waiting for their node to be up
    let mut due: Vec<usize> = Vec::new();
    let mut kills: BTreeMap<usize, (Duration, Duration, Option<Duration>)> = BTreeMap::new();
    let mut seen_at: BTreeMap<usize, Duration> = BTreeMap::new();
    let mut down: BTreeMap<String, (usize, Instant)> = BTreeMap::new();
    // restarted nodes not yet seen rejoining: when they came back
    let mut back_since: BTreeMap<String, Instant> = BTreeMap::new();
    let mut ticker = tokio::time::interval(Duration::from_millis(20));
    // faults performed (kills) or seen firing (fault-switch panics) of the plan's
    let bar = crate::progress::bar(plan.len() as u64, "chaos faults");
    let code = loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {
                crate::progress::println("[chaos] ctrl-c: stopping every node");
                break std::process::ExitCode::FAILURE;
            }
            Some((name, ok)) = jobs_rx.recv() => tracker.job_ended(name, ok),
            Some((node, text)) = lines_rx.recv() => {
                for (i, f) in plan.iter().enumerate() {
                    if let Fault::Kill { milestone, .. } = f
                        && !kills.contains_key(&i)
                        && !due.contains(&i)
                        && message(&text).starts_with(milestone.as_str())
                    {
                        due.push(i);
                        seen_at.insert(i, t0.elapsed());
                    }
                }
                if text.contains(PANIC_FIRED) {
                    bar.inc(1);
                }
                back_since.retain(|n, _| !(text.contains(n.as_str()) && text.contains("rejoined")));
                // a node declared lost is started again at once (the rejoin path)
                if let Some((_, at)) = down.get_mut(&declared_lost(&text, &node, down.keys()).unwrap_or_default()) {
                    *at = Instant::now();
                }
                lines.push(Line { at: t0.elapsed(), node, text });
            }
            _ = ticker.tick() => {}
        }
        // restarts that are due
        let now = Instant::now();
        let back: Vec<String> =
            down.iter().filter(|(_, (_, at))| *at <= now).map(|(n, _)| n.clone()).collect();
        for node in back {
            if let Some((i, _)) = down.remove(&node) {
                cluster.restart(&node)?;
                back_since.insert(node.clone(), Instant::now());
                crate::progress::println(format!("[chaos] fault {}: restarted {node}", i + 1));
                if let Some(k) = kills.get_mut(&i) {
                    k.2 = Some(t0.elapsed());
                }
            }
        }
        // kills whose milestone appeared and whose node is up
        let mut i = 0;
        while i < due.len() {
            let f = due[i];
            let Fault::Kill { node, restart_after, .. } = &plan[f] else {
                due.remove(i);
                continue;
            };
            let rejoining = back_since.get(node).is_some_and(|t| t.elapsed() < REKILL_GRACE);
            if down.contains_key(node) || rejoining {
                i += 1;
                continue;
            }
            cluster.kill9(node).await?;
            back_since.remove(node);
            crate::progress::println(format!("[chaos] fault {}: killed {node} with SIGKILL", f + 1));
            bar.inc(1);
            let seen = seen_at.get(&f).copied().unwrap_or_default();
            kills.insert(f, (seen, t0.elapsed(), None));
            down.insert(node.clone(), (f, Instant::now() + Duration::from_micros(restart_after.0)));
            due.remove(i);
        }
        // a job node killed by the plan is not a failed job: it comes back and resumes
        let killed: Vec<&str> = down.keys().map(String::as_str).collect();
        if let Some(code) = tracker.check_except(&mut cluster.children, &killed) {
            break code;
        }
    };
    bar.finish_and_clear();
    cluster.stop_all().await;
    while let Ok((node, text)) = lines_rx.try_recv() {
        lines.push(Line { at: t0.elapsed(), node, text });
    }
    Ok(RunResult { ok: code == ExitCode::SUCCESS, jobs: tracker.ended, lines, kills })
}

/// The down node (of `down`) that `line`, printed by `from`, declares lost, if any.
fn declared_lost<'a>(line: &str, from: &str, mut down: impl Iterator<Item = &'a String>) -> Option<String> {
    down.find(|n| *n != from && is_loss(line, n)).cloned()
}

/// Whether `line` says `node` was lost (pipeline) or is down (coe).
fn is_loss(line: &str, node: &str) -> bool {
    line.contains(node) && (line.contains(" lost") || line.contains("is down"))
}

/// How fault `i` went: a report line, and whether it fired.
fn recovery(i: usize, f: &Fault, run: &RunResult) -> (String, bool) {
    let secs = |d: Duration| format!("{:.2} s", d.as_secs_f64());
    match f {
        Fault::Kill { node, milestone, .. } => {
            let Some(&(seen, killed, restarted)) = run.kills.get(&i) else {
                return (
                    format!("kill -9 {node} at \"{milestone}\": NOT PERFORMED (the milestone never came)"),
                    false,
                );
            };
            let mut s = format!("{} kill -9 {node} (at \"{milestone}\"", secs(killed));
            if killed > seen + Duration::from_millis(200) {
                s.push_str(&format!(", printed at {} while it was still coming back", secs(seen)));
            }
            s.push(')');
            match restarted {
                Some(r) => s.push_str(&format!(", restarted at {}", secs(r))),
                None => s.push_str(", not restarted before the jobs ended"),
            }
            let after: Vec<&Line> = run.lines.iter().filter(|l| l.at >= killed && l.node != *node).collect();
            let lost = after.iter().find(|l| is_loss(&l.text, node));
            let rejoined =
                after.iter().find(|l| l.text.contains(node.as_str()) && l.text.contains("rejoined"));
            // a job node: its job resumed from the journal
            let resumed = run
                .lines
                .iter()
                .find(|l| l.at >= killed && l.node == *node && l.text.contains(": resuming from journal "));
            match lost {
                Some(l) => s.push_str(&format!(
                    "; {}: {} declared it lost and re-planned its work",
                    secs(l.at),
                    l.node
                )),
                // the job that would notice runs on it
                None if resumed.is_some() => {}
                None => s.push_str("; no job noticed the loss"),
            }
            match (rejoined, resumed) {
                (_, Some(l)) => s.push_str(&format!("; {}: {}", secs(l.at), message(&l.text))),
                (Some(l), None) => s.push_str(&format!("; {}: {}", secs(l.at), message(&l.text))),
                (None, None) => s.push_str("; the jobs finished without it rejoining"),
            }
            // the pipeline job's worker line: tasks it ran after it was put back in service
            let worker = run.lines.iter().rev().find_map(|l| {
                let t = l.text.trim_start();
                let rest = t.strip_prefix(node.as_str())?;
                rest.starts_with(' ').then(|| t.split_once(" | rejoined ").map(|(_, r)| r.to_owned()))?
            });
            if let Some(r) = worker {
                s.push_str(&format!(" (pipeline: rejoined {r})"));
            }
            // a camera on it: repeated uploads answered by the adaptation already made or under way
            let repeats: Vec<&Line> = after
                .iter()
                .filter(|l| l.text.contains("repeated upload") && l.text.contains(&format!("camera={node}")))
                .copied()
                .collect();
            if let Some(l) = repeats.first() {
                s.push_str(&format!(
                    "; {}: its camera restarted and uploaded {} drift phase(s) again, answered by the one adaptation each ({})",
                    secs(l.at),
                    repeats.len(),
                    message(&l.text)
                ));
            }
            (s, true)
        }
        Fault::Panic { site, node, after_hits } => {
            let on_node = || run.lines.iter().filter(|l| l.node == *node);
            let fired = on_node().find(|l| l.text.contains(PANIC_FIRED) && l.text.contains(site));
            let Some(fired) = fired else {
                return (format!("panic at {site} on {node} (hit {after_hits}): DID NOT FIRE"), false);
            };
            let mut s = format!("{} panic at {site} on {node} (hit {after_hits})", secs(fired.at));
            match on_node().find(|l| l.at >= fired.at && l.text.contains("child failed; restarting")) {
                Some(l) => {
                    s.push_str(&format!("; {}: the supervisor restarted it and it resumed", secs(l.at)))
                }
                None => s.push_str("; no supervisor restart seen"),
            }
            (s, true)
        }
    }
}

/// A log line without its `tracing` timestamp and level.
fn message(line: &str) -> &str {
    let mut rest = line.trim_start();
    let mut word = || {
        let (w, r) = rest.split_once(' ').unwrap_or((rest, ""));
        rest = r.trim_start();
        w
    };
    let (ts, level) = (word(), word());
    if ts.contains('T') && !level.is_empty() && level.chars().all(|c| c.is_ascii_uppercase()) {
        rest.trim()
    } else {
        line.trim()
    }
}

/// Whether job `kind` on `node` gave the same outputs in both runs, and a few words on it.
fn compare(
    kind: &str,
    node: &str,
    free_dir: &Path,
    free: &RunResult,
    chaos_dir: &Path,
    chaos: &RunResult,
) -> (bool, String) {
    let read = |dir: &Path| std::fs::read_to_string(dir.join(format!("{node}-{kind}.out")));
    match kind {
        "coe" => match (read(free_dir), read(chaos_dir)) {
            (Ok(a), Ok(b)) => {
                let ids = |t: &str| -> Vec<String> {
                    t.lines().filter_map(|l| l.split_whitespace().nth(1).map(str::to_owned)).collect()
                };
                let b_ids = ids(&b);
                let mut uniq = b_ids.clone();
                uniq.sort();
                uniq.dedup();
                let once = uniq.len() == b_ids.len();
                (
                    a == b && once,
                    format!(
                        "{} requests, each answered once: {once}, digests identical: {}",
                        b_ids.len(),
                        a == b
                    ),
                )
            }
            (a, b) => (false, format!("results missing: fault-free {:?}, chaos {:?}", a.err(), b.err())),
        },
        "pipeline" => match (read(free_dir), read(chaos_dir)) {
            (Ok(a), Ok(b)) => compare_pipeline(&a, &b),
            (a, b) => (false, format!("outputs missing: fault-free {:?}, chaos {:?}", a.err(), b.err())),
        },
        "coadapt" => {
            let cams = |r: &RunResult| -> Vec<(String, String, String)> {
                r.lines
                    .iter()
                    .filter(|l| l.node == node)
                    .filter_map(|l| {
                        let rest = l.text.strip_prefix("coadapt: camera ")?;
                        let w: Vec<&str> = rest.split_whitespace().collect();
                        (w.get(1) == Some(&"drift_frame"))
                            .then(|| (w[0].to_owned(), w[2].to_owned(), rest.to_owned()))
                    })
                    .collect()
            };
            let (mut a, mut b) = (cams(free), cams(chaos));
            a.sort();
            b.sort();
            let names = |v: &[(String, String, String)]| v.iter().map(|c| c.0.clone()).collect::<Vec<_>>();
            // a camera adapts once per drift phase: one line per (camera, drift frame)
            let mut uniq: Vec<(&str, &str)> = b.iter().map(|c| (c.0.as_str(), c.1.as_str())).collect();
            uniq.dedup();
            let once = uniq.len() == b.len();
            let same_cams = names(&a) == names(&b);
            let same_drift = a.iter().zip(&b).all(|(x, y)| x.1 == y.1);
            let same_numbers = a.iter().zip(&b).all(|(x, y)| x.2 == y.2);
            // the edge's own count: a restarted camera's repeated upload is not adapted again (a
            // restarted edge counts the adaptations its journal answered before the kill too)
            let tasks = |r: &RunResult| -> Option<u64> {
                r.lines.iter().filter(|l| l.node == node).find_map(|l| {
                    let rest = l.text.strip_prefix("coadapt: scheduler ")?;
                    let (_, n) = rest.split_once(" tasks_done ")?;
                    n.split_whitespace().next()?.parse().ok()
                })
            };
            let (ta, tb) = (tasks(free), tasks(chaos));
            let same_tasks = ta.is_some() && ta == tb;
            let show = |t: Option<u64>| t.map_or_else(|| "?".to_string(), |n| n.to_string());
            (
                !b.is_empty() && once && same_cams && same_drift && same_tasks,
                format!(
                    "{} adaptations, each drift adapted once: {once}; edge tasks done {} (fault-free {}); same cameras and drift frames: {}; exact-match figures identical: {same_numbers} (they depend on how the co-adaptation cycles interleave, so not compared)",
                    b.len(),
                    show(tb),
                    show(ta),
                    same_cams && same_drift
                ),
            )
        }
        other => (
            chaos.jobs.iter().any(|(n, ok)| n == node && *ok),
            format!("no output comparison for {other} jobs"),
        ),
    }
}

/// Pipeline outputs: one JSON row per input, embeddings equal within 1e-5.
fn compare_pipeline(a: &str, b: &str) -> (bool, String) {
    let rows = |t: &str| -> Option<Vec<(u64, Vec<f64>)>> {
        t.lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).ok()?;
                let e = v["sentence_embedding"]
                    .as_array()?
                    .iter()
                    .map(|x| x.as_f64())
                    .collect::<Option<Vec<_>>>()?;
                Some((v["input"].as_u64()?, e))
            })
            .collect()
    };
    let (Some(a), Some(b)) = (rows(a), rows(b)) else { return (false, "unreadable output rows".into()) };
    let once = b.iter().enumerate().all(|(i, (id, _))| *id == i as u64);
    let mut err = 0.0f64;
    let mut shapes = a.len() == b.len();
    for ((_, x), (_, y)) in a.iter().zip(&b) {
        shapes &= x.len() == y.len();
        err = x.iter().zip(y).fold(err, |m, (p, q)| m.max((p - q).abs()));
    }
    (
        once && shapes && err <= 1e-5,
        format!(
            "{} inputs, each answered once: {once}, max abs embedding difference {err:.1e} (<= 1e-5)",
            b.len()
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_lines_are_milestones_but_the_last_is_not() {
        assert_eq!(milestone_of("pipeline: 10 of 25 inputs answered").as_deref(), Some("pipeline: 10 of"));
        assert_eq!(milestone_of("coe: completed 50 of 300").as_deref(), Some("coe: completed 50 of"));
        assert_eq!(milestone_of("coe: completed 300 of 300"), None);
        assert_eq!(milestone_of("coe: resuming from journal x"), None);
        assert_eq!(milestone_of("pipeline: results written to x"), None);
    }

    #[test]
    fn milestones_have_one_order_and_name_camera_uploads() {
        let mut m = vec!["coe: completed 100 of", "coe: completed 25 of", "upload accepted camera=phone-2"];
        m.sort_by_key(|m| milestone_order(m));
        assert_eq!(m, ["coe: completed 25 of", "coe: completed 100 of", "upload accepted camera=phone-2"]);
        let line = "2026-12-06T11:41:20.631926Z  INFO upload accepted camera=phone-1 adaptation=0 key=0";
        assert_eq!(milestone_of(line).as_deref(), Some("upload accepted camera=phone-1"));
        assert_eq!(milestone_of("coe: completed 50 of 300").as_deref(), Some("coe: completed 50 of"));
        assert_eq!(milestone_of("coe: completed 300 of 300"), None, "the last is no milestone");
    }

    #[test]
    fn messages_lose_their_timestamp_and_level() {
        assert_eq!(message("2026-01-01T00:00:00Z  INFO worker a rejoined"), "worker a rejoined");
        assert_eq!(
            message("coe: executor x rejoined on a; back in service"),
            "coe: executor x rejoined on a; back in service"
        );
    }
}

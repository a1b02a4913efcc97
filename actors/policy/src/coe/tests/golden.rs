//! Golden decision traces: checked-in scenarios (testdata/coe) and the decisions expected for
//! them, compared line by line. `UPDATE_GOLDEN=1 cargo test -p troupe-policy golden` rewrites the
//! expected parts; review the diff by hand (the expected values were reasoned out first, and a
//! few of them are asserted explicitly below).

use std::path::PathBuf;

use crate::coe::latency::LatencyModel;
use crate::coe::memory::{EvictionContext, EvictionPolicy, ExpertManager, belady_min_loads, lru_loads};
use crate::coe::model::{CoeModel, ExpertId, ExpertSpec, Tier};
use crate::coe::profile::Profile;
use crate::coe::scheduler::SchedulerConfig;
use crate::coe::sim::{SimOptions, SimReport, simulate};
use crate::coe::trace::Trace;

fn testdata(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("testdata/coe").join(name)
}

fn read(name: &str) -> String {
    std::fs::read_to_string(testdata(name)).unwrap_or_else(|e| panic!("reading {name}: {e}"))
}

fn updating() -> bool {
    std::env::var_os("UPDATE_GOLDEN").is_some()
}

/// Compare `actual` with the golden file's lines (comments `#` skipped), or rewrite it.
fn check_lines(golden: &str, header: &str, actual: &[String]) {
    let path = testdata(golden);
    if updating() {
        let mut text = String::from(header);
        for line in actual {
            text.push_str(line);
            text.push('\n');
        }
        std::fs::write(&path, text).unwrap();
        return;
    }
    let expected_text = read(golden);
    let expected: Vec<&str> = expected_text.lines().filter(|l| !l.starts_with('#')).collect();
    for (i, (want, got)) in expected.iter().zip(actual).enumerate() {
        assert_eq!(want, got, "{golden}: decision {} differs (UPDATE_GOLDEN=1 rewrites)", i + 1);
    }
    assert_eq!(expected.len(), actual.len(), "{golden}: number of decision lines differs");
}

fn tiny_latency() -> LatencyModel {
    let profile = Profile::load(&read("tiny.profile"), "golden-test-box").unwrap();
    LatencyModel::from_profile(&profile).unwrap()
}

fn run_scenario(scenario: &str, config: SchedulerConfig) -> SimReport {
    let trace = Trace::parse(&read(&format!("{scenario}.trace"))).unwrap();
    let options = SimOptions { record_decisions: true, ..SimOptions::default() };
    let report = simulate(&trace, &tiny_latency(), config, &options).unwrap();
    let label = config.label().replace('+', "-");
    let header = format!(
        "# Decisions for {scenario}.trace under {} on tiny.profile (t = simulated micros).\n\
         # Event lines are inputs; indented lines are the scheduler's actions.\n",
        config.label()
    );
    check_lines(&format!("{scenario}.{label}.golden"), &header, &report.decisions);
    report
}

fn has(report: &SimReport, line: &str) -> bool {
    report.decisions.iter().any(|d| d == line)
}

fn position(report: &SimReport, line: &str) -> usize {
    report.decisions.iter().position(|d| d == line).unwrap_or_else(|| panic!("no `{line}`"))
}

#[test]
fn golden_grouping_ours() {
    let r = run_scenario("grouping", SchedulerConfig::ours());
    // r1 (e1) goes to cpu0: gpu0 would finish it at 2200 us (1000 left of e0's load + 100 queued
    // + 1000 load + 100 run), cpu0 at 2000 us (1000 load + 1000 run).
    assert!(has(&r, "  enqueue r1 e1 -> x1"));
    // r2 joins r0's group although r1 arrived between them: one load of e0 serves both.
    assert!(has(&r, "  run x0 b0 e0 [r0 r2]"));
    // At 2400 us gpu0 holds e0 (usage .6) and e2 (usage .3) and needs room for e3: no stranded
    // subsequent expert (e0 is resident), so stage 2 evicts the lower usage probability, e2.
    assert!(has(&r, "  evict x0 e2"));
    assert_eq!(r.makespan.0, 3500);
    assert_eq!(r.loads, 4);
}

#[test]
fn golden_grouping_fcfs_lru() {
    let r = run_scenario("grouping", SchedulerConfig::fcfs_lru());
    // FCFS runs r0 alone (it was dispatched on arrival), then r2 and r3 adjacent in the queue.
    assert!(has(&r, "  run x0 b0 e0 [r0]"));
    assert!(has(&r, "  run x0 b2 e0 [r2 r3]"));
    // r0's subsequent task (request order 0) goes ahead of r2's and r3's.
    assert!(position(&r, "  load x0 e2 from ssd") < position(&r, "  load x1 e2 from ssd"));
    // LRU on gpu0 at 2350 us: e0 was used at 1250 us, e2 just now: e0 goes.
    assert!(has(&r, "  evict x0 e0"));
    assert_eq!(r.makespan.0, 4000);
}

#[test]
fn golden_batches_ours() {
    let r = run_scenario("batches", SchedulerConfig::ours());
    assert!(has(&r, "  run x0 b0 e0 [r0 r1]"));
    assert!(has(&r, "  run x0 b1 e0 [r2 r3]"));
    assert!(has(&r, "  run x0 b2 e0 [r4]"));
    assert_eq!((r.loads, r.makespan.0), (1, 1400));
}

#[test]
fn golden_batches_fcfs_lru() {
    let r = run_scenario("batches", SchedulerConfig::fcfs_lru());
    assert!(has(&r, "  load x1 e0 from ssd"));
    assert!(has(&r, "  run x0 b2 e0 [r2 r3]"));
    assert_eq!((r.loads, r.makespan.0), (2, 2000));
}

/// Runs an eviction script: `> command` lines, each followed by its expected output lines.
struct EvictionScript {
    specs: Vec<ExpertSpec>,
    model: Option<CoeModel>,
    manager: Option<ExpertManager>,
    queued: Vec<(ExpertId, u64)>,
}

fn expert_arg(token: &str) -> ExpertId {
    ExpertId(token.trim_start_matches('e').parse().unwrap())
}

impl EvictionScript {
    fn run(&mut self, command: &str) -> Vec<String> {
        let tokens: Vec<&str> = command.split_whitespace().collect();
        match tokens[0] {
            "expert" => {
                let parent = tokens.get(9).map(|p| expert_arg(p));
                self.specs.push(ExpertSpec {
                    size_bytes: tokens[3].parse().unwrap(),
                    select_prob: tokens[5].parse().unwrap(),
                    home: Tier::Ssd,
                    parent,
                });
                vec![]
            }
            "manager" => {
                let policy: EvictionPolicy = tokens[4].parse().unwrap_or_else(|e| panic!("{e}"));
                self.model = Some(CoeModel::new(self.specs.clone()).unwrap());
                self.manager = Some(ExpertManager::new(tokens[2].parse().unwrap(), policy));
                vec![]
            }
            "queued" => {
                self.queued = tokens[1..]
                    .iter()
                    .map(|t| {
                        let (e, pos) = t.split_once('@').unwrap();
                        (expert_arg(e), pos.parse().unwrap())
                    })
                    .collect();
                vec![]
            }
            "load" => {
                let (model, manager) = (self.model.as_ref().unwrap(), self.manager.as_mut().unwrap());
                let expert = expert_arg(tokens[1]);
                let size = model.size_of(expert);
                let victims = {
                    let m = &*manager;
                    let is_resident = |x: ExpertId| m.is_resident(x);
                    let queued = &self.queued;
                    let next_use = |x: ExpertId| queued.iter().find(|q| q.0 == x).map(|q| q.1);
                    let ctx = EvictionContext {
                        model,
                        is_resident: &is_resident,
                        resident_elsewhere: &|_| false,
                        next_use: &next_use,
                    };
                    m.plan_eviction(expert, size, &ctx)
                };
                match victims {
                    Err(e) => vec![format!("refused: {e}")],
                    Ok(victims) => {
                        let mut out: Vec<String> = victims.iter().map(|v| format!("evict {v}")).collect();
                        for v in victims {
                            manager.evict(v).unwrap();
                        }
                        manager.admit(expert, size).unwrap();
                        let resident: Vec<String> = manager.resident().map(|x| x.to_string()).collect();
                        out.push(format!(
                            "admit {expert}: used {}/{} [{}]",
                            manager.used_bytes(),
                            manager.budget(),
                            resident.join(" ")
                        ));
                        out
                    }
                }
            }
            "pin" | "unpin" | "use" | "evict" => {
                let manager = self.manager.as_mut().unwrap();
                let expert = expert_arg(tokens[1]);
                let result = match tokens[0] {
                    "pin" => manager.pin(expert),
                    "unpin" => manager.unpin(expert),
                    "evict" => manager.evict(expert).map(|_| ()),
                    _ => {
                        manager.touch(expert);
                        Ok(())
                    }
                };
                match result {
                    Ok(()) => vec![],
                    Err(e) => vec![format!("refused: {e}")],
                }
            }
            "belady" => {
                let budget: u64 = tokens[1].parse().unwrap();
                let order: Vec<ExpertId> = tokens[2..].iter().map(|t| expert_arg(t)).collect();
                let model = CoeModel::new(self.specs.clone()).unwrap();
                let min = belady_min_loads(&order, |x| model.size_of(x), budget).unwrap();
                let lru = lru_loads(&order, |x| model.size_of(x), budget).unwrap();
                vec![format!("loads: belady {min}, lru {lru}")]
            }
            other => panic!("unknown command `{other}`"),
        }
    }
}

/// Run a datadriven eviction file; returns the outputs per command, in order.
fn run_eviction_file(name: &str) -> Vec<(String, Vec<String>)> {
    let text = read(name);
    let mut script = EvictionScript { specs: vec![], model: None, manager: None, queued: vec![] };
    // Rebuild the file: comments and commands kept, outputs recomputed.
    let mut rebuilt = String::new();
    let mut results = Vec::new();
    let mut expected: Vec<Vec<String>> = Vec::new();
    for line in text.lines() {
        if let Some(command) = line.strip_prefix("> ") {
            let out = script.run(command);
            rebuilt.push_str(line);
            rebuilt.push('\n');
            for o in &out {
                rebuilt.push_str(o);
                rebuilt.push('\n');
            }
            results.push((command.to_string(), out));
            expected.push(Vec::new());
        } else if line.starts_with('#') || line.trim().is_empty() {
            rebuilt.push_str(line);
            rebuilt.push('\n');
        } else if let Some(last) = expected.last_mut() {
            last.push(line.to_string());
        } else {
            panic!("{name}: output line before any command: {line}");
        }
    }
    if updating() {
        std::fs::write(testdata(name), rebuilt).unwrap();
        return results;
    }
    for ((command, got), want) in results.iter().zip(&expected) {
        assert_eq!(got, want, "{name}: output of `> {command}` differs (UPDATE_GOLDEN=1 rewrites)");
    }
    results
}

fn output_of<'a>(results: &'a [(String, Vec<String>)], command: &str, nth: usize) -> &'a [String] {
    results
        .iter()
        .filter(|(c, _)| c == command)
        .nth(nth)
        .map(|(_, o)| o.as_slice())
        .unwrap_or_else(|| panic!("no command `{command}` #{nth}"))
}

#[test]
fn golden_eviction_two_stage() {
    let r = run_eviction_file("eviction_two_stage.txt");
    // Stage 1 first: e5 depends on e1, which is not resident, so it goes before e3 even though
    // e3's usage probability (.03) is lower than e5's (.2).
    assert_eq!(output_of(&r, "load e4", 0)[0], "evict e5");
    // Pinned e3 is skipped; the next lowest usage probability goes instead.
    assert_eq!(output_of(&r, "load e1", 0)[0], "evict e4");
    // Queued work keeps e0 and e1 until last, and then the farthest next use goes first.
    assert_eq!(output_of(&r, "load e2", 0)[0], "evict e0");
    // Both e2 and e3 stranded once e0 left: the lower usage probability goes first.
    assert_eq!(output_of(&r, "load e5", 1)[0], "evict e3");
}

#[test]
fn golden_eviction_lru() {
    let r = run_eviction_file("eviction_lru.txt");
    assert_eq!(output_of(&r, "load e3", 0)[0], "evict e1");
    assert!(output_of(&r, "load e4", 0)[0].starts_with("refused:"));
}

#[test]
fn golden_belady() {
    let r = run_eviction_file("belady.txt");
    assert_eq!(r.last().unwrap().1[0], "loads: belady 7, lru 12");
}

#[test]
fn golden_eviction_policies_differ() {
    let r = run_eviction_file("eviction_policies.txt");
    // Same residents, same queue hint (e4 next), one victim each.
    assert_eq!(output_of(&r, "load e2", 0)[0], "evict e4", "two-stage: the stranded expert");
    assert_eq!(output_of(&r, "load e2", 1)[0], "evict e3", "lookahead: keeps e4 for queued work");
    assert_eq!(output_of(&r, "load e2", 2)[0], "evict e4", "lookahead without hints = two-stage");
    assert_eq!(output_of(&r, "load e2", 3)[0], "evict e0", "lru: the oldest, a root");
}

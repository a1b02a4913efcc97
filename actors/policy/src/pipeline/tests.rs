//! Tests of the pipeline policy: golden files, hand-checked cases, property tests, simulations.

use std::fmt::Write as _;

use proptest::prelude::*;

use super::affinity::{
    self, Claim, DispatchInput, Phase, ReadyTask, StageFlow, Telemetry, Tier, WorkerCosts, WorkerView,
    classify, entropy_weights, two_phase_dispatch,
};
use super::chain::{ChainError, DType, Producer, StageSignature, TensorSig, check_chain};
use super::foreman::{Action, Foreman, ForemanConfig, Job, WorkerReport};
use super::golden::{arg, args, bytes, run_golden, stage_list, task, worker};
use super::plan::{PlanWorker, plan_cost, plan_stages};
use super::replan::{ReplanWeights, SurvivorView, plan_reassignment};
use super::sim::{
    SimSetup, SimWorker, SpanKind, StageCost, classic_pipeline_bound, ideal_pipeline_bound,
    ideal_pipeline_bound_with_loads, simulate, simulate_on, synthetic_chain,
};
use super::{Mode, TaskId, WorkerId};
use crate::Micros;

// ---------- parsing helpers shared by the golden handlers ----------

fn tensor_list(s: &str) -> Vec<TensorSig> {
    if s == "none" {
        return Vec::new();
    }
    s.split(',')
        .map(|t| {
            let parts: Vec<&str> = t.split(':').collect();
            assert_eq!(parts.len(), 3, "tensor spec {t} is name:dtype:rank");
            TensorSig::new(parts[0], parts[1].parse::<DType>().unwrap(), parts[2].parse().unwrap())
        })
        .collect()
}

fn default_hash(k: usize) -> String {
    format!("{:064x}", k + 1)
}

fn telemetry_of(a: &[(String, String)]) -> Telemetry {
    let f = |k: &str, d: f64| arg(a, k).map_or(d, |v| v.parse().unwrap());
    Telemetry {
        cpu_load: f("cpu", 0.5),
        free_ram_bytes: arg(a, "free").map_or(1_000_000_000, bytes),
        ram_budget_bytes: arg(a, "budget").map_or(1_000_000_000, bytes),
        battery_pct: f("battery", 50.0),
        temperature_c: f("temp", 35.0),
        rtt_ms: f("rtt", 20.0),
    }
}

// ---------- chain ----------

fn run_chain(_cmd: &str, input: &[String]) -> String {
    let mut job = Vec::new();
    let mut stages = Vec::new();
    for line in input {
        let mut words = line.split_whitespace();
        match words.next() {
            Some("job") => job = words.flat_map(tensor_list).collect(),
            Some("stage") => {
                let name = words.next().unwrap().to_owned();
                let a = args(line);
                stages.push(StageSignature {
                    name,
                    sha256: arg(&a, "sha").map_or_else(|| default_hash(stages.len()), str::to_owned),
                    size_bytes: bytes(arg(&a, "size").unwrap_or("1M")),
                    inputs: tensor_list(arg(&a, "in").unwrap_or("none")),
                    outputs: tensor_list(arg(&a, "out").unwrap_or("none")),
                });
            }
            other => panic!("unknown chain line {other:?}"),
        }
    }
    match check_chain(&stages, &job) {
        Ok(c) => {
            let k = c.smallest_stage();
            format!("ok: {} stages, smallest #{k} '{}'", c.len(), c.stages()[k].name)
        }
        Err(e) => format!("error: {e}"),
    }
}

#[test]
fn golden_chain() {
    run_golden("chain.txt", run_chain);
}

#[test]
fn chain_error_names_pair_and_tensor() {
    let a = StageSignature {
        name: "cell_a".into(),
        sha256: default_hash(0),
        size_bytes: 10,
        inputs: vec![TensorSig::new("input_ids", DType::I64, 2)],
        outputs: vec![TensorSig::new("hidden", DType::F32, 3)],
    };
    let mut b = StageSignature {
        name: "cell_b".into(),
        sha256: default_hash(1),
        size_bytes: 10,
        inputs: vec![
            TensorSig::new("hidden", DType::F16, 3),
            TensorSig::new("attention_mask", DType::I64, 2),
        ],
        outputs: vec![TensorSig::new("logits", DType::F32, 2)],
    };
    let job = [TensorSig::new("input_ids", DType::I64, 2), TensorSig::new("attention_mask", DType::I64, 2)];
    let err = check_chain(&[a.clone(), b.clone()], &job).unwrap_err();
    assert_eq!(
        err,
        ChainError::DTypeMismatch {
            from: Producer::Stage { index: 0, name: "cell_a".into() },
            to: 1,
            to_name: "cell_b".into(),
            tensor: "hidden".into(),
            produced: DType::F32,
            expected: DType::F16,
        }
    );
    assert_eq!(
        err.to_string(),
        "stage #0 'cell_a' -> stage #1 'cell_b': tensor 'hidden' dtype differs: produced f32, expected f16"
    );
    // The side input attention_mask comes from the job inputs; with the dtype fixed it passes.
    b.inputs[0].dtype = DType::F32;
    let chain = check_chain(&[a.clone(), b.clone()], &job).unwrap();
    assert_eq!(chain.len(), 2);
    // Without it among the job inputs, the side input is missing.
    let err = check_chain(&[a, b], &job[..1]).unwrap_err();
    assert!(matches!(err, ChainError::MissingInput { ref tensor, to: 1, .. } if tensor == "attention_mask"));
}

// ---------- tiers ----------

fn run_tiers(cmd: &str, input: &[String]) -> String {
    let stage: usize = arg(&args(cmd), "stage").unwrap().parse().unwrap();
    let mut out = String::new();
    for line in input {
        let a = args(line);
        let live = match arg(&a, "live").unwrap_or("none") {
            "none" => None,
            s => Some(s.parse().unwrap()),
        };
        let cached = stage_list(arg(&a, "cached").unwrap_or("none"), 0).contains(&stage);
        let name = line.split_whitespace().next().unwrap();
        let _ = writeln!(out, "{name} {}", classify(live, cached, stage));
    }
    out
}

#[test]
fn golden_tiers() {
    run_golden("tiers.txt", run_tiers);
}

#[test]
fn tiers_by_hand() {
    assert_eq!(classify(Some(1), false, 1), Tier::Resident);
    assert_eq!(classify(None, true, 1), Tier::Cached);
    assert_eq!(classify(None, false, 1), Tier::Idle);
    // Another stage live: unload first, even with the wanted stage on disk.
    assert_eq!(classify(Some(0), true, 1), Tier::Swap);
    assert!(Tier::Resident < Tier::Cached && Tier::Idle < Tier::Swap);
}

// ---------- entropy weights ----------

fn run_entropy(_cmd: &str, input: &[String]) -> String {
    let names: Vec<&str> = input.iter().map(|l| l.split_whitespace().next().unwrap()).collect();
    let crowd: Vec<Telemetry> = input.iter().map(|l| telemetry_of(&args(l))).collect();
    let (scores, weights) = affinity::rank_telemetry(&crowd);
    let mut out = String::from("weights");
    for (n, w) in affinity::METRIC_NAMES.iter().zip(weights) {
        let _ = write!(out, " {n}={w:.6}");
    }
    out.push('\n');
    for (n, s) in names.iter().zip(scores) {
        let _ = writeln!(out, "score {n}={s:.6}");
    }
    out
}

#[test]
fn golden_entropy() {
    run_golden("entropy.txt", run_entropy);
}

#[test]
fn entropy_weights_by_hand() {
    // Columns: battery [20, 40, 40], rtt [10, 20, 70], cpu constant.
    // battery: p = (.2, .4, .4), H = -(.2 ln .2 + 2 * .4 ln .4) = 1.054920, e = H / ln 3 = 0.960230
    // rtt:     p = (.1, .2, .7), H = 0.801819, e = 0.729847
    // d = (0.039770, 0.270153, 0), w = d / 0.309923 = (0.128323, 0.871677, 0)
    let rows = [[20.0, 10.0, 0.5], [40.0, 20.0, 0.5], [40.0, 70.0, 0.5]];
    let w = entropy_weights(&rows);
    assert!((w[0] - 0.128323).abs() < 1e-6, "{w:?}");
    assert!((w[1] - 0.871677).abs() < 1e-6, "{w:?}");
    assert_eq!(w[2], 0.0);
    // Scores (battery higher is better, rtt lower is better), min-max normalised:
    // row 0: 0 * wb + 1 * wr = 0.871677; row 1: wb + (5/6) wr = 0.854720; row 2: wb = 0.128323.
    let s = affinity::weighted_scores(&rows, &w, &[true, false, false]);
    assert!((s[0] - 0.871677).abs() < 1e-6 && (s[1] - 0.854720).abs() < 1e-6);
    assert!((s[2] - 0.128323).abs() < 1e-6);
    // Everything equal: all weights zero, no NaN.
    let flat = entropy_weights(&[[3.0, 0.0], [3.0, 0.0]]);
    assert_eq!(flat, [0.0, 0.0]);
    // One worker, empty crowd, NaN and negative telemetry: zeros, never NaN.
    assert_eq!(entropy_weights(&[[1.0, 2.0]]), [0.0, 0.0]);
    assert_eq!(entropy_weights::<2>(&[]), [0.0, 0.0]);
    let w = entropy_weights(&[[f64::NAN, -1.0], [1.0, 2.0], [1.0, 2.0]]);
    assert!(w.iter().all(|x| x.is_finite()));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]
    #[test]
    fn entropy_weights_are_a_distribution_or_zero(
        rows in prop::collection::vec(prop::array::uniform4(0.0f64..1e6), 0..12)
    ) {
        let w = entropy_weights(&rows);
        prop_assert!(w.iter().all(|x| x.is_finite() && *x >= 0.0));
        let sum: f64 = w.iter().sum();
        prop_assert!(sum == 0.0 || (sum - 1.0).abs() < 1e-9);
        for j in 0..4 {
            if rows.iter().all(|r| r[j] == rows[0][j]) {
                prop_assert!(w[j] < 1e-12, "constant column {j} weighs {}", w[j]);
            }
        }
    }
}

// ---------- two-phase dispatch ----------

/// `a,b,c` in ms as µs per stage (for the cost-rule blocks).
fn ms_list(s: &str) -> Vec<f64> {
    s.split(',').map(|x| x.parse::<f64>().unwrap() * 1e3).collect()
}

/// The per-stage flow the foreman would build from the holders' predicted costs: free holders
/// (worker lines) and busy ones (`busy` lines: `until=` ms until free, `wait=` ms of load left).
fn flow_of(stages: usize, holders: &[(Option<usize>, WorkerCosts, f64, f64, bool)]) -> StageFlow {
    let mut f = StageFlow {
        rate: vec![0.0; stages],
        wait: vec![f64::INFINITY; stages],
        next_rate: vec![0.0; stages],
        next_load: vec![0.0; stages],
        measured: vec![true; stages],
        task_sum: vec![0.0; stages],
        fastest: vec![f64::INFINITY; stages],
        busy: vec![Vec::new(); stages],
        bound_elsewhere: vec![false; stages],
    };
    let mut n = vec![0usize; stages];
    for (live, c, until, wait, busy) in holders {
        let Some(k) = *live else { continue };
        n[k] += 1;
        f.rate[k] += 1.0 / c.task_us[k];
        f.task_sum[k] += c.task_us[k];
        f.fastest[k] = f.fastest[k].min(c.task_us[k]);
        f.wait[k] = f.wait[k].min(*wait);
        if k + 1 < stages {
            f.next_rate[k] += 1.0 / c.task_us[k + 1];
            f.next_load[k] += c.load_us[k + 1];
        }
        if *busy {
            f.busy[k].push((*until, c.task_us[k]));
        }
    }
    for w in &mut f.wait {
        if !w.is_finite() {
            *w = 0.0;
        }
    }
    for (l, n) in f.next_load.iter_mut().zip(&n) {
        *l /= (*n).max(1) as f64;
    }
    f
}

fn run_dispatch(cmd: &str, input: &[String]) -> String {
    let stages: usize = arg(&args(cmd), "stages").unwrap().parse().unwrap();
    let mut holders_costs = Vec::new();
    let mut elsewhere = Vec::new();
    let mut d = DispatchInput {
        workers: Vec::new(),
        ready: Vec::new(),
        backlog: vec![0; stages],
        in_flight: vec![0; stages],
        holders: vec![0; stages],
        flow: None,
    };
    for line in input {
        let mut words = line.split_whitespace();
        match words.next() {
            Some("worker") => {
                let id = worker(words.next().unwrap());
                let a = args(line);
                let live = match arg(&a, "live").unwrap_or("none") {
                    "none" => None,
                    s => Some(s.parse().unwrap()),
                };
                let cached = stage_list(arg(&a, "cached").unwrap_or("none"), stages);
                let fits = stage_list(arg(&a, "fits").unwrap_or("all"), stages);
                let costs = arg(&a, "task")
                    .map(|t| WorkerCosts { task_us: ms_list(t), load_us: ms_list(arg(&a, "load").unwrap()) });
                if let Some(c) = &costs {
                    holders_costs.push((live, c.clone(), 0.0, 0.0, false));
                }
                d.workers.push(WorkerView {
                    id,
                    live,
                    cached: (0..stages).map(|k| cached.contains(&k)).collect(),
                    fits: (0..stages).map(|k| fits.contains(&k)).collect(),
                    score: arg(&a, "score").unwrap_or("0").parse().unwrap(),
                    costs,
                    home: arg(&a, "home").map(|h| h.parse().unwrap()),
                });
            }
            Some("busy") => {
                let a = args(line);
                let live = Some(arg(&a, "live").unwrap().parse().unwrap());
                let c = WorkerCosts {
                    task_us: ms_list(arg(&a, "task").unwrap()),
                    load_us: ms_list(arg(&a, "load").unwrap()),
                };
                let ms = |key| arg(&a, key).unwrap_or("0").parse::<f64>().unwrap() * 1e3;
                holders_costs.push((live, c, ms("until"), ms("wait"), true));
            }
            Some("ready") => {
                d.ready = words
                    .map(|w| match w.split_once('@') {
                        Some((t, on)) => ReadyTask { task: task(t), input_on: Some(worker(on)) },
                        None => ReadyTask { task: task(w), input_on: None },
                    })
                    .collect()
            }
            Some("inflight") => {
                d.in_flight = words.next().unwrap().split(',').map(|x| x.parse().unwrap()).collect()
            }
            Some("backlog") => {
                d.backlog = words.next().unwrap().split(',').map(|x| x.parse().unwrap()).collect()
            }
            Some("holders") => {
                d.holders = words.next().unwrap().split(',').map(|x| x.parse().unwrap()).collect()
            }
            // stages with a holder whose home is another stage that still has work
            Some("elsewhere") => elsewhere = stage_list(words.next().unwrap(), stages),
            other => panic!("unknown dispatch line {other:?}"),
        }
    }
    if !holders_costs.is_empty() {
        let mut f = flow_of(stages, &holders_costs);
        for k in elsewhere {
            f.bound_elsewhere[k] = true;
        }
        d.flow = Some(f);
    }
    let mut out = String::new();
    for c in two_phase_dispatch(&d) {
        let phase = match c.phase {
            Phase::WorkerClaim => "phase1",
            Phase::TaskClaim => "phase2",
            Phase::Pull => "pull",
        };
        let _ = writeln!(out, "{} -> {} {} {phase}", c.task, c.worker, c.tier);
    }
    if out.is_empty() {
        out.push_str("(no claims)");
    }
    out
}

#[test]
fn golden_dispatch() {
    run_golden("dispatch.txt", run_dispatch);
}

#[test]
fn dispatch_by_hand() {
    // w1 holds s1 live, w2 holds s0 live, w3 is empty with s1 cached. Ready: two s1 tasks, one s0.
    // Phase 1: s0 and s1 each have coverage 1; the later stage goes first: w1 claims i0/s1,
    // then w2 claims i2/s0. Phase 2: i1/s1 takes the best of what is left: w3 (Tier 2).
    let view = |id, live, cached: Vec<bool>, score| WorkerView {
        id: WorkerId(id),
        live,
        cached,
        fits: vec![true; 2],
        score,
        costs: None,
        home: None,
    };
    let d = DispatchInput {
        workers: vec![
            view(1, Some(1), vec![false, true], 0.1),
            view(2, Some(0), vec![true, false], 0.9),
            view(3, None, vec![false, true], 0.0),
        ],
        ready: [(0, 1), (1, 1), (2, 0)]
            .into_iter()
            .map(|(i, s)| ReadyTask { task: TaskId::new(i, s), input_on: None })
            .collect(),
        backlog: vec![1, 2],
        in_flight: vec![0, 0],
        holders: vec![1, 1],
        flow: None,
    };
    let claims = two_phase_dispatch(&d);
    let c = |i, s, w, tier, phase| Claim { task: TaskId::new(i, s), worker: WorkerId(w), tier, phase };
    assert_eq!(
        claims,
        vec![
            c(0, 1, 1, Tier::Resident, Phase::WorkerClaim),
            c(2, 0, 2, Tier::Resident, Phase::WorkerClaim),
            c(1, 1, 3, Tier::Cached, Phase::TaskClaim),
        ]
    );
}

// ---------- replan planner and foreman scripts ----------

fn run_replan(cmd: &str, input: &[String]) -> String {
    let a = args(cmd);
    let from = worker(arg(&a, "from").unwrap());
    let stages: usize = arg(&a, "stages").unwrap().parse().unwrap();
    let mut survivors = Vec::new();
    let mut orphans = Vec::new();
    for line in input {
        let mut words = line.split_whitespace();
        match words.next() {
            Some("survivor") => {
                let id = worker(words.next().unwrap());
                let a = args(line);
                let cached = stage_list(arg(&a, "cached").unwrap_or("none"), stages);
                let fits = stage_list(arg(&a, "fits").unwrap_or("all"), stages);
                survivors.push(SurvivorView {
                    id,
                    ok: arg(&a, "ok").unwrap_or("0").parse().unwrap(),
                    failed: arg(&a, "failed").unwrap_or("0").parse().unwrap(),
                    free_ram_bytes: bytes(arg(&a, "ram").unwrap_or("0")),
                    battery_pct: arg(&a, "battery").unwrap_or("0").parse().unwrap(),
                    live: match arg(&a, "live").unwrap_or("none") {
                        "none" => None,
                        s => Some(s.parse().unwrap()),
                    },
                    cached: (0..stages).map(|k| cached.contains(&k)).collect(),
                    fits: (0..stages).map(|k| fits.contains(&k)).collect(),
                    queued: arg(&a, "queued").unwrap_or("0").parse().unwrap(),
                });
            }
            Some("orphans") => orphans = words.map(task).collect(),
            other => panic!("unknown replan line {other:?}"),
        }
    }
    let mut out = String::new();
    for m in plan_reassignment(from, &orphans, &survivors, &ReplanWeights::default()) {
        match m.to {
            Some(to) => {
                let _ = writeln!(out, "{} {} -> {to} score={:.4}", m.task, m.from, m.score);
            }
            None => {
                let _ = writeln!(out, "{} {} -> none", m.task, m.from);
            }
        }
    }
    out
}

/// Drives a [`Foreman`] through a script; prints each command and the actions it produced.
fn run_foreman(_cmd: &str, input: &[String]) -> String {
    let mut f = Foreman::new(ForemanConfig::default());
    let mut out = String::new();
    let mut stages = 0;
    for (step, line) in input.iter().enumerate() {
        let now = Micros::from_secs(step as u64);
        let mut words = line.split_whitespace();
        let verb = words.next().unwrap();
        let a = args(line);
        let _ = writeln!(out, "> {line}");
        match verb {
            "join" => {
                let id = worker(words.next().unwrap());
                let report = WorkerReport {
                    telemetry: telemetry_of(&a),
                    live: arg(&a, "live").map(|s| default_hash(s.parse().unwrap())),
                    cached: stage_list(arg(&a, "cached").unwrap_or("none"), 0)
                        .into_iter()
                        .map(default_hash)
                        .collect(),
                };
                f.handle_worker_joined(now, id, report).unwrap();
            }
            "job" => {
                let sizes: Vec<u64> = arg(&a, "sizes").unwrap().split(',').map(bytes).collect();
                stages = sizes.len();
                let mode = match arg(&a, "mode").unwrap() {
                    "streaming" => Mode::Streaming,
                    "barrier" => Mode::Barrier,
                    m => panic!("mode {m}"),
                };
                let chain = synthetic_chain(&sizes).unwrap();
                let inputs = arg(&a, "inputs").unwrap().parse().unwrap();
                f.submit_job(now, Job { chain, inputs, mode }).unwrap();
            }
            "loaded" => {
                let id = worker(words.next().unwrap());
                let s: usize = words.next().unwrap().trim_start_matches('s').parse().unwrap();
                f.handle_stage_loaded(now, id, s, words.next() != Some("fail"));
            }
            "done" => {
                let id = worker(words.next().unwrap());
                let t = task(words.next().unwrap());
                f.handle_task_done(now, id, t, words.next() != Some("fail"));
            }
            "lost" => f.handle_worker_lost(now, worker(words.next().unwrap())),
            "telemetry" => {
                let id = worker(words.next().unwrap());
                f.handle_telemetry(now, id, telemetry_of(&a));
            }
            v => panic!("unknown verb {v}"),
        }
        while let Some(action) = f.poll_action() {
            let _ = writeln!(out, "  {action}");
        }
    }
    let live: Vec<String> = f
        .workers()
        .into_iter()
        .map(|w| match f.live_stage(w) {
            Some(k) if k < stages => format!("{w}=s{k}"),
            Some(_) => format!("{w}=foreign"),
            None => format!("{w}=none"),
        })
        .collect();
    let _ = writeln!(out, "live {}; done {}", live.join(" "), f.tasks_done());
    out
}

fn run_replan_or_script(cmd: &str, input: &[String]) -> String {
    if cmd.starts_with("replan") { run_replan(cmd, input) } else { run_foreman(cmd, input) }
}

#[test]
fn golden_replan() {
    run_golden("replan.txt", run_replan_or_script);
}

#[test]
fn golden_foreman() {
    run_golden("foreman.txt", run_foreman);
}

#[test]
fn replan_score_by_hand() {
    // ok=3 failed=1: success (3+1)/(3+1+2) = 2/3; only survivor so ram = 1; battery 80 -> 0.8;
    // Tier 1 -> 1; score = 0.3*2/3 + 0.2*1 + 0.2*0.8 + 0.3*1 = 0.86.
    let s = SurvivorView {
        id: WorkerId(1),
        ok: 3,
        failed: 1,
        free_ram_bytes: 500,
        battery_pct: 80.0,
        live: Some(1),
        cached: vec![false, true],
        fits: vec![true, true],
        queued: 0,
    };
    let moves = plan_reassignment(WorkerId(9), &[TaskId::new(0, 1)], &[s], &ReplanWeights::default());
    assert_eq!(moves.len(), 1);
    assert_eq!(moves[0].to, Some(WorkerId(1)));
    assert!((moves[0].score - 0.86).abs() < 1e-12, "{}", moves[0].score);
}

#[test]
fn late_completion_from_lost_worker_is_ignored() {
    let mut f = Foreman::new(ForemanConfig::default());
    let now = Micros::ZERO;
    for id in [1, 2] {
        f.handle_worker_joined(now, WorkerId(id), WorkerReport::default()).unwrap();
    }
    // Budget default in WorkerReport::default() is 0: give both a real one.
    for id in [1, 2] {
        f.handle_telemetry(
            now,
            WorkerId(id),
            Telemetry { ram_budget_bytes: 1 << 30, ..Telemetry::default() },
        );
    }
    let chain = synthetic_chain(&[1000]).unwrap();
    f.submit_job(now, Job { chain, inputs: 1, mode: Mode::Streaming }).unwrap();
    let actions: Vec<Action> = std::iter::from_fn(|| f.poll_action()).collect();
    // Smallest stage is stage 0: sent and loaded on both; nothing assigned until a load lands.
    assert!(actions.iter().all(|a| !matches!(a, Action::Assign { .. })));
    f.handle_stage_loaded(now, WorkerId(1), 0, true);
    let a: Vec<Action> = std::iter::from_fn(|| f.poll_action()).collect();
    let task = TaskId::new(0, 0);
    assert_eq!(a, vec![Action::Assign { task, worker: WorkerId(1), tier: Tier::Resident }]);
    f.handle_worker_lost(now, WorkerId(1));
    let a: Vec<Action> = std::iter::from_fn(|| f.poll_action()).collect();
    assert_eq!(a[0], Action::Reassigned { task, from: WorkerId(1), to: WorkerId(2) });
    // w2 is still loading s0: nothing more until it lands.
    assert_eq!(a.len(), 1);
    f.handle_task_done(now, WorkerId(1), task, true);
    assert_eq!(
        f.poll_action(),
        Some(Action::IgnoredCompletion {
            task,
            worker: WorkerId(1),
            reason: super::foreman::IgnoreReason::WorkerLost
        })
    );
    assert_eq!(f.tasks_done(), 0);
    f.handle_stage_loaded(now, WorkerId(2), 0, true);
    assert_eq!(f.poll_action(), Some(Action::Assign { task, worker: WorkerId(2), tier: Tier::Resident }));
    f.handle_task_done(now, WorkerId(2), task, true);
    let a: Vec<Action> = std::iter::from_fn(|| f.poll_action()).collect();
    assert_eq!(a, vec![Action::InputDone { input: 0 }, Action::JobDone]);
    // A second report of the same completion is ignored too.
    f.handle_task_done(now, WorkerId(2), task, true);
    assert!(matches!(f.poll_action(), Some(Action::IgnoredCompletion { .. })));
    assert_eq!(f.tasks_done(), 1);
}

/// Answers every load as landed; returns the tasks assigned meanwhile, in order.
fn settle(f: &mut Foreman) -> Vec<(TaskId, WorkerId)> {
    let mut assigned = Vec::new();
    while let Some(a) = f.poll_action() {
        match a {
            Action::Load { worker, stage } => f.handle_stage_loaded(Micros::ZERO, worker, stage, true),
            Action::Assign { task, worker, .. } => assigned.push((task, worker)),
            _ => {}
        }
    }
    assigned
}

/// Activations kept on a worker lost before the next stage read them: the producing task runs
/// again, the consumer whose pull failed waits for it instead of burning its attempts, and the
/// job completes with each task counted once.
#[test]
fn lost_outputs_are_made_again_and_the_consumer_waits_for_them() {
    let mut f = Foreman::new(ForemanConfig::default());
    let now = Micros::ZERO;
    for id in [1, 2] {
        f.handle_worker_joined(now, WorkerId(id), WorkerReport::default()).unwrap();
        f.handle_telemetry(
            now,
            WorkerId(id),
            Telemetry { ram_budget_bytes: 1 << 30, ..Telemetry::default() },
        );
    }
    let chain = synthetic_chain(&[1000, 1000]).unwrap();
    f.submit_job(now, Job { chain, inputs: 1, mode: Mode::Streaming }).unwrap();
    let (s0, s1) = (TaskId::new(0, 0), TaskId::new(0, 1));
    let a = settle(&mut f);
    let &(_, w0) = a.iter().find(|(t, _)| *t == s0).expect("s0 assigned");
    f.handle_task_done(now, w0, s0, true);
    let a = settle(&mut f);
    let &(_, w1) = a.iter().find(|(t, _)| *t == s1).expect("s1 assigned once s0 is done");
    assert_eq!(f.tasks_done(), 1);
    // s0's outputs are gone while s1 is in flight: s0 runs again
    f.handle_outputs_lost(now, s0);
    assert_eq!(f.tasks_done(), 0);
    let a = settle(&mut f);
    let again: Vec<WorkerId> = a.iter().filter(|(t, _)| *t == s0).map(|(_, w)| *w).collect();
    // s1's pull fails: it waits for s0 (not assigned again while s0 is not done)
    f.handle_task_done(now, w1, s1, false);
    let mut a = settle(&mut f);
    assert!(a.iter().all(|(t, _)| *t != s1), "s1 assigned before its inputs exist: {a:?}");
    let w0 = match again.first() {
        Some(w) => *w,
        None => a.iter().find(|(t, _)| *t == s0).map(|(_, w)| *w).expect("s0 assigned again"),
    };
    f.handle_task_done(now, w0, s0, true);
    a = settle(&mut f);
    let &(_, w1) = a.iter().find(|(t, _)| *t == s1).expect("s1 assigned once s0 is done again");
    f.handle_task_done(now, w1, s1, true);
    let rest: Vec<Action> = std::iter::from_fn(|| f.poll_action()).collect();
    assert!(rest.contains(&Action::JobDone), "{rest:?}");
    assert_eq!(f.tasks_done(), 2);
}

/// A consumer that cannot read its inputs (the producing worker restarted and lost them) makes
/// the producer run again and waits for it, without blaming the worker that could not read them:
/// the job completes even when this happens as often as a task may fail.
#[test]
fn inputs_lost_are_made_again_without_failing_the_job() {
    let config = ForemanConfig::default();
    let mut f = Foreman::new(config);
    let now = Micros::ZERO;
    for id in [1, 2] {
        f.handle_worker_joined(now, WorkerId(id), WorkerReport::default()).unwrap();
        f.handle_telemetry(
            now,
            WorkerId(id),
            Telemetry { ram_budget_bytes: 1 << 30, ..Telemetry::default() },
        );
    }
    let chain = synthetic_chain(&[1000, 1000]).unwrap();
    f.submit_job(now, Job { chain, inputs: 1, mode: Mode::Streaming }).unwrap();
    let (s0, s1) = (TaskId::new(0, 0), TaskId::new(0, 1));
    let mut a = settle(&mut f);
    for _ in 0..config.max_attempts.saturating_sub(1) {
        let &(_, w0) = a.iter().find(|(t, _)| *t == s0).expect("s0 assigned");
        f.handle_task_done(now, w0, s0, true);
        a = settle(&mut f);
        let &(_, w1) = a.iter().find(|(t, _)| *t == s1).expect("s1 assigned once s0 is done");
        f.handle_inputs_lost(now, w1, s1);
        assert_eq!(f.tasks_done(), 0, "s0's outputs are gone: it is not done any more");
        a = settle(&mut f);
        assert!(a.iter().all(|(t, _)| *t != s1), "s1 assigned before its inputs exist: {a:?}");
        let rest: Vec<Action> = std::iter::from_fn(|| f.poll_action()).collect();
        assert!(!rest.iter().any(|r| matches!(r, Action::JobFailed { .. })), "{rest:?}");
    }
    let &(_, w0) = a.iter().find(|(t, _)| *t == s0).expect("s0 assigned again");
    f.handle_task_done(now, w0, s0, true);
    a = settle(&mut f);
    let &(_, w1) = a.iter().find(|(t, _)| *t == s1).expect("s1 assigned once s0 is done again");
    f.handle_task_done(now, w1, s1, true);
    let rest: Vec<Action> = std::iter::from_fn(|| f.poll_action()).collect();
    assert!(rest.contains(&Action::JobDone), "{rest:?}");
    assert_eq!(f.tasks_done(), 2);
}

// ---------- simulator ----------

/// Stage sizes of a MiniLM-like 3-way cut (encoder front, encoder back, classifier head).
const MINILM_SIZES: [u64; 3] = [69_000_000, 21_000_000, 1_000];

/// Costs proportional to size: 10 ms compute per MB at speed 1 (the head gets a 1 ms floor);
/// download at 20 MB/s; warm load from disk at 200 MB/s plus 100 ms of session start-up.
fn costs_for(sizes: &[u64]) -> Vec<StageCost> {
    sizes
        .iter()
        .map(|&b| StageCost {
            compute: Micros((b / 100).max(1_000)),
            download: Micros(b / 20),
            warm_load: Micros(b / 200 + 100_000),
        })
        .collect()
}

fn crowd(speeds: &[f64], cached: &[usize]) -> Vec<SimWorker> {
    speeds
        .iter()
        .enumerate()
        .map(|(i, &speed)| SimWorker {
            id: WorkerId(i as u32 + 1),
            speed,
            telemetry: Telemetry {
                cpu_load: 0.2 + 0.1 * i as f64,
                free_ram_bytes: 1_000_000_000 + 100_000_000 * i as u64,
                ram_budget_bytes: 512_000_000,
                battery_pct: 90.0 - 5.0 * i as f64,
                temperature_c: 32.0,
                rtt_ms: 15.0 + i as f64,
            },
            cached: cached.to_vec(),
        })
        .collect()
}

fn setup(sizes: &[u64], speeds: &[f64], inputs: usize, mode: Mode) -> SimSetup {
    SimSetup {
        chain: synthetic_chain(sizes).unwrap(),
        costs: costs_for(sizes),
        workers: crowd(speeds, &[]),
        inputs,
        mode,
        hop: Micros::from_millis(10),
        task_overhead: Micros::ZERO,
        loads_are_cpu: false,
        crashes: Vec::new(),
        deliver_late_completions: true,
        foreman: ForemanConfig::default(),
    }
}

fn assert_exactly_once(s: &SimSetup) -> Micros {
    let r = simulate(s).unwrap();
    let makespan = r.makespan.expect("job finished");
    assert_eq!(r.residency_violations, 0);
    assert_eq!(r.completions.len(), s.inputs * s.chain.len());
    assert!(r.completions.values().all(|&n| n == 1), "{:?}", r.completions);
    assert!(r.answers.iter().all(|&n| n == 1), "{:?}", r.answers);
    makespan
}

#[test]
fn minilm_streaming_vs_barrier_ratios() {
    let speeds = [1.0, 1.0, 1.0, 1.0, 0.5];
    let costs = costs_for(&MINILM_SIZES);
    for inputs in [5, 20] {
        for warm in [false, true] {
            let mut st = setup(&MINILM_SIZES, &speeds, inputs, Mode::Streaming);
            let mut ba = setup(&MINILM_SIZES, &speeds, inputs, Mode::Barrier);
            if warm {
                st.workers = crowd(&speeds, &[0, 1, 2]);
                ba.workers = crowd(&speeds, &[0, 1, 2]);
            }
            let ms = assert_exactly_once(&st);
            let mb = assert_exactly_once(&ba);
            let ideal = ideal_pipeline_bound(&costs, &speeds, inputs);
            let ideal_loads = ideal_pipeline_bound_with_loads(&costs, &st.workers, inputs);
            let classic = classic_pipeline_bound(&costs, &speeds, inputs);
            println!(
                "minilm N={inputs} disk={}: streaming {:.3}s barrier {:.3}s ideal {:.3}s classic {:.3}s | \
                 streaming/barrier {:.3} streaming/ideal {:.3} streaming/classic {:.3} \
                 sim_streaming_over_ideal_with_loads {:.3}",
                if warm { "warm" } else { "cold" },
                ms.as_secs_f64(),
                mb.as_secs_f64(),
                ideal.as_secs_f64(),
                classic.as_secs_f64(),
                ms.as_secs_f64() / mb.as_secs_f64(),
                ms.as_secs_f64() / ideal.as_secs_f64(),
                ms.as_secs_f64() / classic.as_secs_f64(),
                ms.as_secs_f64() / ideal_loads.as_secs_f64(),
            );
            assert!(ms <= mb, "streaming {ms} slower than barrier {mb}");
            assert!(ms >= ideal, "makespan {ms} below the lower bound {ideal}");
            assert!(ideal_loads >= ideal);
            assert!(mb.min(ms) >= ideal_loads, "makespan below the bound with loads {ideal_loads}");
        }
    }
}

#[test]
fn jit_loads_wait_for_upstream_and_smallest_is_broadcast() {
    let s = setup(&MINILM_SIZES, &[1.0, 1.0, 0.5], 4, Mode::Streaming);
    let r = simulate(&s).unwrap();
    // The 1 KB head (stage 2) is the smallest: sent to all three workers at t = 0, not loaded.
    let sends: Vec<_> = r.actions_matching(|a| matches!(a, Action::SendStage { stage: 2, .. }));
    assert_eq!(sends.len(), 3);
    assert!(sends.iter().all(|(t, _)| *t == Micros::ZERO));
    for k in 1..3 {
        let first_load = r
            .spans
            .iter()
            .filter(|sp| matches!(sp.kind, SpanKind::Load { stage, .. } if stage == k))
            .map(|sp| sp.start)
            .min()
            .unwrap();
        let first_upstream_done = r
            .spans
            .iter()
            .filter(|sp| matches!(sp.kind, SpanKind::Compute(t) if t.stage == k - 1))
            .map(|sp| sp.end)
            .min()
            .unwrap();
        assert!(first_load >= first_upstream_done, "stage {k} loaded before any upstream completed");
    }
    // The head was on every disk already: its loads are warm.
    assert!(r.spans.iter().all(|sp| !matches!(sp.kind, SpanKind::Load { stage: 2, cold: true })));
}

#[test]
fn crash_mid_job_completes_with_logged_moves() {
    let mut s = setup(&MINILM_SIZES, &[1.0, 1.0, 1.0, 1.0, 0.5], 5, Mode::Streaming);
    s.crashes = vec![(WorkerId(2), Micros::from_millis(4_000))];
    let r = simulate(&s).unwrap();
    assert!(r.makespan.is_some());
    let moved = r.actions_matching(|a| matches!(a, Action::Reassigned { from: WorkerId(2), .. }));
    assert!(!moved.is_empty(), "worker 2 held a task at 4 s");
    assert!(r.completions.values().all(|&n| n == 1));
    assert!(r.answers.iter().all(|&n| n == 1));
    assert!(r.spans.iter().any(|sp| sp.worker == WorkerId(2) && !sp.completed));
    for (_, a) in moved {
        println!("{a}");
    }
}

#[test]
fn stage_over_budget_never_goes_there() {
    // Worker 1's budget cannot hold the 69 MB stage (1.5 x 69 MB + 16 MiB > 100 MB).
    let mut s = setup(&MINILM_SIZES, &[1.0, 1.0], 3, Mode::Streaming);
    s.workers[0].telemetry.ram_budget_bytes = 100_000_000;
    let r = simulate(&s).unwrap();
    assert!(r.makespan.is_some());
    let on_w1_stage0 = r.log.iter().any(|(_, a)| match a {
        Action::SendStage { worker, stage } | Action::Load { worker, stage } => {
            *worker == WorkerId(1) && *stage == 0
        }
        Action::Assign { task, worker, .. } => *worker == WorkerId(1) && task.stage == 0,
        _ => false,
    });
    assert!(!on_w1_stage0);
    // Only the small worker left for stage 0: the job stalls instead of breaking the budget.
    s.workers.truncate(1);
    let r = simulate(&s).unwrap();
    assert!(r.makespan.is_none());
    assert!(r.log.iter().any(|(_, a)| *a == Action::Stalled { stage: 0 }));
}

/// A crowd where every worker but one (`survivor_pick`) may crash at the given time.
fn crash_setup(
    sizes: &[u64],
    speeds: &[f64],
    inputs: usize,
    streaming: bool,
    survivor_pick: prop::sample::Index,
    crash_ms: &[Option<u64>],
) -> SimSetup {
    let mode = if streaming { Mode::Streaming } else { Mode::Barrier };
    let mut s = setup(sizes, speeds, inputs, mode);
    let survivor = survivor_pick.index(speeds.len());
    s.crashes = (0..speeds.len())
        .filter(|&i| i != survivor)
        .filter_map(|i| crash_ms[i].map(|ms| (WorkerId(i as u32 + 1), Micros::from_millis(ms))))
        .collect();
    s
}

fn sizes_strategy() -> impl Strategy<Value = Vec<u64>> {
    prop::collection::vec(1_000u64..80_000_000, 1..4)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn every_task_completes_once_under_crashes(
        sizes in sizes_strategy(),
        speeds in prop::collection::vec(0.25f64..2.0, 2..6),
        inputs in 1usize..8,
        streaming in any::<bool>(),
        survivor_pick in any::<prop::sample::Index>(),
        crash_ms in prop::collection::vec(prop::option::of(0u64..30_000), 6),
    ) {
        let s = crash_setup(&sizes, &speeds, inputs, streaming, survivor_pick, &crash_ms);
        let r = simulate(&s).unwrap();
        prop_assert!(r.makespan.is_some(), "job did not finish");
        prop_assert_eq!(r.completions.len(), inputs * sizes.len());
        prop_assert!(r.completions.values().all(|&n| n == 1));
        prop_assert!(r.answers.iter().all(|&n| n == 1));
        // Every move is followed through: the task ran on its new worker, unless that worker
        // was lost in turn and moved it again.
        for (i, (_, a)) in r.log.iter().enumerate() {
            if let Action::Reassigned { task, to, .. } = *a {
                let followed = r.log[i + 1..].iter().any(|(_, b)| match *b {
                    Action::Assign { task: t, worker, .. } => t == task && worker == to,
                    Action::Reassigned { task: t, from, .. } | Action::Requeued { task: t, from } => {
                        t == task && from == to
                    }
                    _ => false,
                });
                prop_assert!(followed, "{} moved to {} and then forgotten", task, to);
            }
        }
    }

    #[test]
    fn never_two_live_stages_on_a_worker(
        sizes in sizes_strategy(),
        speeds in prop::collection::vec(0.25f64..2.0, 2..6),
        inputs in 1usize..8,
        streaming in any::<bool>(),
        survivor_pick in any::<prop::sample::Index>(),
        crash_ms in prop::collection::vec(prop::option::of(0u64..30_000), 6),
    ) {
        let s = crash_setup(&sizes, &speeds, inputs, streaming, survivor_pick, &crash_ms);
        let r = simulate(&s).unwrap();
        // The simulated workers saw no Load arrive with a session live or loading...
        prop_assert_eq!(r.residency_violations, 0);
        // ...and replaying the action stream as a residency model agrees.
        let mut live = std::collections::BTreeMap::new();
        for (_, a) in &r.log {
            match a {
                Action::Unload { worker } => {
                    live.insert(*worker, false);
                }
                Action::Load { worker, .. } => {
                    prop_assert!(!live.get(worker).copied().unwrap_or(false), "two sessions on {}", worker);
                    live.insert(*worker, true);
                }
                _ => {}
            }
        }
    }
}

/// A random job shape: stage sizes (as cost bytes), input count.
fn random_job(rng: &mut rand::rngs::SmallRng) -> (Vec<u64>, usize) {
    use rand::Rng;
    let sizes = (0..rng.random_range(1..4)).map(|_| rng.random_range(1_000..80_000_000)).collect();
    (sizes, rng.random_range(1..10))
}

/// Streaming against barrier over `makespans` (streaming, barrier) pairs: prints how often and
/// by how much streaming was slower, and fails past `max_share_slower` of the cases, a worst
/// ratio of `max_worst`, or a mean ratio of 1.
fn assert_anomalies_bounded(
    what: &str,
    makespans: &[(Micros, Micros)],
    max_share_slower: f64,
    max_worst: f64,
) {
    let trials = makespans.len();
    let ratios: Vec<f64> = makespans.iter().map(|(ms, mb)| ms.as_secs_f64() / mb.as_secs_f64()).collect();
    let slower = makespans.iter().filter(|(ms, mb)| ms > mb).count();
    let worst = ratios.iter().copied().fold(1.0, f64::max);
    let mean = ratios.iter().sum::<f64>() / trials as f64;
    println!(
        "{what}: streaming slower than barrier in {slower}/{trials}, worst {worst:.3}, mean streaming/barrier {mean:.3}"
    );
    assert!(slower as f64 <= max_share_slower * trials as f64, "streaming slower in {slower}/{trials}");
    assert!(worst < max_worst, "worst streaming/barrier {worst}");
    assert!(mean < 1.0, "mean streaming/barrier {mean}");
}

/// One speed and no transfer cost (telemetry still differs, so ranking matters): streaming is
/// rarely slower than barrier and never by much, and neither beats the ideal bounds. It is not
/// "never slower": with one stage per worker, streaming can move a worker to another stage (one
/// more load) where barrier would not; a random-seed property test asserting "never slower"
/// failed now and then (found: 0.0005%, 2.3% and 7.2% slower). Seeded, so it fails only if a
/// policy change makes this worse; the figures it prints are the measured ones.
#[test]
fn equal_speed_streaming_is_rarely_and_slightly_slower_than_barrier() {
    use rand::{Rng, SeedableRng, rngs::SmallRng};
    let mut rng = SmallRng::seed_from_u64(11);
    // The counterexamples the old property test shrank to (sizes, speed, workers, inputs), then
    // seeded random instances.
    let mut cases: Vec<(Vec<u64>, f64, usize, usize)> = vec![
        (vec![49_255_700, 28_728_000, 28_730_500], 0.574_945_500_969_450_6, 5, 9),
        (vec![39_118_700, 44_765_600, 1_000], 0.25, 2, 5),
    ];
    for _ in 0..400 {
        let (sizes, inputs) = random_job(&mut rng);
        cases.push((sizes, rng.random_range(0.25..2.0), rng.random_range(1..6), inputs));
    }
    let mut makespans = Vec::new();
    for (sizes, speed, workers, inputs) in cases {
        let speeds = vec![speed; workers];
        let run = |mode| {
            let mut s = setup(&sizes, &speeds, inputs, mode);
            s.hop = Micros::ZERO;
            simulate(&s).unwrap().makespan.unwrap()
        };
        let (ms, mb) = (run(Mode::Streaming), run(Mode::Barrier));
        assert!(ms >= ideal_pipeline_bound(&costs_for(&sizes), &speeds, inputs));
        let with_loads = ideal_pipeline_bound_with_loads(&costs_for(&sizes), &crowd(&speeds, &[]), inputs);
        assert!(ms.min(mb) >= with_loads, "makespan below the bound with loads {with_loads}");
        makespans.push((ms, mb));
    }
    assert_anomalies_bounded("equal speeds", &makespans, 0.05, 1.15);
}

/// Heterogeneous speeds and 10 ms transfers: streaming can lose to barrier (the fastest worker
/// may sit idle while a slow one runs a whole chain; a transfer lands on the critical path), but
/// rarely and by little. Measured over 3000 seeded instances while writing this: 2.4% of them,
/// worst 1.29x. The bounds below guard against a policy change making that worse.
#[test]
fn streaming_vs_barrier_anomalies_are_rare_and_small() {
    use rand::{Rng, SeedableRng, rngs::SmallRng};
    let mut rng = SmallRng::seed_from_u64(7);
    let mut makespans = Vec::new();
    for _ in 0..400 {
        let (sizes, n) = random_job(&mut rng);
        let speeds: Vec<f64> = (0..rng.random_range(1..6)).map(|_| rng.random_range(0.25..2.0)).collect();
        let ms = simulate(&setup(&sizes, &speeds, n, Mode::Streaming)).unwrap().makespan.unwrap();
        let mb = simulate(&setup(&sizes, &speeds, n, Mode::Barrier)).unwrap().makespan.unwrap();
        makespans.push((ms, mb));
    }
    assert_anomalies_bounded("mixed speeds", &makespans, 0.05, 1.5);
}

/// The Gantt timeline is physically consistent: a worker does one thing at a time, and each
/// task starts only after its dependencies ended (1:1 in streaming, the whole previous stage in
/// barrier) on a worker whose last load was the task's stage.
#[test]
fn timeline_respects_dependencies_and_residency() {
    for mode in [Mode::Streaming, Mode::Barrier] {
        let mut s = setup(&MINILM_SIZES, &[1.0, 1.0, 1.0, 1.0, 0.5], 7, mode);
        s.crashes = vec![(WorkerId(3), Micros::from_millis(5_000))];
        let r = simulate(&s).unwrap();
        assert!(r.makespan.is_some());
        let mut by_worker: std::collections::BTreeMap<WorkerId, Vec<_>> = Default::default();
        for sp in &r.spans {
            by_worker.entry(sp.worker).or_default().push(*sp);
        }
        for spans in by_worker.values_mut() {
            spans.sort_by_key(|sp| (sp.start, sp.end));
            for pair in spans.windows(2) {
                assert!(pair[0].end <= pair[1].start, "overlap {pair:?}");
            }
            let mut loaded = None;
            for sp in spans.iter() {
                match sp.kind {
                    SpanKind::Load { stage, .. } => loaded = Some(stage),
                    SpanKind::Compute(t) => assert_eq!(loaded, Some(t.stage), "{sp:?}"),
                    SpanKind::Transfer(_) => {}
                }
            }
        }
        let done: Vec<_> = r
            .spans
            .iter()
            .filter(|sp| sp.completed)
            .filter_map(|sp| match sp.kind {
                SpanKind::Compute(t) => Some((t, sp.start, sp.end)),
                _ => None,
            })
            .collect();
        let end_of = |t: TaskId| done.iter().find(|d| d.0 == t).map(|d| d.2).unwrap();
        for &(t, start, _) in &done {
            if t.stage == 0 {
                continue;
            }
            let dep = match mode {
                Mode::Streaming => end_of(TaskId::new(t.input, t.stage - 1)),
                Mode::Barrier => (0..s.inputs).map(|i| end_of(TaskId::new(i, t.stage - 1))).max().unwrap(),
            };
            assert!(start >= dep, "{t} started at {start} before its dependency ended at {dep}");
        }
    }
}

/// Makespans of one instance family, with and without the cost rules: `(streaming, barrier)`.
struct Family {
    label: &'static str,
    new: Vec<(f64, f64)>,
    old: Vec<(f64, f64)>,
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

fn median(v: &[f64]) -> f64 {
    crate::stats::median(&mut v.to_vec())
}

fn max_of(v: &[f64]) -> f64 {
    v.iter().copied().fold(0.0, f64::max)
}

impl Family {
    fn ratios(v: &[(f64, f64)]) -> Vec<f64> {
        v.iter().map(|(s, b)| s / b).collect()
    }
    fn print(&self) {
        let (new, old) = (Self::ratios(&self.new), Self::ratios(&self.old));
        let s_gain: Vec<f64> = self.new.iter().zip(&self.old).map(|(n, o)| n.0 / o.0).collect();
        let b_gain: Vec<f64> = self.new.iter().zip(&self.old).map(|(n, o)| n.1 / o.1).collect();
        println!(
            "sim_{}: n={} streaming/barrier mean {:.3} median {:.3} max {:.3} | cost rules off: mean {:.3} \
             median {:.3} max {:.3} | streaming new/old mean {:.3} max {:.3} | barrier new/old mean {:.3} max {:.3}",
            self.label,
            new.len(),
            mean(&new),
            median(&new),
            max_of(&new),
            mean(&old),
            median(&old),
            max_of(&old),
            mean(&s_gain),
            max_of(&s_gain),
            mean(&b_gain),
            max_of(&b_gain),
        );
    }
}

fn makespans(sizes: &[u64], speeds: &[f64], n: usize, cost_aware: bool) -> (f64, f64) {
    let run = |mode| {
        let mut s = setup(sizes, speeds, n, mode);
        s.foreman.cost_aware = cost_aware;
        let r = simulate(&s).unwrap();
        assert!(r.completions.values().all(|&c| c == 1));
        r.makespan
            .unwrap_or_else(|| panic!("stuck: sizes {sizes:?} speeds {speeds:?} n {n} {mode}"))
            .as_secs_f64()
    };
    (run(Mode::Streaming), run(Mode::Barrier))
}

fn family(label: &'static str, instances: impl Iterator<Item = (Vec<u64>, Vec<f64>, usize)>) -> Family {
    let mut f = Family { label, new: Vec::new(), old: Vec::new() };
    for (sizes, speeds, n) in instances {
        f.new.push(makespans(&sizes, &speeds, n, true));
        f.old.push(makespans(&sizes, &speeds, n, false));
    }
    f
}

/// The instance families of issue 10: the 400-instance sweep (same seed and draws as
/// `streaming_vs_barrier_anomalies_are_rare_and_small`), then N = W and N = 10 W on heterogeneous
/// crowds of 2..8 workers with 2..3 stages (60 each).
fn sweep_families() -> Vec<Family> {
    use rand::{Rng, SeedableRng, rngs::SmallRng};
    let mut rng = SmallRng::seed_from_u64(7);
    let sweep: Vec<_> = (0..400)
        .map(|_| {
            let sizes: Vec<u64> =
                (0..rng.random_range(1..4)).map(|_| rng.random_range(1_000..80_000_000)).collect();
            let speeds: Vec<f64> = (0..rng.random_range(1..6)).map(|_| rng.random_range(0.25..2.0)).collect();
            let n = rng.random_range(1..10);
            (sizes, speeds, n)
        })
        .collect();
    let mut out = vec![family("sweep400", sweep.into_iter())];
    for (label, mult) in [("n_eq_w", 1), ("n_10w", 10)] {
        let mut rng = SmallRng::seed_from_u64(11);
        let inst: Vec<_> = (0..60)
            .map(|_| {
                let sizes: Vec<u64> =
                    (0..rng.random_range(2..4)).map(|_| rng.random_range(1_000..80_000_000)).collect();
                let speeds: Vec<f64> =
                    (0..rng.random_range(2..9)).map(|_| rng.random_range(0.25..2.0)).collect();
                let n = mult * speeds.len();
                (sizes, speeds, n)
            })
            .collect();
        out.push(family(label, inst.into_iter()));
    }
    out
}

/// Issue 10, item 4: the cost rules against the same families without them. The bounds were
/// set from the figures measured when the rules were written (printed by this test; see the
/// commit message), with a little slack: they guard against a change making things worse.
#[test]
fn sim_streaming_beats_barrier_with_cost_rules() {
    let families = sweep_families();
    for f in &families {
        f.print();
    }
    for f in &families {
        let new = Family::ratios(&f.new);
        let s_gain: Vec<f64> = f.new.iter().zip(&f.old).map(|(n, o)| n.0 / o.0).collect();
        // Streaming is never made slower on average by the cost rules...
        assert!(mean(&s_gain) <= 1.0, "{}: streaming new/old {}", f.label, mean(&s_gain));
        // ...beats barrier on average, and never loses much.
        assert!(mean(&new) < 1.0, "{}: mean streaming/barrier {}", f.label, mean(&new));
        assert!(max_of(&new) < 1.15, "{}: worst streaming/barrier {}", f.label, max_of(&new));
    }
    let ratio = |label| mean(&Family::ratios(&families.iter().find(|f| f.label == label).unwrap().new));
    assert!(ratio("sweep400") < 0.988, "sweep400 {}", ratio("sweep400"));
    assert!(ratio("n_eq_w") < 0.93, "n_eq_w {}", ratio("n_eq_w"));
}

/// Issue 10: with N = 25 inputs on W = 5 heterogeneous workers (the bench's quotas as speeds,
/// MiniLM-like stages on disk), streaming starts stage 1 while stage 0 still has unclaimed tasks:
/// the first stage-1 task is assigned before the last stage-0 task is claimed. With the cost rules
/// off it is not (stage 1 waited for stage 0's last claim: the barrier-like schedule of issue 10).
/// Times are simulated, from the foreman's action log.
#[test]
fn streaming_starts_stage1_before_stage0_is_all_claimed() {
    let speeds = [0.6, 0.4, 0.4, 0.2, 0.2];
    let run = |cost_aware| {
        let mut s = setup(&MINILM_SIZES, &speeds, 25, Mode::Streaming);
        s.workers = crowd(&speeds, &[0, 1, 2]);
        s.foreman.cost_aware = cost_aware;
        let r = simulate(&s).unwrap();
        assert!(r.makespan.is_some());
        assert!(r.completions.values().all(|&n| n == 1));
        // A claim is the Assign of a resident worker, or the Load/Unload decided for the task.
        let claims = |stage: usize| -> Vec<Micros> {
            r.log
                .iter()
                .filter_map(|(t, a)| match a {
                    Action::Assign { task, .. } if task.stage == stage => Some(*t),
                    _ => None,
                })
                .collect()
        };
        let first_stage1_start = *claims(1).iter().min().unwrap();
        let last_stage0_claim = r
            .log
            .iter()
            .filter_map(|(t, a)| match a {
                Action::Assign { task, .. } if task.stage == 0 => Some(*t),
                Action::Load { stage: 0, .. } => Some(*t),
                _ => None,
            })
            .max()
            .unwrap();
        (first_stage1_start, last_stage0_claim, r.makespan.unwrap())
    };
    let (first1, last0, ms) = run(true);
    println!("cost rules on: first s1 assign {first1}, last s0 claim {last0}, makespan {ms}");
    assert!(first1 < last0, "stage 1 started at {first1}, after stage 0's last claim at {last0}");
    let (first1_off, last0_off, ms_off) = run(false);
    println!("cost rules off: first s1 assign {first1_off}, last s0 claim {last0_off}, makespan {ms_off}");
    assert!(first1_off >= last0_off);
}

// ---------- learned costs ----------

#[test]
fn costs_start_from_priors_and_learn_from_completions() {
    use super::costs::{CostModel, prior_cold, prior_task, prior_warm};
    let (w1, w2, w3) = (WorkerId(1), WorkerId(2), WorkerId(3));
    let mut m = CostModel::new(&[1_000_000, 2_000_000]);
    // Priors: 10 ms per MB of compute; loads 100 ms + 5 ms per MB warm, + 50 ms per MB cold.
    assert_eq!(m.task(w1, 1), prior_task(2_000_000));
    assert_eq!(m.task(w1, 1), 20_000.0);
    assert_eq!(m.load(1, true), prior_warm(2_000_000));
    assert_eq!(m.load(1, false), prior_cold(2_000_000));
    assert_eq!(m.load(1, false), 210_000.0);
    // w1 runs s0 twice as slow as the prior; w2 twice as slow as w1.
    m.observe_task(w1, 0, 20_000.0);
    m.observe_task(w2, 0, 40_000.0);
    assert_eq!(m.task(w1, 0), 20_000.0);
    assert_eq!(m.task(w2, 0), 40_000.0);
    // An unseen worker is guessed at the reference speed; an unseen stage at its prior scaled by
    // what the seen stages showed (x2), times the worker's slowness.
    assert_eq!(m.task(w3, 0), 20_000.0);
    assert_eq!(m.task(w1, 1), 40_000.0);
    assert_eq!(m.task(w2, 1), 80_000.0);
    assert!(m.measured(w2, 0) && !m.measured(w2, 1) && !m.measured(w3, 0));
    // Moving average, weight 0.3 on the newest sample.
    m.observe_task(w1, 0, 30_000.0);
    assert!((m.task(w1, 0) - 23_000.0).abs() < 1e-6);
    // Loads: a warm load of s0 at 300 ms (prior 105 ms) scales the warm prior of s1 alike; cold
    // stays on its prior until a cold load is seen.
    m.observe_load(0, false, 300_000.0);
    assert_eq!(m.load(0, true), 300_000.0);
    assert!((m.load(1, true) - 110_000.0 * 300.0 / 105.0).abs() < 1e-6);
    assert_eq!(m.load(1, false), 210_000.0);
    // Untrusted samples are ignored.
    m.observe_task(w1, 0, f64::NAN);
    m.observe_task(w1, 0, -5.0);
    m.observe_load(1, false, f64::INFINITY);
    assert!((m.task(w1, 0) - 23_000.0).abs() < 1e-6);
    assert_eq!(m.load(1, false), 210_000.0);
    assert_eq!(m.task(w1, 7), f64::INFINITY);
}

/// The foreman feeds the model from its own `now`: a task's time is Assign to completion, a
/// load's is the decision to the report.
#[test]
fn foreman_measures_task_and_load_times_from_now() {
    let mut f = Foreman::new(ForemanConfig::default());
    let t = |s: u64| Micros::from_millis(s);
    let report = WorkerReport {
        telemetry: Telemetry { ram_budget_bytes: 1 << 30, ..Telemetry::default() },
        ..WorkerReport::default()
    };
    f.handle_worker_joined(t(0), WorkerId(1), report).unwrap();
    let chain = synthetic_chain(&[1_000_000, 2_000_000]).unwrap();
    f.submit_job(t(0), Job { chain, inputs: 2, mode: Mode::Streaming }).unwrap();
    f.handle_stage_loaded(t(700), WorkerId(1), 0, true);
    f.handle_task_done(t(750), WorkerId(1), TaskId::new(0, 0), true);
    let costs = f.predicted_costs(WorkerId(1)).unwrap();
    assert_eq!(costs.task_us[0], 50_000.0);
    // The s0 file was sent for that load: a cold load of 700 ms; s1 is guessed from its prior
    // times what s0 showed (a task 5x its prior of 10 ms; a cold load 700 / 155 of its prior).
    assert_eq!(costs.task_us[1], 100_000.0);
    assert!((costs.load_us[1] - 210_000.0 * 700.0 / 155.0).abs() < 1e-6);
}

// ---------- the bench's regime (issue 10, item 1) ----------

/// The regime of `troupe bench pipeline` as measured in one release run (README): MiniLM in 3
/// stages, compute 14.85 / 14.85 / 0.12 ms per input at full speed, warm loads 415 / 365 / 9 ms,
/// 14.8 ms of runtime overhead per task, the quotas 60/40/40/20/20 % as speeds, every stage file
/// on every disk (the bench warms the caches first). `jitter` scales each figure by a factor
/// drawn from `1 +- jitter` (seeded), for a family of nearby instances.
fn bench_regime(inputs: usize, mode: Mode, seed: u64, jitter: f64) -> SimSetup {
    use rand::{Rng, SeedableRng, rngs::SmallRng};
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut j = |x: f64| -> Micros {
        let f = if jitter > 0.0 { rng.random_range(1.0 - jitter..1.0 + jitter) } else { 1.0 };
        Micros((x * f) as u64)
    };
    let compute = [14_850.0, 14_850.0, 120.0];
    let warm = [415_000.0, 365_000.0, 9_000.0];
    let costs: Vec<StageCost> = (0..3)
        .map(|k| StageCost {
            compute: j(compute[k]),
            download: Micros::from_millis(1_283),
            warm_load: j(warm[k]),
        })
        .collect();
    let speeds = [0.6, 0.4, 0.4, 0.2, 0.2];
    let mut s = setup(&[60_000_000, 28_000_000, 100_000], &speeds, inputs, mode);
    s.costs = costs;
    s.workers = crowd(&speeds, &[0, 1, 2]);
    s.hop = Micros::ZERO;
    s.task_overhead = j(14_800.0);
    s
}

/// Makespan of the second of two jobs run on one foreman (the first teaches it the costs when
/// [`ForemanConfig::remember_costs`] is on), seconds.
fn second_job(s: &SimSetup) -> f64 {
    let (r, f) = simulate_on(s, Foreman::new(s.foreman)).unwrap();
    assert!(r.makespan.is_some());
    let (r, _) = simulate_on(s, f).unwrap();
    assert!(r.completions.values().all(|&n| n == 1) && r.completions.len() == s.inputs * 3);
    assert_eq!(r.residency_violations, 0);
    r.makespan.unwrap().as_secs_f64()
}

/// Issue 10, item 1, in the simulator: the bench's regime ([`bench_regime`]) at N = 10 W over
/// 20 nearby instances (seed 0 exact, the others jittered by 20%), the second job of two on one
/// foreman. Figures printed (`sim_` prefix: simulated, not measured); the bounds were set from
/// them with a little slack. Streaming wins in every instance with or without the plan; a plan
/// from remembered costs lifts the worst case, and eager loads the median most. (Before the
/// simulator continued the foreman's clock across jobs, the second job learned task times of
/// zero, and these figures said the plan-less streaming lost in one instance.)
#[test]
fn sim_bench_regime_stage_plan_wins() {
    let mut by_label = Vec::new();
    for (label, plan, eager, remember) in [
        ("no_plan", false, false, false),
        ("plan_cold", true, false, false),
        ("plan_remembered", true, false, true),
        ("plan_remembered_eager", true, true, true),
    ] {
        let mut ratios = Vec::new();
        let mut st = Vec::new();
        for seed in 0..20 {
            let cfg = |mode| {
                let mut s = bench_regime(50, mode, seed, if seed == 0 { 0.0 } else { 0.2 });
                s.foreman.stage_plan = plan;
                s.foreman.eager_loads = eager;
                s.foreman.remember_costs = remember;
                s
            };
            let a = second_job(&cfg(Mode::Streaming));
            let b = second_job(&cfg(Mode::Barrier));
            ratios.push(b / a);
            st.push(a);
        }
        let min = ratios.iter().copied().fold(f64::INFINITY, f64::min);
        println!(
            "sim_bench_regime N=50 {label}: sim_streaming_speedup_over_barrier median {:.3} min {min:.3} max {:.3}; \
             sim_streaming_s median {:.3} (seed 0: {:.3})",
            median(&ratios),
            max_of(&ratios),
            median(&st),
            st[0]
        );
        by_label.push((label, median(&ratios), min));
    }
    let get = |l: &str| by_label.iter().find(|x| x.0 == l).map(|x| (x.1, x.2)).unwrap();
    for l in ["plan_cold", "plan_remembered", "plan_remembered_eager"] {
        assert!(get(l).1 > 1.0, "{l}: streaming lost to barrier in some instance ({})", get(l).1);
    }
    // a plan made from costs learned in the job itself (plan_cold) comes late and gains nothing
    // in the worst case; from remembered costs it does
    for l in ["plan_remembered", "plan_remembered_eager"] {
        assert!(get(l).1 > get("no_plan").1, "{l}: worst case no better than without the plan");
    }
    assert!(get("plan_remembered_eager").0 > 1.15, "eager: median {}", get("plan_remembered_eager").0);
}

/// The steady-state plan the bench's regime gets (seed 0, costs remembered, eager loads, no start
/// plan): pipeline balancing by speed. The two 40% workers hold stage 0 (2 / 52 ms), the 60% worker and a 20% one stage 1
/// (1 / 39.6 + 1 / 89 ms), the other 20% worker the 0.1 ms head. Each loads its home stage first
/// and runs only it while it has work; a worker whose home stage is done may then join another
/// stage's tail (one more load: with the simulator's clock continued across jobs the learned
/// costs show that it pays; before, they were corrupted and such a worker idled).
#[test]
fn bench_regime_plan_balances_stages_by_speed() {
    let mut s = bench_regime(50, Mode::Streaming, 0, 0.0);
    s.foreman.eager_loads = true;
    s.foreman.start_plan = false;
    let (_, f) = simulate_on(&s, Foreman::new(s.foreman)).unwrap();
    let (r, f) = simulate_on(&s, f).unwrap();
    let plan: Vec<usize> = f.stage_plan().into_iter().map(|(_, k)| k).collect();
    assert_eq!(plan, vec![1, 0, 0, 2, 1], "homes of w1..w5 (speeds 0.6, 0.4, 0.4, 0.2, 0.2)");
    for w in 1..=5u32 {
        let mut spans: Vec<&super::sim::Span> = r.spans.iter().filter(|sp| sp.worker.0 == w).collect();
        spans.sort_by_key(|sp| sp.start);
        let loads: Vec<usize> = spans
            .iter()
            .filter_map(|sp| match sp.kind {
                SpanKind::Load { stage, .. } => Some(stage),
                _ => None,
            })
            .collect();
        let home = plan[w as usize - 1];
        assert_eq!(loads.first(), Some(&home), "w{w} loads its home stage first");
        assert!(loads.len() <= 2, "w{w} loads {loads:?}: at most one more stage after its home");
        // while the home stage has work, only it runs there
        let home_done = spans
            .iter()
            .filter(|sp| matches!(sp.kind, SpanKind::Compute(t) if t.stage == home))
            .map(|sp| sp.end)
            .max()
            .unwrap();
        for sp in &spans {
            if let SpanKind::Compute(t) = sp.kind
                && sp.start < home_done
            {
                assert_eq!(t.stage, home, "{t} ran on w{w} before its home stage {home} was done");
            }
        }
    }
}

/// A foreman's second job in the simulator runs on the foreman's clock: every task time it
/// learns there is at least the task's compute on that worker (a clock restarting at zero
/// made the times measured from an earlier `now` come out as zero).
#[test]
fn a_second_simulated_job_learns_real_task_times() {
    let s = bench_regime(50, Mode::Streaming, 0, 0.0);
    let (_, f) = simulate_on(&s, Foreman::new(s.foreman)).unwrap();
    let (r, f) = simulate_on(&s, f).unwrap();
    assert!(
        r.makespan.is_some_and(|m| m < Micros::from_millis(10_000)),
        "makespan counts from the job's start"
    );
    assert!(r.spans.iter().all(|sp| sp.start < Micros::from_millis(10_000)));
    let costs = f.learned_costs().unwrap();
    let mut checked = 0;
    for w in &s.workers {
        for k in 0..3 {
            if costs.measured(w.id, k) {
                let floor = s.costs[k].compute.0 as f64 / w.speed;
                assert!(
                    costs.task(w.id, k) >= floor,
                    "{} stage {k}: {} < {floor}",
                    w.id.0,
                    costs.task(w.id, k)
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 5, "{checked} measured (worker, stage) pairs");
}

// ---------- stage plan ----------

fn plan_worker(task_ms: &[f64], load_ms: &[f64], live: Option<usize>) -> PlanWorker {
    PlanWorker {
        task_us: task_ms.iter().map(|t| t * 1e3).collect(),
        load_us: load_ms.iter().map(|t| t * 1e3).collect(),
        fits: vec![true; task_ms.len()],
        live,
    }
}

/// Two equal stages of 10 ms at speed 1, workers of speed 1, 1, 0.5, 0.5, 100 tasks each, every
/// load 200 ms, nothing live: the balanced plan puts one fast and one slow worker on each stage
/// (1.5 speed each). `plan_cost` by hand (eager): stage 0 `(100 + 200/10 + 200/20) / (1/10 +
/// 1/20) = 866.7 ms`; stage 1's first input exists at 210 ms, so `max(866.7, 210 + 666.7,
/// 866.7 + 10) = 876.7 ms`. Stage by stage it is `2 (200 + 100 / 0.3) = 1066.7 ms`.
#[test]
fn plan_balances_throughput_and_costs_by_hand() {
    let fast = plan_worker(&[10.0, 10.0], &[200.0, 200.0], None);
    let slow = plan_worker(&[20.0, 20.0], &[200.0, 200.0], None);
    let crowd = vec![fast.clone(), fast, slow.clone(), slow];
    let plan = plan_stages(&crowd, &[100, 100], false).unwrap();
    assert_eq!(plan, vec![0, 1, 0, 1]);
    let cost = plan_cost(&crowd, &[100, 100], &plan, false);
    assert!((cost - 876_666.7).abs() < 1.0, "{cost}");
    // Unbalanced (both fast on stage 0) costs more: stage 1 runs at 1/20 + 1/20.
    assert!(plan_cost(&crowd, &[100, 100], &[0, 0, 1, 1], false) > cost);
    // A stage with work and no home is infinite; one that does not fit is refused.
    assert!(plan_cost(&crowd, &[100, 100], &[0, 0, 0, 0], false).is_infinite());
    let mut picky = crowd.clone();
    picky[0].fits = vec![true, false];
    let p = plan_stages(&picky, &[100, 100], false).unwrap();
    assert_eq!(p[0], 0, "w0 cannot hold stage 1");
    // Without loads stage by stage is as fast (`2 x 100 / 0.3`): no plan.
    let free: Vec<PlanWorker> =
        crowd.iter().map(|w| PlanWorker { load_us: vec![0.0; 2], ..w.clone() }).collect();
    assert!(plan_stages(&free, &[100, 100], false).is_none());
}

/// Loads count: a worker that holds a stage live stays there (no load); and with just-in-time
/// loads a stage-1 load starts only once the first input exists (310 ms here), so the same plan
/// costs more than with eager loads: `(60 + 2 (310 + 300) / 10) / 0.2 = 910 ms` against 610.
#[test]
fn plan_counts_loads_and_jit_delay() {
    let w = |live: Option<usize>| {
        let mut p = plan_worker(&[10.0, 10.0], &[300.0, 300.0], live);
        if let Some(l) = live {
            p.load_us[l] = 0.0;
        }
        p
    };
    let crowd = vec![w(Some(0)), w(Some(1)), w(None), w(None)];
    let plan = plan_stages(&crowd, &[60, 60], true).unwrap();
    assert_eq!((plan[0], plan[1]), (0, 1), "the live workers stay where they are: {plan:?}");
    let cold = vec![w(None); 4];
    let eager = plan_cost(&cold, &[60, 60], &[0, 1, 0, 1], false);
    let jit = plan_cost(&cold, &[60, 60], &[0, 1, 0, 1], true);
    assert!((eager - 610_000.0).abs() < 1.0 && (jit - 910_000.0).abs() < 1.0, "jit {jit} eager {eager}");
}

/// Remembered costs: the second job on one foreman has a plan from its submission, and with
/// the start plan (the default) or eager loads every worker starts loading its home stage at
/// t = 0 (stage 1 included; stage 2 too with eager loads, where the start plan may leave it to
/// workers that move on), where just in time without a start plan only stage-0 loads happen
/// before the first completion.
#[test]
fn remembered_costs_plan_at_submit_and_eager_loads_start_at_once() {
    for (start, eager) in [(false, false), (false, true), (true, false)] {
        let mut s = bench_regime(50, Mode::Streaming, 0, 0.0);
        s.foreman.eager_loads = eager;
        s.foreman.start_plan = start;
        let eager = eager || start;
        let (_, f) = simulate_on(&s, Foreman::new(s.foreman)).unwrap();
        let (r, f) = simulate_on(&s, f).unwrap();
        assert!(!f.stage_plan().is_empty());
        let at_zero: Vec<usize> = r
            .log
            .iter()
            .filter_map(|(t, a)| match a {
                Action::Load { stage, .. } if *t == Micros::ZERO => Some(*stage),
                _ => None,
            })
            .collect();
        if eager {
            assert_eq!(at_zero.len(), 5, "{at_zero:?}");
            // the start plan may leave the last stage to workers that move on to it
            assert!(at_zero.contains(&1) && (start || at_zero.contains(&2)), "{at_zero:?}");
        } else {
            assert!(at_zero.iter().all(|&k| k == 0), "{at_zero:?}");
        }
    }
    // Without memory the first job of a fresh foreman has no plan at t = 0: only stage 0 loads.
    let mut s = bench_regime(50, Mode::Streaming, 0, 0.0);
    s.foreman.eager_loads = true;
    let r = simulate(&s).unwrap();
    assert!(r.log.iter().any(|(t, a)| *t == Micros::ZERO && matches!(a, Action::Load { stage: 0, .. })));
    assert!(!r.log.iter().any(|(t, a)| *t == Micros::ZERO && matches!(a, Action::Load { stage: 1 | 2, .. })));
}

/// B*(N) ([`super::bound::lower_bound`]) never exceeds a schedule the simulator produces on the
/// same costs, with loads charged as CPU at each worker's speed (`loads_are_cpu`), in either mode,
/// the first or the second job of a foreman (costs remembered), with transfers and per-task
/// overhead on top; over seeded random instances. The capacity is the quotas' sum (the
/// simulator's workers never share a core), so the capacity term is checked by hand in
/// `bound.rs`. It also checks that the bound is not vacuous: within 40x of every makespan.
#[test]
fn cpu_bound_never_exceeds_a_simulated_schedule() {
    use super::bound::{CpuCosts, lower_bound};
    use rand::{Rng, SeedableRng, rngs::SmallRng};
    let mut rng = SmallRng::seed_from_u64(44);
    for case in 0..150 {
        let stages = rng.random_range(1..5);
        let sizes: Vec<u64> = (0..stages).map(|_| rng.random_range(1_000..80_000_000)).collect();
        let speeds: Vec<f64> = (0..rng.random_range(1..6)).map(|_| rng.random_range(0.1..1.0)).collect();
        let inputs = rng.random_range(1..40);
        let mut costs = costs_for(&sizes);
        for c in &mut costs {
            c.compute = Micros(rng.random_range(500..60_000));
            c.warm_load = Micros(rng.random_range(1_000..600_000));
        }
        let cached: Vec<usize> = (0..stages).filter(|_| rng.random_bool(0.7)).collect();
        let cpu = CpuCosts {
            task: costs.iter().map(|c| c.compute).collect(),
            load: costs.iter().map(|c| c.warm_load).collect(),
        };
        let sum: f64 = speeds.iter().sum();
        let bound = lower_bound(&cpu, &speeds, sum, inputs).unwrap();
        for mode in [Mode::Streaming, Mode::Barrier] {
            let mut s = setup(&sizes, &speeds, inputs, mode);
            s.costs = costs.clone();
            s.workers = crowd(&speeds, &cached);
            s.loads_are_cpu = true;
            s.hop = Micros(rng.random_range(0..5_000));
            s.task_overhead = Micros(rng.random_range(0..2_000));
            s.foreman.remember_costs = true;
            let (first, f) = simulate_on(&s, Foreman::new(s.foreman)).unwrap();
            let (second, _) = simulate_on(&s, f).unwrap();
            for r in [first, second] {
                let m = r.makespan.unwrap();
                assert!(bound <= m, "case {case} {mode:?}: bound {bound} above the makespan {m}");
                assert!(
                    m.0 <= 40 * bound.0.max(1),
                    "case {case} {mode:?}: bound {bound} vacuous next to {m}"
                );
            }
        }
    }
}

/// The bench's regime in the simulator: stages of the given task and load CPU (µs at full
/// speed) on workers at the given quotas, loads as CPU, every file on disk; a barrier job, then
/// a streaming one (each worker's task and load times learned, as the bench's earlier runs teach
/// them), then the measured streaming job of `n` inputs. Its makespan and B*, µs.
fn quota_regime(task: &[u64], load: &[u64], speeds: &[f64], n: usize, start: bool) -> (f64, f64) {
    use super::bound::{CpuCosts, lower_bound};
    let (r, stages) = (quota_regime_run(task, load, speeds, n, start), task.len());
    assert!(r.completions.values().all(|&c| c == 1) && r.completions.len() == stages * n);
    assert_eq!(r.residency_violations, 0);
    let cpu = CpuCosts {
        task: task.iter().map(|&t| Micros(t)).collect(),
        load: load.iter().map(|&l| Micros(l)).collect(),
    };
    (r.makespan.unwrap().0 as f64, lower_bound(&cpu, speeds, speeds.iter().sum(), n).unwrap().0 as f64)
}

/// The run behind [`quota_regime`]: the measured streaming job's result.
fn quota_regime_run(
    task: &[u64],
    load: &[u64],
    speeds: &[f64],
    n: usize,
    start: bool,
) -> super::sim::SimReport {
    let stages = task.len();
    let mut s = setup(&vec![10_000_000; stages], speeds, n, Mode::Streaming);
    s.costs = (0..stages)
        .map(|k| StageCost { compute: Micros(task[k]), download: Micros(5_000), warm_load: Micros(load[k]) })
        .collect();
    s.workers = crowd(speeds, &(0..stages).collect::<Vec<_>>());
    s.loads_are_cpu = true;
    s.hop = Micros::ZERO;
    s.foreman.start_plan = start;
    let barrier = SimSetup { mode: Mode::Barrier, ..s.clone() };
    let (_, f) = simulate_on(&barrier, Foreman::new(s.foreman)).unwrap();
    let (_, f) = simulate_on(&s, f).unwrap();
    simulate_on(&s, f).unwrap().0
}

/// The start plan's moves, carried out by the foreman: on MiniLM's costs at N = W some worker
/// loads stage 0 at t = 0 and later a stage downstream; that second load comes only once every
/// stage-0 task is assigned, and the worker then runs tasks of the new stage. Every load at t = 0
/// is a worker's home, and no worker loads more than twice.
#[test]
fn a_worker_moves_on_once_its_home_is_all_claimed() {
    let r = quota_regime_run(
        &[1_670, 15_670, 16_570],
        &[45_600, 53_300, 52_500],
        &[0.39, 0.26, 0.26, 0.13, 0.13],
        5,
        true,
    );
    let mut moved = 0;
    for w in 1..=5u32 {
        let loads: Vec<(Micros, usize)> = r
            .log
            .iter()
            .filter_map(|(t, a)| match a {
                Action::Load { worker, stage } if worker.0 == w => Some((*t, *stage)),
                _ => None,
            })
            .collect();
        assert!(loads.len() <= 2, "w{w}: {loads:?}");
        let (Some(&(t0, home)), Some(&(t1, next))) = (loads.first(), loads.get(1)) else { continue };
        assert_eq!(t0, Micros::ZERO, "w{w} loads its home at the start");
        assert!(next > home, "w{w} moves downstream: {loads:?}");
        let last_home_assign = r
            .log
            .iter()
            .filter(|(_, a)| matches!(a, Action::Assign { task, .. } if task.stage == home))
            .map(|(t, _)| *t)
            .max()
            .unwrap();
        assert!(
            t1 >= last_home_assign,
            "w{w} loads {next} at {t1} before stage {home} is all claimed ({last_home_assign})"
        );
        assert!(
            r.log.iter().any(|(t, a)| *t >= t1
                && matches!(a, Action::Assign { task, worker, .. } if worker.0 == w && task.stage == next)),
            "w{w} runs none of stage {next}"
        );
        moved += 1;
    }
    assert!(moved >= 1, "no worker moved on");
}

/// Issue 44, item 1, in the simulator ([`quota_regime`]): the bench's two cases on their
/// measured costs at N = W, 2W, 5W, 10W. MiniLM: task CPU 0.1 / 14.1 / 15.0 ms plus 1.57 ms of
/// runtime CPU, loads 45.6 / 53.3 / 52.5 ms, quotas 39/26/26/13/13 %. all-mpnet-base-v2: task
/// CPU 2.3 / 22.2 / 21.1 / 19.0 ms plus 3 ms, loads 119 / 221 / 218 / 196 ms, quotas 45/30/30/15
/// %. With the start plan every worker loads the home a replay of the plans gave it at t = 0,
/// (some moving on to a later stage once their home is all claimed), and the makespan is within
/// 1.15x B* at every N (1.03-1.13x; `sim_` figures printed); just in time (stage 0 first
/// everywhere, the steady-state plan once all hold a stage) is over 10 % longer at N = W (up to
/// 2.2x B*), and never shorter by more than 1 %.
#[test]
fn start_plan_brings_the_bench_regimes_near_the_bound() {
    let minilm = ([1_670u64, 15_670, 16_570].as_slice(), [45_600u64, 53_300, 52_500].as_slice());
    let large =
        ([5_300u64, 25_200, 24_100, 22_000].as_slice(), [119_000u64, 221_000, 218_000, 196_000].as_slice());
    let cases = [
        ("minilm", minilm, vec![0.39, 0.26, 0.26, 0.13, 0.13]),
        ("large", large, vec![0.45, 0.30, 0.30, 0.15]),
    ];
    for (name, (task, load), speeds) in cases {
        for m in [1, 2, 5, 10] {
            let n = m * speeds.len();
            let (with, bound) = quota_regime(task, load, &speeds, n, true);
            let (without, _) = quota_regime(task, load, &speeds, n, false);
            eprintln!(
                "sim_ {name} N = {m} W: start plan {:.3} s ({:.2} B*), just in time {:.3} s ({:.2} B*)",
                with / 1e6,
                with / bound,
                without / 1e6,
                without / bound
            );
            assert!(with / bound <= 1.15, "{name} N = {m} W: {:.2} B*", with / bound);
            assert!(with <= 1.01 * without, "{name} N = {m} W: start plan {with} above {without}");
            if m == 1 {
                assert!(with < 0.9 * without, "{name} N = W: start plan {with} vs {without}");
            }
        }
    }
}

//! Pipeline over real processes: a foreman in the test process, 3 workers as `troupe node`
//! processes on loopback, MiniLM in 3 stages on ONNX Runtime; outputs vs the whole model.

use troupe::actors::pipeline::{SpanKind, StageFile, build_job};
use troupe::policy::pipeline::Mode;
use troupe::workloads::pipeline::local::{LocalCluster, WorkerSpec};
use troupe::workloads::pipeline::memory::{PEAK_ABOVE_FLOOR_OVER_STAGE_GOAL, worker_memory};
use troupe::workloads::pipeline::{final_vector, load_job, minilm_stages, tokenize_batches};
use troupe_tests::pipeline::{
    SENTENCES, max_abs_error, sentences, settings, whole_model, whole_model_on, within, workdir,
};

/// `n` different sentences of 12 words (distinct activations, so compression cannot hide them).
fn varied_sentences(n: usize) -> Vec<String> {
    const WORDS: [&str; 16] = [
        "river", "stone", "music", "bright", "quiet", "seven", "garden", "engine", "market", "winter",
        "teacher", "orange", "bridge", "signal", "forest", "window",
    ];
    let mut x = 0x2545_f491u32;
    (0..n)
        .map(|_| {
            (0..12)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    WORDS[(x % 16) as usize]
                })
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect()
}

/// Idle RSS cap of a worker process in this (unoptimised, larger) test build: the floor
/// measured here plus some margin; the bench measures the release build against 45 MB.
const IDLE_RSS_CAP_MB: u64 = 64;

fn exe() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_BIN_EXE_troupe-node"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chained_outputs_equal_the_whole_model_and_workers_never_hold_two_sessions() {
    let dir = workdir("chain");
    let job = load_job(&minilm_stages().unwrap(), &sentences(), Mode::Streaming, false).unwrap();
    let specs: Vec<WorkerSpec> =
        (1..=3).map(|i| WorkerSpec::new(&format!("worker-{i}"), 100, &dir)).collect();
    let cluster = LocalCluster::start(&exe(), &dir, &specs).await.unwrap();
    let outcome = within("streaming job", cluster.run(job, settings(3), None)).await;
    // A second job, in barrier mode, of one input of 96 sentences: its activations are above
    // 1 MiB even compressed, so they travel by reference (pulled by hash over QUIC).
    let big_input = tokenize_batches(&varied_sentences(96), 1, 96).unwrap();
    let stages = minilm_stages().unwrap().iter().map(|p| StageFile::from_path(p).unwrap()).collect();
    let big_job = build_job(stages, big_input.clone(), Mode::Barrier, false).unwrap();
    let big = within("by-reference job", cluster.run(big_job, settings(3), None)).await;
    cluster.shutdown().await;
    let outcome = outcome.unwrap();
    let big = big.unwrap();
    // Activations go from the worker that made them to the one that reads them, by reference
    // (pulled by hash over QUIC, or read off its own shelf): none through the foreman.
    for (name, o) in [("streaming", &outcome), ("barrier", &big)] {
        let a = o.activations;
        assert!(a.worker_to_worker + a.same_worker > 0, "{name}: no activation went by reference: {a:?}");
        assert_eq!(a.via_foreman, 0, "{name}: the foreman carried activations: {a:?}");
        assert!(a.outputs_to_foreman > 0, "{name}: no answer reached the foreman: {a:?}");
    }
    let reference = whole_model_on(&big_input[0]);
    let got = final_vector(&big.outputs[0]).unwrap();
    assert_eq!(got.len(), reference.len());
    let err = got.iter().zip(&reference).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(err <= 1e-5, "by-reference job vs whole model: max abs error {err}");
    let err = max_abs_error(&outcome, &whole_model(&sentences()));
    assert!(err <= 1e-5, "chained vs whole model: max abs error {err}");
    // Residency, from each worker's own report: never two live sessions at once.
    assert_eq!(outcome.workers.len(), 3);
    let mut loads = 0;
    for w in &outcome.workers {
        let stats = w.stats.unwrap_or_else(|| panic!("{} sent no final report", w.node));
        assert!(
            stats.max_live_sessions <= 1,
            "{}: {} sessions live at once",
            w.node,
            stats.max_live_sessions
        );
        assert_eq!(
            stats.refused_loads, 0,
            "{}: the foreman asked for a load while a session was live",
            w.node
        );
        loads += stats.loads;
    }
    // 3 stages need at least 3 loads; every task ran once.
    assert!(loads >= 3, "{loads} loads");
    // Each load and each run reports the CPU it took on the worker's thread clock (the bench's
    // in-run bound is made of them): some, and no more than the span the foreman saw around it.
    for sp in &outcome.spans {
        if let SpanKind::Load { stage, cpu_micros, .. } = sp.kind {
            let wall_us = (sp.end - sp.start) * 1e6;
            assert!(cpu_micros > 0, "load of stage {stage} on worker {} reported no CPU", sp.worker);
            assert!(
                cpu_micros as f64 <= wall_us,
                "load of stage {stage}: {cpu_micros} µs CPU in {wall_us:.0} µs"
            );
        }
    }
    for t in &outcome.task_times {
        assert!(t.reported.compute_cpu_micros > 0, "task {:?} reported no compute CPU", t.task);
    }
    // A phone-weight worker, from each real worker process's own figures: its RSS when it
    // joined (runtime and ONNX Runtime loaded, no stage) under a cap, and its peak over the
    // job above that floor at most 1.3x the largest stage file it pulled or loaded (a stage
    // file held twice at its pull breaks it).
    for m in worker_memory(&outcome) {
        let idle = m.idle_rss.unwrap_or_else(|| panic!("{}: no idle RSS at join", m.node));
        assert!(
            idle <= IDLE_RSS_CAP_MB << 20,
            "{}: idle RSS {} MiB, cap {IDLE_RSS_CAP_MB}",
            m.node,
            idle >> 20
        );
        let r =
            m.peak_above_floor_over_stage().unwrap_or_else(|| panic!("{}: no peak or stage: {m:?}", m.node));
        assert!(
            r <= PEAK_ABOVE_FLOOR_OVER_STAGE_GOAL,
            "{}: peak above idle is {r:.2}x its largest stage: {m:?}",
            m.node
        );
    }
    assert_eq!(outcome.workers.iter().map(|w| w.tasks).sum::<usize>(), SENTENCES.len() * 3);
    let _ = std::fs::remove_dir_all(&dir);
}

//! Warm restart of the pipeline foreman: the fault switch panics the foreman's scheduler actor
//! twice mid-job; its supervisor restarts it, the new incarnation joins the workers again and
//! resubmits only the inputs not answered yet. Every input is answered once, and the outputs
//! equal the whole model's. (Its own test binary: the fault switch and the foreman node live in
//! the test process.)

use troupe::actors::pipeline::FAULT_SITE;
use troupe::policy::pipeline::Mode;
use troupe::policy::{FaultPlan, SiteRule};
use troupe::workloads::pipeline::local::{LocalCluster, WorkerSpec};
use troupe::workloads::pipeline::{load_job, minilm_stages};
use troupe_tests::pipeline::{max_abs_error, sentences, settings, whole_model, within, workdir};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_foreman_panicking_mid_job_is_restarted_and_answers_every_input_once() {
    let dir = workdir("warm");
    let inputs: Vec<String> = (0..6).flat_map(|_| sentences()).collect();
    let job = load_job(&minilm_stages().unwrap(), &inputs, Mode::Streaming, false).unwrap();
    let specs: Vec<WorkerSpec> =
        (1..=3).map(|i| WorkerSpec::new(&format!("worker-{i}"), 100, &dir)).collect();
    let exe = std::path::PathBuf::from(env!("CARGO_BIN_EXE_troupe-node"));
    let cluster = LocalCluster::start(&exe, &dir, &specs).await.unwrap();
    // the foreman's 30th input, then 40 inputs later: both while tasks are in flight
    let rule = SiteRule { after: Some(30), every: 40, probability: 0.0, times: 2 };
    troupe::actors::fault::install(FaultPlan::new(1).with_site(FAULT_SITE, rule));
    let outcome = within("job with two foreman panics", cluster.run(job, settings(3), None)).await;
    let (hits, fired) = troupe::actors::fault::counts(FAULT_SITE);
    troupe::actors::fault::install(FaultPlan::default());
    cluster.shutdown().await;
    let outcome = outcome.unwrap();
    for line in &outcome.log {
        eprintln!("{line}");
    }
    assert_eq!(fired, 2, "the fault switch fired twice ({hits} foreman inputs)");
    assert!(
        outcome.log.iter().any(|l| l.contains("foreman restarted (incarnation 2)")),
        "the last incarnation is the third"
    );
    assert_eq!(outcome.outputs.len(), inputs.len());
    assert!(outcome.outputs.iter().all(|o| !o.is_empty()), "every input answered");
    let err = max_abs_error(&outcome, &whole_model(&inputs));
    assert!(err <= 1e-5, "after two foreman restarts: max abs error {err}");
    let _ = std::fs::remove_dir_all(&dir);
}

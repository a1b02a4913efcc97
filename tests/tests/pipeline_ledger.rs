//! The pipeline job's ledger on a real journal file and a real MiniLM job: an answer survives a
//! reopen, a second answer is dropped, and a journal is never replayed against another job.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use troupe::actors::pipeline::Ledger;
use troupe::kernels::onnx::NamedTensor;
use troupe::policy::pipeline::Mode;
use troupe::workloads::pipeline::{load_job, minilm_stages};
use troupe_tests::pipeline::sentences;

#[test]
fn answers_survive_a_reopen_once_each_and_another_job_is_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("foreman.journal");
    let job = load_job(&minilm_stages().unwrap(), &sentences(), Mode::Streaming, false).unwrap();
    let out = vec![NamedTensor::f32("sentence_embedding", vec![1, 3], vec![0.25, -1.5, 3.0e-7])];

    let (mut ledger, first) = Ledger::open(&path, &job).unwrap();
    assert!(!first.resumed, "a new journal is a new job");
    assert!(ledger.answer(2, &out).unwrap(), "the first answer counts");
    assert!(!ledger.answer(2, &out).unwrap(), "a second answer of input 2 is dropped");
    drop(ledger);

    let (ledger, again) = Ledger::open(&path, &job).unwrap();
    assert!(again.resumed && again.answered == 1 && again.damage.is_none(), "{again:?}");
    assert_eq!(ledger.answers()[2].as_deref(), Some(out.as_slice()), "bit-exact after the reopen");
    assert!(ledger.answers().iter().enumerate().all(|(i, a)| a.is_some() == (i == 2)));
    drop(ledger);

    let other: Vec<String> = sentences().into_iter().rev().collect();
    let other = load_job(&minilm_stages().unwrap(), &other, Mode::Streaming, false).unwrap();
    let e = Ledger::open(&path, &other).unwrap_err().to_string();
    assert!(e.contains("belongs to another job") && e.contains("foreman.journal"), "{e}");
}

//! `troupe coe request`: send a user's input to a serving coe scheduler (`serve = true`) over
//! QUIC and print the answer as JSON; with `--count`, an open-loop load at `--rate` that
//! reports p50/p99 latency and how many requests were answered busy.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use troupe_actors::coe::app::INPUT_WIDTH;
use troupe_actors::coe::requests::{CoeAnswer, CoeClient, RequestError};
use troupe_policy::coe::ExpertId;
use troupe_policy::stats::quantile;

/// Largest input file read (64 numbers as JSON fit many times over).
pub const MAX_INPUT_FILE_BYTES: u64 = 64 << 10;
/// Most requests one open-loop run may send.
pub const MAX_COUNT: usize = 100_000;

/// Arguments of `troupe coe request`.
#[derive(clap::Args, Debug)]
pub struct RequestArgs {
    /// The serving scheduler's node address (`IP:port` or `host:port`).
    #[arg(long, value_parser = troupe_actors::address::parse_resolved)]
    pub node: std::net::SocketAddr,
    /// Keys folder of that cluster.
    #[arg(long, default_value = "keys")]
    pub keys: PathBuf,
    /// Identity to send as, from the keys folder: a certificate with the client role
    /// (`troupe keys node client --role client --keys DIR`).
    #[arg(long = "as", default_value = "client")]
    pub as_name: String,
    /// The input: a JSON array of 64 numbers (an 8x8 image, values in 0..1).
    #[arg(long)]
    pub input: PathBuf,
    /// Entry (preliminary) expert id; default the app's first.
    #[arg(long)]
    pub root: Option<u32>,
    /// Longest one request may wait for its answer, seconds.
    #[arg(long, default_value_t = 120)]
    pub timeout_s: u64,
    /// Open-loop load: send this many requests (at `--rate`), report latency and busy answers.
    #[arg(long)]
    pub count: Option<usize>,
    /// Arrivals per second of the open-loop load (evenly spaced, not waiting for answers).
    #[arg(long, default_value_t = 10.0)]
    pub rate: f64,
    /// With `--count`: write one JSON line per request here (its answer or `busy`).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// Reads an input file: a JSON array of exactly [`INPUT_WIDTH`] finite numbers.
pub fn read_input(path: &Path) -> Result<Vec<f32>> {
    let meta = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    if meta.len() > MAX_INPUT_FILE_BYTES {
        bail!("{}: {} bytes, above the cap of {MAX_INPUT_FILE_BYTES}", path.display(), meta.len());
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let values: Vec<f64> = serde_json::from_str(&text)
        .with_context(|| format!("{}: not a JSON array of {INPUT_WIDTH} numbers", path.display()))?;
    if values.len() != INPUT_WIDTH {
        bail!("{}: {} numbers, an input has {INPUT_WIDTH}", path.display(), values.len());
    }
    let floats: Vec<f32> = values.into_iter().map(|v| v as f32).collect();
    if let Some(i) = floats.iter().position(|v| !v.is_finite()) {
        bail!("{}: number {i} is not a finite 32-bit float", path.display());
    }
    Ok(floats)
}

/// One answer as JSON.
fn answer_json(a: &CoeAnswer) -> serde_json::Value {
    let outputs: serde_json::Map<String, serde_json::Value> =
        a.outputs.iter().map(|(e, q)| (e.0.to_string(), serde_json::json!(q))).collect();
    serde_json::json!({
        "request": a.request,
        "digest": format!("{:016x}", a.digest),
        "experts": a.outputs.keys().map(|e| e.0).collect::<Vec<u32>>(),
        "outputs": outputs,
    })
}

/// Runs `troupe coe request`.
pub async fn run(args: RequestArgs) -> Result<()> {
    let pixels = read_input(&args.input)?;
    let id = troupe_transport::NodeIdentity::load(&args.keys, &args.as_name).with_context(|| {
        format!(
            "loading identity {} from {}; make one with `troupe keys node {} --role client --keys {}`",
            args.as_name,
            args.keys.display(),
            args.as_name,
            args.keys.display()
        )
    })?;
    let client = CoeClient::connect(&id, args.node).await?;
    let root = args.root.map(ExpertId);
    let timeout = Duration::from_secs(args.timeout_s.max(1));
    match args.count {
        None => {
            let answer = client.request(root, &pixels, timeout).await;
            client.close().await;
            println!("{}", answer_json(&answer?));
            Ok(())
        }
        Some(count) => open_loop(Arc::new(client), root, pixels, timeout, count, &args).await,
    }
}

/// What one request of an open-loop run came to.
enum Outcome {
    Answered(CoeAnswer, Duration),
    Busy,
    Failed(String),
}

/// Sends `count` requests at `rate` per second without waiting for answers, then reports.
async fn open_loop(
    client: Arc<CoeClient>,
    root: Option<ExpertId>,
    pixels: Vec<f32>,
    timeout: Duration,
    count: usize,
    args: &RequestArgs,
) -> Result<()> {
    if count == 0 || count > MAX_COUNT {
        bail!("--count must be between 1 and {MAX_COUNT}");
    }
    if !(args.rate.is_finite() && args.rate > 0.0) {
        bail!("--rate must be a positive number of requests per second");
    }
    let pixels: Arc<[f32]> = pixels.into();
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::with_capacity(count);
    let bar = crate::progress::bar(count as u64, "coe requests");
    for i in 0..count {
        // arrival i at i / rate: the schedule, not a wait for anything
        tokio::time::sleep_until(start + Duration::from_secs_f64(i as f64 / args.rate)).await;
        let (client, pixels, bar) = (client.clone(), pixels.clone(), bar.clone());
        tasks.push(tokio::spawn(async move {
            let sent = Instant::now();
            let outcome = match client.request(root, &pixels, timeout).await {
                Ok(a) => Outcome::Answered(a, sent.elapsed()),
                Err(RequestError::Busy(_)) => Outcome::Busy,
                Err(e) => Outcome::Failed(e.to_string()),
            };
            bar.inc(1);
            outcome
        }));
    }
    let mut outcomes = Vec::with_capacity(count);
    for t in tasks {
        outcomes.push(t.await.unwrap_or_else(|e| Outcome::Failed(e.to_string())));
    }
    bar.finish_and_clear();
    let wall = start.elapsed().as_secs_f64();
    if let Ok(c) = Arc::try_unwrap(client) {
        c.close().await;
    }
    let mut lines = String::new();
    let mut latencies_ms = Vec::new();
    let (mut busy, mut failed) = (0usize, Vec::new());
    let mut digests = std::collections::BTreeSet::new();
    for (i, o) in outcomes.iter().enumerate() {
        let line = match o {
            Outcome::Answered(a, took) => {
                latencies_ms.push(took.as_secs_f64() * 1e3);
                digests.insert(format!("{:016x}", a.digest));
                serde_json::json!({ "i": i, "request": a.request, "digest": format!("{:016x}", a.digest), "ms": took.as_secs_f64() * 1e3 })
            }
            Outcome::Busy => {
                busy += 1;
                serde_json::json!({ "i": i, "busy": true })
            }
            Outcome::Failed(e) => {
                failed.push(e.clone());
                serde_json::json!({ "i": i, "error": e })
            }
        };
        lines.push_str(&line.to_string());
        lines.push('\n');
    }
    if let Some(out) = &args.out {
        std::fs::write(out, lines).with_context(|| format!("writing {}", out.display()))?;
    }
    let answered = latencies_ms.len();
    let mut pct = |q: f64| if latencies_ms.is_empty() { 0.0 } else { quantile(&mut latencies_ms, q) };
    let (p50, p99) = (pct(0.5), pct(0.99));
    println!(
        "{}",
        serde_json::json!({
            "rate_rps": args.rate,
            "count": count,
            "answered": answered,
            "busy": busy,
            "failed": failed.len(),
            "p50_ms": p50,
            "p99_ms": p99,
            "wall_s": wall,
            "digests": digests,
        })
    );
    if let Some(e) = failed.first() {
        bail!("{} of {count} requests failed; the first: {e}", failed.len());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).expect("writing a test file");
        p
    }

    #[test]
    fn input_files_are_64_finite_numbers_and_other_files_are_refused_by_name() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let ok: Vec<f64> = (0..INPUT_WIDTH).map(|i| i as f64 / 64.0).collect();
        let good = file(tmp.path(), "good.json", &serde_json::to_string(&ok).expect("json"));
        assert_eq!(read_input(&good).expect("a good input")[63], 63.0 / 64.0);
        let short = file(tmp.path(), "short.json", "[0.5, 0.25]");
        let e = read_input(&short).unwrap_err().to_string();
        assert!(e.contains("short.json") && e.contains("2 numbers"), "{e}");
        let text = file(tmp.path(), "text.json", "{\"input\": 1}");
        assert!(read_input(&text).unwrap_err().to_string().contains("not a JSON array"));
        let big = file(tmp.path(), "big.json", &" ".repeat(MAX_INPUT_FILE_BYTES as usize + 1));
        assert!(read_input(&big).unwrap_err().to_string().contains("above the cap"));
        let huge = file(tmp.path(), "huge.json", &format!("[0{}, 1e39]", ", 0".repeat(INPUT_WIDTH - 2)));
        let e = read_input(&huge).unwrap_err().to_string();
        assert!(e.contains("number 63 is not a finite 32-bit float"), "{e}");
    }
}

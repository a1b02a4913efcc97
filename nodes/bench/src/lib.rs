//! `troupe bench ...`: baseline and ours in one run on the same machine, reported as ratios in a
//! table and as one flat JSON object (name -> number). Called by the binary (`troupe-cli`); the
//! benches' percentiles are [`troupe_policy::stats`]', their plots [`troupe::chart`]'s.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Subcommand;

pub mod coadapt;
pub mod coe;
pub mod kernels;
pub mod peer;
pub mod pipeline;
pub mod pipeline_memory;
pub mod transport;

/// Which benchmark to run.
#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Across a second process: QUIC, TCP and same-host goodput, remote ask vs UDP round trip,
    /// remote tell, restart to service; locally tell vs mpsc and rkyv vs memcpy.
    Transport {
        /// Write the figures as one flat JSON object here.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Smaller run (fewer frames and asks) for smoke tests.
        #[arg(long)]
        quick: bool,
    },
    /// GEMM vs measured peak, MoE FFN, ONNX session creation, disk tier vs O_DIRECT.
    Kernels {
        /// Write the figures as one flat JSON object here.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Folder on the disk under test for the disk figures (default .cache/bench).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Leave out the ONNX session figure, which needs scripts/setup's MiniLM (a GPU machine
        /// that was sent only the binary has no models).
        #[arg(long)]
        no_onnx: bool,
    },
    /// CoE serving: FCFS+LRU vs ours and each mechanism alone, on one trace.
    Coe {
        /// Write the figures as one flat JSON object here.
        #[arg(long)]
        json: Option<PathBuf>,
        /// `ci` (real execution) or `paper` (simulated with latencies profiled here).
        #[arg(long, default_value = "ci")]
        scale: String,
        /// App folder (default .cache/coe/SCALE).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Where to write the SVG plot.
        #[arg(long, default_value = "target/bench-coe.svg")]
        svg: PathBuf,
        /// Serve every combination for real even at paper scale (FCFS+LRU takes many minutes).
        #[arg(long)]
        real: bool,
        /// Sweep device budgets 5/10/20/40% x Zipf skews 0.6/1.0/1.4 (FCFS+LRU, the paper's
        /// two-stage, ours at each point), plus a bounded reorder window and an open-loop rate.
        #[arg(long)]
        sweep: bool,
        /// Workload knobs (expert count and sizes apply when the app is generated).
        #[command(flatten)]
        knobs: troupe::workloads::coe::KnobArgs,
        /// ONNX Runtime intra-op threads of the CPU executor's sessions (the GPU stand-in keeps 1).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
        cpu_threads: u16,
        /// Run the CPU executor's experts in the kernels' MLP engine instead of ONNX Runtime.
        #[arg(long)]
        cpu_mlp: bool,
        /// Serve FCFS+LRU, the paper's two-stage and ours only, not the two one-mechanism
        /// ablations (sched-only, evict-only: minutes each at paper scale).
        #[arg(long, conflicts_with = "sweep")]
        skip_ablation: bool,
    },
    /// Pipeline (CROWDio): worker peak RSS vs whole model, streaming vs barrier, loads, wire bytes.
    Pipeline {
        /// Write the figures as one flat JSON object here.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Gantt chart of the streaming and barrier runs.
        #[arg(long, default_value = ".cache/bench/pipeline.svg")]
        svg: PathBuf,
        /// Job inputs of the large job (default N = 10 W for the 5 workers); a job of N = W
        /// inputs runs beside it (the `_n_eq_w` figures).
        #[arg(long, default_value_t = 50)]
        inputs: usize,
        /// Sentences per input.
        #[arg(long, default_value_t = 8)]
        batch: usize,
        /// Streaming/barrier pairs run per job size, alternated; the median of each is reported.
        #[arg(long, default_value_t = 5)]
        repeats: usize,
        /// Working folder (keys, worker configs, logs and disk caches).
        #[arg(long, default_value = ".cache/bench/pipeline")]
        workdir: PathBuf,
        /// Only the memory figures (floor, whole model, stages of K = 2, 3, 4; the workers' idle
        /// floor and peak over one MiniLM job; the large model's 4 workers when it is set up).
        #[arg(long)]
        memory_only: bool,
        /// Skip the memory-split figures (K = 2, 3, 4 cut and probed): a quicker run of the
        /// scheduling figures.
        #[arg(long, conflicts_with = "memory_only")]
        no_memory_split: bool,
        /// Skip the second case (all-mpnet-base-v2 in 4 stages on 4 workers, run when
        /// `scripts/setup --large` has put it in the cache).
        #[arg(long, conflicts_with = "memory_only")]
        no_large: bool,
        /// The model of the memory figures: minilm, or large (all-mpnet-base-v2, ~4.8x MiniLM,
        /// from `scripts/setup --large`; needs --memory-only; the scheduling figures run MiniLM, then the large model's curve when it is there).
        #[arg(long, default_value = "minilm")]
        model: pipeline::MemoryModel,
    },
    /// AdaSprite co-adaptation: ours vs isolated, AMS, RECL, MoE-SE served for real on one pool
    /// budget (Poisson arrivals, K swept, ablations), measured calibration, and the `sim_` sweep.
    Coadapt {
        /// Write the figures as one flat JSON object here.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Where to draw the SLO-attainment plot (default coadapt.svg next to the JSON, or .cache/bench).
        #[arg(long)]
        svg: Option<PathBuf>,
        /// Largest concurrency simulated.
        #[arg(long, default_value_t = 32)]
        k_max: usize,
        /// Short run: two student sizes calibrated, real K swept over 1, 2, 4 with one seed.
        #[arg(long)]
        quick: bool,
        /// Student size the real sweep adapts (tiny, small, base, large, sprite; default sprite, the paper's shape; tiny with --quick).
        #[arg(long)]
        student: Option<String>,
        /// Concurrency levels of the real sweep, comma-separated (default 1,2,4,8,12; 1,2,4 with --quick).
        #[arg(long, value_delimiter = ',')]
        ks: Option<Vec<usize>>,
        /// Seeds of the real sweep, 1 to 5 (default 3; 1 with --quick).
        #[arg(long)]
        seeds: Option<usize>,
        /// Strategies of the real sweep, comma-separated (ours, isolated, ams, recl, moe_se, and
        /// ours-MECHANISM for an ablation, e.g. ours-region; default all of them). With only ours,
        /// e.g. `--strategies ours --ks 1,2,3,4,5,6,7,8,9,10,11,12 --seeds 5`, the oracle K* is
        /// compared with ours alone.
        #[arg(long, value_delimiter = ',')]
        strategies: Option<Vec<String>>,
        /// Where the real sweep's training steps run: cpu (the default; timed in process CPU time)
        /// or cuda / cuda:N (every V-MoE op on the GPU, optimiser moments in device memory; timed
        /// in wall time). Without a usable GPU, cuda is refused naming why.
        #[arg(long, default_value = "cpu", value_parser = parse_device)]
        device: troupe_kernels::DeviceKind,
        /// The storage comparison's read throttle, bytes per second (default: the bandwidth at
        /// which an un-hidden reuse read costs 0.71x the compute it saves, else the edge board's
        /// 90 MB/s); e.g. 300000000 for an eMMC-class board.
        #[arg(long)]
        storage_read_bps: Option<u64>,
    },
}

/// `--device`'s value: `cpu`, `cuda` or `cuda:N`.
fn parse_device(name: &str) -> Result<troupe_kernels::DeviceKind, String> {
    troupe_kernels::DeviceKind::parse(name).map_err(|e| e.to_string())
}

/// Runs a benchmark command.
pub async fn run(cmd: BenchCommand) -> Result<()> {
    let (title, figures, json) = match cmd {
        BenchCommand::Transport { json, quick } => ("transport", transport::run(quick).await?, json),
        BenchCommand::Kernels { json, dir, no_onnx } => {
            let dir = dir.unwrap_or_else(|| PathBuf::from(".cache/bench"));
            ("kernels", tokio::task::spawn_blocking(move || kernels::run(&dir, !no_onnx)).await??, json)
        }
        BenchCommand::Coe {
            json,
            scale,
            dir,
            svg,
            real,
            sweep,
            knobs,
            cpu_threads,
            cpu_mlp,
            skip_ablation,
        } => {
            let run = move || {
                if sweep {
                    coe::run_sweep(&scale, dir, real, &knobs)
                } else {
                    let options = coe::ServeOptions {
                        force_real: real,
                        cpu_threads: usize::from(cpu_threads),
                        cpu_mlp,
                        skip_ablation,
                    };
                    coe::run(&scale, dir, &svg, &knobs, &options)
                }
            };
            ("coe", tokio::task::spawn_blocking(run).await??, json)
        }
        BenchCommand::Pipeline {
            json,
            svg,
            inputs,
            batch,
            repeats,
            workdir,
            memory_only,
            no_memory_split,
            no_large,
            model,
        } => {
            if memory_only {
                let exe = std::env::current_exe()?;
                let mut f = pipeline::memory_split_of(&exe, model).await?;
                f.extend(pipeline_memory::run(&exe, &workdir).await?);
                ("pipeline", f, json)
            } else if model != pipeline::MemoryModel::MiniLm {
                anyhow::bail!("--model large needs --memory-only (the scheduling figures run MiniLM)");
            } else {
                let split = !no_memory_split;
                (
                    "pipeline",
                    pipeline::run(&workdir, &svg, inputs, batch, repeats, split, !no_large).await?,
                    json,
                )
            }
        }
        BenchCommand::Coadapt {
            json,
            svg,
            k_max,
            quick,
            student,
            ks,
            seeds,
            strategies,
            device,
            storage_read_bps,
        } => {
            let svg = svg.unwrap_or_else(|| {
                json.as_ref()
                    .and_then(|j| j.parent())
                    .filter(|p| !p.as_os_str().is_empty())
                    .map_or_else(|| PathBuf::from(".cache/bench"), Path::to_path_buf)
                    .join("coadapt.svg")
            });
            if let Some(dir) = svg.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            }
            let k_max = k_max.clamp(2, 64);
            (
                "coadapt",
                tokio::task::spawn_blocking(move || {
                    let sweep = coadapt::RealSweep {
                        quick,
                        student,
                        ks,
                        seeds,
                        strategies,
                        device,
                        storage_read_bps,
                    };
                    coadapt::run(k_max, &sweep, &svg)
                })
                .await??,
                json,
            )
        }
    };
    print!("{}", table(title, &figures));
    if let Some(path) = json {
        write_json(&path, &figures)?;
        println!("figures written to {}", path.display());
    }
    Ok(())
}

/// A two-column table of the figures, drawn as every job's summary table is.
pub fn table(title: &str, figures: &BTreeMap<String, f64>) -> String {
    figures
        .iter()
        .fold(troupe::summary::Summary::new(format!("troupe bench {title}")), |t, (k, v)| {
            t.row(k.as_str(), format!("{v:.4}"))
        })
        .render()
}

/// Writes figures as one flat JSON object.
pub fn write_json(path: &Path, figures: &BTreeMap<String, f64>) -> Result<()> {
    if let Some(parent) = path.parent()
        && !parent.as_os_str().is_empty()
    {
        std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    }
    let clean: BTreeMap<&String, serde_json::Value> = figures
        .iter()
        .map(|(k, v)| {
            (k, serde_json::Number::from_f64(*v).map_or(serde_json::Value::Null, serde_json::Value::Number))
        })
        .collect();
    std::fs::write(path, serde_json::to_string_pretty(&clean)?)
        .with_context(|| format!("writing {}", path.display()))
}

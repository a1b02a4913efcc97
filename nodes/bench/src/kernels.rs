//! `troupe bench kernels`: the kernels crate's figures ([`figures`]: GEMM vs peak, MoE FFN, disk
//! tier vs O_DIRECT) plus ONNX session creation per MB ([`onnx_session`]).

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result};
use troupe_kernels::assets::{Assets, MINILM_WHOLE};

pub mod figures;
pub mod onnx_session;

/// Runs the kernel benchmark; disk figures use `dir`; the ONNX session figure only with `onnx`.
pub fn run(dir: &Path, onnx: bool) -> Result<BTreeMap<String, f64>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let cfg = figures::BenchConfig::new(dir);
    let bar = troupe::progress::spinner("bench kernels");
    let mut figures = figures::run(&cfg)?.to_json_map();
    bar.finish_and_clear();
    if !onnx {
        return Ok(figures);
    }
    let assets = Assets::locate().context("the ONNX figure needs the models from scripts/setup")?;
    let whole = assets.path(MINILM_WHOLE)?;
    figures.insert("onnx_session_ms_per_mb".into(), onnx_session::session_ms_per_mb(&whole)?);
    Ok(figures)
}

//! `troupe bench kernels`: the kernels crate's figures plus ONNX session creation per MB.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result};
use troupe_kernels::assets::{Assets, MINILM_WHOLE};

/// Runs the kernel benchmark; disk figures use `dir`.
pub fn run(dir: &Path) -> Result<BTreeMap<String, f64>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let cfg = troupe_kernels::bench::BenchConfig::new(dir);
    let bar = crate::progress::spinner("bench kernels");
    let mut figures = troupe_kernels::bench::run(&cfg)?.to_json_map();
    bar.finish_and_clear();
    let assets = Assets::locate().context("the ONNX figure needs the models from scripts/setup")?;
    let whole = assets.path(MINILM_WHOLE)?;
    figures.insert("onnx_session_ms_per_mb".into(), troupe_kernels::onnx::session_ms_per_mb(&whole)?);
    Ok(figures)
}

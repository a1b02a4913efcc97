//! Users' own CoE applications: an app file (TOML) naming each expert's ONNX file, the
//! dependency edges and the usage probabilities, read for `troupe coe serve --app FILE`.
//! `troupe coe gen` writes its app in this format too (`app.toml` next to `experts/*.onnx`).
//!
//! ```toml
//! format = "troupe-coe-app 2"
//! scale = "ci"                  # optional, informational
//! [memory]                      # optional: expert bytes of each executor (profiling only)
//! gpu_expert_bytes = 4194304
//! cpu_expert_bytes = 6291456
//! [[expert]]
//! name = "component"            # unique
//! file = "experts/component.onnx" # relative to the app file's folder
//! prob = 1.0                    # entry share of requests (an expert no edge leads to)
//! home = "ssd"                  # or "host": the tier a load reads it from (default ssd)
//! [[expert]]
//! name = "scratch"
//! file = "experts/scratch.onnx"
//! prob = 0.6                    # P(selected | its preliminary ran)
//! [[edge]]
//! from = "component"            # the preliminary expert
//! output = 0                    # which of its outputs scores...
//! to = "scratch"                # ...this subsequent expert
//! ```
//!
//! Every expert takes `x` (f32, `[batch, 64]`: an 8x8 digit image in 0..1) and returns `probs`
//! (f32, `[batch, k]`). A preliminary selects the subsequent expert whose edge's output is
//! highest, plus a close runner-up ([`super::app::select_children`]). An expert has at most one
//! preliminary. Refused, with the file and the expert or edge named: a cycle, a missing or
//! oversized ONNX file, a probability outside [0, 1], an edge naming an unknown expert, a second
//! preliminary, two edges on one output, an output the model does not have.
//!
//! Expert ids are a stable topological order of the file: when every preliminary is listed
//! before its subsequent experts (as `gen` writes it), id = position in the file.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use troupe_policy::coe::{CoeModel, ExpertId, Tier};

use rand::SeedableRng;
use rand::rngs::SmallRng;
use troupe_kernels::assets::{Assets, Digits};
use troupe_kernels::onnx::{NamedTensor, OnnxSession, SessionConfig};
use troupe_kernels::{Device, WeightStore};
use troupe_policy::coe::{ExpertSpec, Trace};

use super::CoeError;
use super::app::{
    App, ExpertFile, INPUT_NAME, INPUT_WIDTH, MAX_TRACE_BYTES, Manifest, OUTPUT_NAME, Scale, Walks,
    build_trace, hidden_width, image_floats, read_capped, route_scores, select_children,
};

/// The `format` value of an app file.
pub const APP_FILE_FORMAT: &str = "troupe-coe-app 2";
/// Largest app file accepted, bytes.
pub const MAX_APP_FILE_BYTES: u64 = 1 << 20;
/// Largest expert ONNX file accepted, bytes.
pub const MAX_ONNX_BYTES: u64 = 1 << 30;
/// Most experts an app file may name.
pub const MAX_APP_EXPERTS: usize = 10_000;

/// Where an expert's weights are read from on a load.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Home {
    /// Host memory (read once at start, copied on each load).
    Host,
    /// Disk (an `O_DIRECT` read on each load).
    #[default]
    Ssd,
}

impl Home {
    /// The policy's tier.
    pub fn tier(self) -> Tier {
        match self {
            Home::Host => Tier::Host,
            Home::Ssd => Tier::Ssd,
        }
    }

    /// From the policy's tier.
    pub fn from_tier(t: Tier) -> Home {
        match t {
            Tier::Host => Home::Host,
            Tier::Ssd => Home::Ssd,
        }
    }
}

/// Expert bytes each executor keeps (used when `serve --app` profiles this machine).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Memory {
    /// The GPU (stand-in) executor's expert bytes.
    pub gpu_expert_bytes: u64,
    /// The CPU executor's expert bytes.
    pub cpu_expert_bytes: u64,
}

/// One `[[expert]]` entry.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpertEntry {
    /// Unique name.
    pub name: String,
    /// ONNX file, relative to the app file's folder (or absolute).
    pub file: PathBuf,
    /// Entry share (an entry expert) or P(selected | preliminary ran) (a subsequent one).
    pub prob: f64,
    /// Tier loads read from.
    #[serde(default)]
    pub home: Home,
}

/// One `[[edge]]`: output `output` of `from` scores subsequent expert `to`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Edge {
    /// The preliminary expert.
    pub from: String,
    /// Index into its `probs` output.
    pub output: usize,
    /// The subsequent expert.
    pub to: String,
}

/// An app file as written (see the module docs).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AppFile {
    /// Must be [`APP_FILE_FORMAT`].
    pub format: String,
    /// Scale it was generated at, if generated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale: Option<String>,
    /// Executor expert memory (defaults: the ci scale's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<Memory>,
    /// The experts.
    #[serde(rename = "expert")]
    pub experts: Vec<ExpertEntry>,
    /// The dependency edges.
    #[serde(default, rename = "edge")]
    pub edges: Vec<Edge>,
}

/// The validated graph of an app file, in expert-id order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AppGraph {
    /// Per id: the index of its `[[expert]]` entry.
    pub entry: Vec<usize>,
    /// Per id: its preliminary.
    pub parent: Vec<Option<ExpertId>>,
    /// Per id: its subsequent experts in id order, each with the output that scores it.
    pub children: Vec<Vec<(ExpertId, usize)>>,
}

impl AppGraph {
    /// Per id: the outputs scoring its children, in the order the model lists the children.
    pub fn routes(&self) -> Vec<Vec<usize>> {
        self.children.iter().map(|c| c.iter().map(|(_, o)| *o).collect()).collect()
    }
}

fn bad(path: &Path, problem: String) -> CoeError {
    CoeError::BadFile { path: path.to_path_buf(), problem }
}

impl AppFile {
    /// The app file of a generated model: expert `i` is `e<i>` in `experts/e<i>.onnx`, each
    /// subsequent expert scored by its position among its preliminary's children.
    pub fn from_model(model: &CoeModel, scale: Option<&str>, memory: Option<Memory>) -> AppFile {
        let experts = model
            .experts()
            .iter()
            .map(|e| ExpertEntry {
                name: format!("e{}", e.id.0),
                file: PathBuf::from(format!("experts/e{}.onnx", e.id.0)),
                prob: e.select_prob,
                home: Home::from_tier(e.home),
            })
            .collect();
        let edges = model
            .experts()
            .iter()
            .flat_map(|p| {
                p.children.iter().enumerate().map(move |(output, c)| Edge {
                    from: format!("e{}", p.id.0),
                    output,
                    to: format!("e{}", c.0),
                })
            })
            .collect();
        AppFile { format: APP_FILE_FORMAT.into(), scale: scale.map(str::to_string), memory, experts, edges }
    }

    /// TOML text.
    pub fn to_toml(&self) -> Result<String, CoeError> {
        toml::to_string(self).map_err(|e| CoeError::Invalid(format!("writing an app file: {e}")))
    }

    /// Parse TOML text (untrusted); `origin` names the file in errors. The graph is not checked
    /// here: see [`AppFile::graph`].
    pub fn parse(text: &str, origin: &Path) -> Result<AppFile, CoeError> {
        let file: AppFile = toml::from_str(text).map_err(|e| bad(origin, e.to_string()))?;
        if file.format != APP_FILE_FORMAT {
            return Err(bad(origin, format!("format {:?}, expected {APP_FILE_FORMAT:?}", file.format)));
        }
        Ok(file)
    }

    /// Checks names, probabilities and edges, and orders the experts (see the module docs).
    pub fn graph(&self, origin: &Path) -> Result<AppGraph, CoeError> {
        let n = self.experts.len();
        if n == 0 {
            return Err(bad(origin, "no [[expert]] entries".into()));
        }
        if n > MAX_APP_EXPERTS {
            return Err(bad(origin, format!("{n} experts, at most {MAX_APP_EXPERTS}")));
        }
        let mut index: BTreeMap<&str, usize> = BTreeMap::new();
        for (i, e) in self.experts.iter().enumerate() {
            if e.name.is_empty() {
                return Err(bad(origin, format!("expert #{} has an empty name", i + 1)));
            }
            if index.insert(e.name.as_str(), i).is_some() {
                return Err(bad(origin, format!("expert `{}` is named twice", e.name)));
            }
            if !(0.0..=1.0).contains(&e.prob) {
                return Err(bad(
                    origin,
                    format!("expert `{}`: probability {} outside [0, 1]", e.name, e.prob),
                ));
            }
        }
        // parent[i] = (entry of the preliminary, output), by entry index.
        let mut parent: Vec<Option<(usize, usize)>> = vec![None; n];
        let mut outputs: BTreeSet<(usize, usize)> = BTreeSet::new();
        for edge in &self.edges {
            let what = format!("edge `{}` -> `{}` (output {})", edge.from, edge.to, edge.output);
            let known = |name: &str| {
                index
                    .get(name)
                    .copied()
                    .ok_or_else(|| bad(origin, format!("{what}: unknown expert `{name}`")))
            };
            let (from, to) = (known(&edge.from)?, known(&edge.to)?);
            if let Some((p, _)) = parent[to] {
                return Err(bad(
                    origin,
                    format!(
                        "{what}: `{}` already depends on `{}` (one preliminary per expert)",
                        edge.to, self.experts[p].name
                    ),
                ));
            }
            if !outputs.insert((from, edge.output)) {
                return Err(bad(
                    origin,
                    format!("{what}: output {} of `{}` routes twice", edge.output, edge.from),
                ));
            }
            parent[to] = Some((from, edge.output));
        }
        // Stable topological order: repeatedly take the first entry whose preliminary is placed.
        let mut id_of: Vec<Option<u32>> = vec![None; n];
        let mut entry = Vec::with_capacity(n);
        let mut progress = true;
        while progress && entry.len() < n {
            progress = false;
            for i in 0..n {
                if id_of[i].is_none() && parent[i].is_none_or(|(p, _)| id_of[p].is_some()) {
                    id_of[i] = Some(entry.len() as u32);
                    entry.push(i);
                    progress = true;
                }
            }
        }
        if let Some(start) = (0..n).find(|&i| id_of[i].is_none()) {
            // Every unplaced entry has an unplaced preliminary: walk back until a name repeats.
            let mut path = vec![start];
            let mut at = start;
            while let Some((p, _)) = parent[at] {
                if let Some(k) = path.iter().position(|&x| x == p) {
                    let mut names: Vec<&str> =
                        path[k..].iter().rev().map(|&x| self.experts[x].name.as_str()).collect();
                    names.push(self.experts[at].name.as_str());
                    return Err(bad(origin, format!("cycle of edges: {}", names.join(" -> "))));
                }
                path.push(p);
                at = p;
            }
            return Err(bad(origin, format!("expert `{}` is unreachable", self.experts[start].name)));
        }
        let id = |i: usize| ExpertId(id_of[i].unwrap_or(0));
        let parents: Vec<Option<ExpertId>> = entry.iter().map(|&i| parent[i].map(|(p, _)| id(p))).collect();
        let mut children: Vec<Vec<(ExpertId, usize)>> = vec![Vec::new(); n];
        for &i in &entry {
            if let Some((p, out)) = parent[i] {
                children[id(p).index()].push((id(i), out));
            }
        }
        if !entry.iter().any(|&i| parent[i].is_none() && self.experts[i].prob > 0.0) {
            return Err(bad(
                origin,
                "no entry expert (one no edge leads to) has a probability above 0".into(),
            ));
        }
        Ok(AppGraph { entry, parent: parents, children })
    }
}

/// An app file read and checked, with its experts' ONNX files located.
#[derive(Clone, Debug)]
pub struct LoadedApp {
    /// The app file.
    pub path: PathBuf,
    /// What it says.
    pub file: AppFile,
    /// Its graph.
    pub graph: AppGraph,
    /// Per id: the ONNX file.
    pub onnx: Vec<PathBuf>,
}

impl LoadedApp {
    /// Read `path` (size-capped), parse and check it, and check every ONNX file it names
    /// exists and is under [`MAX_ONNX_BYTES`].
    pub fn load(path: &Path) -> Result<LoadedApp, CoeError> {
        let file = AppFile::parse(&read_capped(path, MAX_APP_FILE_BYTES)?, path)?;
        let graph = file.graph(path)?;
        let base = path.parent().unwrap_or(Path::new("."));
        let mut onnx = Vec::with_capacity(graph.entry.len());
        for &i in &graph.entry {
            let e = &file.experts[i];
            let p = base.join(&e.file);
            match std::fs::metadata(&p) {
                Ok(m) if m.is_file() && m.len() > 0 && m.len() <= MAX_ONNX_BYTES => {}
                Ok(m) if m.is_file() => {
                    return Err(bad(
                        path,
                        format!(
                            "expert `{}`: {} is {} bytes (1..={MAX_ONNX_BYTES} accepted)",
                            e.name,
                            p.display(),
                            m.len()
                        ),
                    ));
                }
                Ok(_) => {
                    return Err(bad(path, format!("expert `{}`: {} is not a file", e.name, p.display())));
                }
                Err(err) => {
                    return Err(bad(
                        path,
                        format!("expert `{}`: file {} missing ({err})", e.name, p.display()),
                    ));
                }
            }
            onnx.push(p);
        }
        Ok(LoadedApp { path: path.to_path_buf(), file, graph, onnx })
    }

    /// The expert name of id `id`.
    pub fn name(&self, id: ExpertId) -> &str {
        self.graph
            .entry
            .get(id.index())
            .and_then(|&i| self.file.experts.get(i))
            .map_or("?", |e| e.name.as_str())
    }
}

/// Where `serve --app` takes its requests from.
#[derive(Clone, Debug, PartialEq)]
pub enum Requests {
    /// A trace file in the `coe run` format (e.g. the `trace.txt` gen wrote): its requests,
    /// checked against the app; the app file's model replaces the trace's.
    Trace(PathBuf),
    /// `count` requests generated with `seed`: bursty arrivals, the entry experts mixed by
    /// their probabilities, inputs drawn from the digit images, and each request's selections
    /// pre-assessed by running the app's own experts on its image.
    Generated {
        /// How many.
        count: usize,
        /// The generator's seed.
        seed: u64,
    },
}

/// Opens `loaded` for serving: its ONNX files are probed (input `x` `[1, 64]`, output `probs`)
/// and imported into the weight store `work/store`, and the requests made or read as
/// `requests` says. The returned app's `dir` is `work`.
pub fn open_for_serving(loaded: &LoadedApp, work: &Path, requests: &Requests) -> Result<App, CoeError> {
    let store_dir = work.join("store");
    if store_dir.exists() {
        std::fs::remove_dir_all(&store_dir).map_err(|e| CoeError::io("clearing", &store_dir, e))?;
    }
    let mut store = WeightStore::open(&store_dir, &Device::Cpu, 0, 0)?;
    let n = loaded.onnx.len();
    let (mut specs, mut files, mut sessions) =
        (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
    for (id, onnx) in loaded.onnx.iter().enumerate() {
        let expert = ExpertId(id as u32);
        let name = loaded.name(expert);
        let entry = &loaded.file.experts[loaded.graph.entry[id]];
        let named =
            |problem: String| bad(&loaded.path, format!("expert `{name}` ({}): {problem}", onnx.display()));
        // Capped while reading too: the file may have grown since it was checked.
        let mut bytes = Vec::new();
        std::fs::File::open(onnx)
            .and_then(|f| {
                std::io::Read::read_to_end(&mut std::io::Read::take(f, MAX_ONNX_BYTES + 1), &mut bytes)
            })
            .map_err(|e| CoeError::io("reading", onnx, e))?;
        if bytes.is_empty() || bytes.len() as u64 > MAX_ONNX_BYTES {
            return Err(named(format!("{} bytes (1..={MAX_ONNX_BYTES} accepted)", bytes.len())));
        }
        let blob = format!("e{id}");
        let mut session = OnnxSession::from_bytes(
            &bytes,
            &blob,
            &SessionConfig { intra_threads: 0, ..SessionConfig::default() },
        )
        .map_err(|e| named(format!("not a loadable ONNX model: {e}")))?;
        let out = session
            .run(&[NamedTensor::f32(INPUT_NAME, vec![1, INPUT_WIDTH], vec![0.0; INPUT_WIDTH])])
            .map_err(|e| named(format!("does not run on `{INPUT_NAME}` [1, {INPUT_WIDTH}]: {e}")))?;
        let outputs = out
            .first()
            .and_then(NamedTensor::as_f32)
            .map(<[f32]>::len)
            .filter(|&k| k > 0)
            .ok_or_else(|| named(format!("no f32 `{OUTPUT_NAME}` output")))?;
        for (child, output) in &loaded.graph.children[id] {
            if *output >= outputs {
                return Err(bad(
                    &loaded.path,
                    format!(
                        "edge `{name}` -> `{}` (output {output}): `{name}` has {outputs} outputs",
                        loaded.name(*child)
                    ),
                ));
            }
        }
        store.put(&blob, &bytes)?;
        // Hidden widths are not read from the file: estimated from its size, they size the
        // profiler's batch intermediates only.
        let h = hidden_width(bytes.len() as u64, outputs);
        files.push(ExpertFile { id: expert, widths: vec![INPUT_WIDTH, h, h, outputs], blob });
        specs.push(ExpertSpec {
            size_bytes: bytes.len() as u64,
            select_prob: entry.prob,
            home: entry.home.tier(),
            parent: loaded.graph.parent[id],
        });
        sessions.push(if loaded.graph.children[id].is_empty() { None } else { Some(session) });
    }
    let model = CoeModel::new(specs).map_err(|e| bad(&loaded.path, e.to_string()))?;
    let routes = loaded.graph.routes();
    let digits = Assets::locate()?.digits()?;
    let trace = match requests {
        Requests::Trace(path) => {
            let t =
                Trace::parse(&read_capped(path, MAX_TRACE_BYTES)?).map_err(|e| bad(path, e.to_string()))?;
            if t.model.len() != model.len() {
                return Err(bad(path, format!("{} experts, the app has {}", t.model.len(), model.len())));
            }
            let trace = Trace { model, requests: t.requests };
            trace.validate().map_err(|e| bad(path, e.to_string()))?;
            if let Some(r) = trace.requests.iter().find(|r| r.input as usize >= digits.len()) {
                return Err(bad(
                    path,
                    format!("request {} names image {}, the data set has {}", r.id, r.input, digits.len()),
                ));
            }
            trace
        }
        Requests::Generated { count, seed } => {
            let mut cfg = Scale::Ci.config();
            cfg.requests = *count;
            let pool = cfg.image_pool.min(digits.len());
            let walks = assess(&model, &routes, &mut sessions, &digits, pool)?;
            let mut rng = SmallRng::seed_from_u64(*seed);
            let images: Vec<usize> = (0..pool).collect();
            let trace = build_trace(model, &cfg, &images, &walks, &mut rng);
            trace.validate().map_err(|e| bad(&loaded.path, e.to_string()))?;
            trace
        }
    };
    let scale = loaded.file.scale.as_deref().and_then(Scale::from_name).unwrap_or(Scale::Ci);
    let seed = match requests {
        Requests::Generated { seed, .. } => *seed,
        Requests::Trace(_) => 0,
    };
    Ok(App {
        dir: work.to_path_buf(),
        manifest: Manifest { scale, seed, knobs: None, generator: None, experts: files },
        trace,
        digits,
        routes,
    })
}

/// Runs every preliminary (in id order, so preliminaries before their subsequent experts) on
/// the images that reach it from each entry expert; the selections each (entry, image) walk makes.
fn assess(
    model: &CoeModel,
    routes: &[Vec<usize>],
    sessions: &mut [Option<OnnxSession>],
    digits: &Digits,
    pool: usize,
) -> Result<Walks, CoeError> {
    let images: Vec<Vec<f32>> = (0..pool).map(|i| image_floats(digits, i)).collect();
    let mut reach: Vec<Vec<(ExpertId, usize)>> = vec![Vec::new(); model.len()];
    let mut walks: Walks = BTreeMap::new();
    for e in model.experts() {
        if e.preliminary().is_none() {
            reach[e.id.index()] = (0..pool).map(|i| (e.id, i)).collect();
        }
        let Some(Some(session)) = sessions.get_mut(e.id.index()) else { continue };
        let route = routes.get(e.id.index()).map_or(&[][..], Vec::as_slice);
        let todo = std::mem::take(&mut reach[e.id.index()]);
        for chunk in todo.chunks(256) {
            let mut x = Vec::with_capacity(chunk.len() * INPUT_WIDTH);
            for (_, img) in chunk {
                x.extend_from_slice(&images[*img]);
            }
            let out = session.run(&[NamedTensor::f32(INPUT_NAME, vec![chunk.len(), INPUT_WIDTH], x)])?;
            let probs = out
                .first()
                .and_then(NamedTensor::as_f32)
                .ok_or_else(|| CoeError::Invalid(format!("{}: no f32 output", e.id)))?;
            let width = probs.len() / chunk.len().max(1);
            for (k, walk) in chunk.iter().enumerate() {
                let row = probs.get(k * width..(k + 1) * width).unwrap_or(&[]);
                let chosen = select_children(&route_scores(row, route), &e.children);
                for c in &chosen {
                    reach[c.index()].push(*walk);
                }
                walks.entry(*walk).or_default().push((e.id, chosen));
            }
        }
        reach[e.id.index()] = todo;
    }
    Ok(walks)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, prob: f64) -> ExpertEntry {
        ExpertEntry { name: name.into(), file: format!("{name}.onnx").into(), prob, home: Home::Ssd }
    }

    fn edge(from: &str, output: usize, to: &str) -> Edge {
        Edge { from: from.into(), output, to: to.into() }
    }

    fn app(experts: Vec<ExpertEntry>, edges: Vec<Edge>) -> AppFile {
        AppFile { format: APP_FILE_FORMAT.into(), scale: None, memory: None, experts, edges }
    }

    fn refusal(a: &AppFile) -> String {
        a.graph(Path::new("/apps/my.toml")).unwrap_err().to_string()
    }

    #[test]
    fn generated_model_round_trips_through_toml() {
        let spec = |p: f64, home, parent| ExpertSpec { size_bytes: 10, select_prob: p, home, parent };
        let model = CoeModel::new(vec![
            spec(0.7, Tier::Ssd, None),
            spec(0.3, Tier::Host, None),
            spec(0.123_456_789_012_345_6, Tier::Ssd, Some(ExpertId(0))),
            spec(1.0 / 3.0, Tier::Ssd, Some(ExpertId(0))),
            spec(0.5, Tier::Ssd, Some(ExpertId(3))),
        ])
        .unwrap();
        let memory = Memory { gpu_expert_bytes: 1 << 22, cpu_expert_bytes: 6 << 20 };
        let a = AppFile::from_model(&model, Some("ci"), Some(memory));
        let text = a.to_toml().unwrap();
        let back = AppFile::parse(&text, Path::new("app.toml")).unwrap();
        assert_eq!(back, a, "{text}");
        let g = back.graph(Path::new("app.toml")).unwrap();
        assert_eq!(g.entry, vec![0, 1, 2, 3, 4], "file order is kept when it is topological");
        let parents: Vec<Option<ExpertId>> = model.experts().iter().map(|e| e.preliminary()).collect();
        assert_eq!(g.parent, parents);
        assert_eq!(g.routes()[0], vec![0, 1]);
    }

    #[test]
    fn out_of_order_entries_get_topological_ids_and_routes() {
        let a = app(
            vec![entry("leaf", 0.5), entry("root", 1.0), entry("mid", 0.4)],
            vec![edge("mid", 0, "leaf"), edge("root", 3, "mid")],
        );
        let g = a.graph(Path::new("x.toml")).unwrap();
        assert_eq!(g.entry, vec![1, 2, 0]);
        assert_eq!(g.parent, vec![None, Some(ExpertId(0)), Some(ExpertId(1))]);
        assert_eq!(g.routes(), vec![vec![3], vec![0], vec![]]);
    }

    #[test]
    fn a_cycle_is_refused_naming_it() {
        let a = app(
            vec![entry("root", 1.0), entry("a", 0.5), entry("b", 0.5)],
            vec![edge("a", 0, "b"), edge("b", 0, "a")],
        );
        let err = refusal(&a);
        assert!(err.contains("/apps/my.toml") && err.contains("cycle"), "{err}");
        assert!(err.contains("a -> b -> a") || err.contains("b -> a -> b"), "{err}");
        let selfloop = app(vec![entry("root", 1.0), entry("s", 0.5)], vec![edge("s", 0, "s")]);
        assert!(refusal(&selfloop).contains("cycle of edges: s -> s"), "{}", refusal(&selfloop));
    }

    #[test]
    fn a_probability_outside_0_1_is_refused_naming_the_expert() {
        for p in [1.5, -0.1, f64::NAN] {
            let a = app(vec![entry("root", 1.0), entry("odd", p)], vec![edge("root", 0, "odd")]);
            let err = refusal(&a);
            assert!(
                err.contains("/apps/my.toml")
                    && err.contains("expert `odd`")
                    && err.contains("outside [0, 1]"),
                "{err}"
            );
        }
    }

    #[test]
    fn an_edge_to_an_unknown_expert_is_refused_naming_the_edge() {
        let a = app(vec![entry("root", 1.0)], vec![edge("root", 2, "ghost")]);
        let err = refusal(&a);
        assert!(err.contains("edge `root` -> `ghost` (output 2): unknown expert `ghost`"), "{err}");
        let a = app(vec![entry("root", 1.0)], vec![edge("nobody", 0, "root")]);
        assert!(refusal(&a).contains("unknown expert `nobody`"), "{}", refusal(&a));
    }

    #[test]
    fn second_preliminaries_and_doubled_outputs_are_refused() {
        let a = app(
            vec![entry("r1", 0.5), entry("r2", 0.5), entry("c", 0.5)],
            vec![edge("r1", 0, "c"), edge("r2", 0, "c")],
        );
        assert!(refusal(&a).contains("already depends on `r1`"), "{}", refusal(&a));
        let a = app(
            vec![entry("r", 1.0), entry("c", 0.5), entry("d", 0.5)],
            vec![edge("r", 0, "c"), edge("r", 0, "d")],
        );
        assert!(refusal(&a).contains("output 0 of `r` routes twice"), "{}", refusal(&a));
    }

    #[test]
    fn a_missing_onnx_file_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("root.onnx"), b"x").unwrap();
        let a = app(vec![entry("root", 1.0), entry("gone", 0.5)], vec![edge("root", 0, "gone")]);
        let path = dir.path().join("app.toml");
        std::fs::write(&path, a.to_toml().unwrap()).unwrap();
        let err = LoadedApp::load(&path).unwrap_err().to_string();
        assert!(err.contains(&path.display().to_string()), "{err}");
        assert!(err.contains("expert `gone`") && err.contains("gone.onnx missing"), "{err}");
        std::fs::write(dir.path().join("gone.onnx"), b"y").unwrap();
        let loaded = LoadedApp::load(&path).unwrap();
        assert_eq!(loaded.onnx[1], dir.path().join("gone.onnx"));
    }

    #[test]
    fn garbage_and_oversized_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("app.toml");
        std::fs::write(&path, "format = \"troupe-coe-app 2\"\n[[expert]]\nname = 3\n").unwrap();
        let err = LoadedApp::load(&path).unwrap_err().to_string();
        assert!(err.contains("app.toml"), "{err}");
        std::fs::write(&path, "format = \"other\"\nexpert = []\n").unwrap();
        assert!(LoadedApp::load(&path).unwrap_err().to_string().contains("expected"));
        std::fs::write(&path, vec![b'#'; MAX_APP_FILE_BYTES as usize + 1]).unwrap();
        assert!(LoadedApp::load(&path).unwrap_err().to_string().contains("over the cap"));
    }
}

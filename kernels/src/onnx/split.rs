//! Cutting one ONNX model into a chain of stage models (`troupe pipeline split`).
//!
//! Pure graph work over the prost types in [`proto`](super::proto); no ONNX Runtime here.
//!
//! **Cut points.** The nodes are put in topological order (the file's order wherever it is already
//! valid). Between two consecutive positions, the tensors produced before and still needed after
//! (or graph outputs) "cross". Each tensor depends on a set of graph inputs; a crossing tensor
//! that depends on strictly fewer graph inputs than the widest one (e.g. MiniLM's attention-mask
//! bias, which depends on `attention_mask` only) is a *side* tensor: the later stage recomputes it
//! from the graph inputs, which pass through to every stage that needs them. A position is a
//! valid cut when exactly one non-side activation crosses it: that tensor is the cut, the only
//! output of the stage before and the first input of the stage after, provided the side tensors
//! cost at most [`SIDE_RECOMPUTE_MAX_BYTES`] of weights to recompute. A stage is what
//! `onnx.utils.extract_model` would give: the nodes needed for its outputs, stopping at its inputs
//! (the previous cut and the graph inputs) and at initializers.
//!
//! **Balance.** [`CutPlan::Balanced`] picks the `K - 1` cuts that minimise the largest stage's
//! weight (initializer) bytes, ties broken by the sum of squares (the most even split). An
//! initializer used by two stages is counted, and written, in both. [`CutPlan::At`] takes named
//! cut tensors instead.
//!
//! **Refusals** (each a [`SplitError`] naming the problem): a file above the size cap (checked
//! before reading), undecodable bytes, external data that is missing or points outside the
//! model's folder, a graph that is cyclic or uses an undefined tensor, fewer valid cuts than
//! `K - 1`, and a cut whose tensor's type cannot be told (an unknown op without `value_info`) or
//! is not one the pipeline carries (f32 or i64).

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap, HashSet};
use std::fs;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Component, Path, PathBuf};

use prost::Message;
use sha2::{Digest, Sha256};

use super::proto::{
    GraphProto, ModelProto, NodeProto, TensorProto, TensorShapeProto, TypeProto, ValueInfoProto,
    tensor_proto, type_proto,
};

/// Protobuf's hard limit on one message (2 GiB - 1): no ONNX file without external data is larger.
pub const PROTOBUF_LIMIT: u64 = (1 << 31) - 1;
/// Most weight bytes a stage may recompute for its side tensors (those made from graph inputs
/// only, such as an attention-mask bias); a position needing more is no cut.
pub const SIDE_RECOMPUTE_MAX_BYTES: u64 = 64 << 10;
/// Most stages one split may produce (the pipeline chain check's limit).
pub const MAX_STAGES: usize = 256;
/// `TensorProto.DataType.FLOAT`.
const FLOAT: i32 = 1;
/// `TensorProto.DataType.INT64`.
const INT64: i32 = 7;

/// Size caps applied before anything is allocated for an (untrusted) model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest model file read.
    pub max_model_bytes: u64,
    /// Largest total of external data pulled in (it is inlined into the stages).
    pub max_external_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_model_bytes: PROTOBUF_LIMIT, max_external_bytes: PROTOBUF_LIMIT }
    }
}

/// Where the cuts go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CutPlan {
    /// `stages` stages balanced by weight (initializer) bytes.
    Balanced {
        /// How many stages (`K`).
        stages: usize,
    },
    /// Cut at these tensors, in order (`K` = their number + 1).
    At(Vec<String>),
}

/// Why a model could not be loaded or split.
#[derive(Debug, thiserror::Error)]
pub enum SplitError {
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A file is above its cap (checked before it is read).
    #[error("{path}: {bytes} bytes is above the {cap}-byte cap")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        bytes: u64,
        /// The cap.
        cap: u64,
    },
    /// The bytes are not an ONNX model.
    #[error("{origin} is not an ONNX model: {detail}")]
    Decode {
        /// The file.
        origin: String,
        /// What prost or the check found.
        detail: String,
    },
    /// A tensor's external data cannot be read.
    #[error("initializer '{tensor}': external data {location}: {detail}")]
    ExternalData {
        /// The initializer.
        tensor: String,
        /// Its `location` entry.
        location: String,
        /// Missing, outside the model's folder, out of range, above the cap.
        detail: String,
    },
    /// The graph itself is broken.
    #[error("graph: {0}")]
    Graph(String),
    /// The plan asks for a number of stages that makes no sense.
    #[error("{stages} stages asked for; between 1 and {MAX_STAGES} can be made")]
    BadStageCount {
        /// What was asked.
        stages: usize,
    },
    /// Fewer valid cut points than the plan needs.
    #[error("no valid cut for {stages} stages: {detail}")]
    NoValidCut {
        /// `K`.
        stages: usize,
        /// How many cuts exist and which.
        detail: String,
    },
    /// A named cut tensor is not a valid cut.
    #[error("'{tensor}' is not a valid cut: {detail}")]
    NotACut {
        /// The tensor asked for.
        tensor: String,
        /// Why (unknown tensor, or what else crosses there).
        detail: String,
    },
    /// The tensor at a cut has a type the split cannot tell or the pipeline cannot carry.
    #[error("cut '{tensor}' (made by op {op}{domain}): {detail}")]
    UnsupportedAtCut {
        /// The cut tensor.
        tensor: String,
        /// Its producer's op type.
        op: String,
        /// Its producer's domain, as " in domain D" (empty for the default domain).
        domain: String,
        /// What is wrong.
        detail: String,
    },
}

/// A model read from disk, external data inlined.
#[derive(Clone, Debug)]
pub struct LoadedModel {
    /// The decoded model.
    pub model: ModelProto,
    /// SHA-256 (hex) of the file's bytes.
    pub sha256: String,
    /// The file's size.
    pub bytes: u64,
}

/// One tensor at a stage boundary.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Its name.
    pub name: String,
    /// ONNX element type name (`FLOAT`, `INT64`, ...).
    pub dtype: String,
    /// Dimensions: a number, a symbolic name, or `?`; `None` when the rank is unknown.
    pub dims: Option<Vec<String>>,
}

/// One stage of a split.
#[derive(Clone, Debug)]
pub struct Stage {
    /// The stage model, ready to encode.
    pub model: ModelProto,
    /// Its inputs (the previous cut first, then the graph inputs it uses).
    pub inputs: Vec<TensorInfo>,
    /// Its outputs.
    pub outputs: Vec<TensorInfo>,
    /// Bytes of the initializers it holds.
    pub weight_bytes: u64,
    /// Nodes in it.
    pub nodes: usize,
}

/// The result of [`split_model`].
#[derive(Clone, Debug)]
pub struct Split {
    /// The cut tensors, in order.
    pub cuts: Vec<String>,
    /// The stages, in chain order.
    pub stages: Vec<Stage>,
}

/// What [`write_split`] wrote.
#[derive(Clone, Debug)]
pub struct WrittenStage {
    /// The file.
    pub path: PathBuf,
    /// SHA-256 (hex) of its bytes.
    pub sha256: String,
    /// Its size.
    pub bytes: u64,
}

/// Reads a model file (size-capped before reading), decodes it and inlines external data that
/// lies next to it (size-capped too).
pub fn load_model(path: &Path, limits: &Limits) -> Result<LoadedModel, SplitError> {
    let io = |source| SplitError::Io { path: path.to_owned(), source };
    let len = fs::metadata(path).map_err(io)?.len();
    let cap = limits.max_model_bytes.min(PROTOBUF_LIMIT);
    if len > cap {
        return Err(SplitError::TooLarge { path: path.to_owned(), bytes: len, cap });
    }
    let mut bytes = Vec::with_capacity(len as usize);
    fs::File::open(path).map_err(io)?.take(cap + 1).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > cap {
        return Err(SplitError::TooLarge { path: path.to_owned(), bytes: bytes.len() as u64, cap });
    }
    let origin = path.display().to_string();
    let mut model = decode_model(&bytes, &origin)?;
    let dir = path.parent().unwrap_or(Path::new("."));
    inline_external_data(&mut model, dir, limits.max_external_bytes)?;
    Ok(LoadedModel { model, sha256: sha256_hex(&bytes), bytes: bytes.len() as u64 })
}

/// Decodes model bytes and checks that there is a graph.
pub fn decode_model(bytes: &[u8], origin: &str) -> Result<ModelProto, SplitError> {
    let model = ModelProto::decode(bytes)
        .map_err(|e| SplitError::Decode { origin: origin.to_owned(), detail: e.to_string() })?;
    if model.graph.as_ref().is_none_or(|g| g.node.is_empty()) {
        return Err(SplitError::Decode { origin: origin.to_owned(), detail: "it has no graph nodes".into() });
    }
    Ok(model)
}

/// SHA-256 of bytes, lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

fn inline_external_data(model: &mut ModelProto, dir: &Path, cap: u64) -> Result<(), SplitError> {
    let Some(graph) = model.graph.as_mut() else { return Ok(()) };
    let mut total = 0u64;
    for t in &mut graph.initializer {
        if t.data_location != Some(tensor_proto::DataLocation::External as i32) {
            continue;
        }
        let name = t.name.clone().unwrap_or_default();
        let entry = |key: &str| {
            t.external_data.iter().find(|e| e.key.as_deref() == Some(key)).and_then(|e| e.value.clone())
        };
        let location = entry("location").unwrap_or_default();
        let bad = |detail: String| SplitError::ExternalData {
            tensor: name.clone(),
            location: location.clone(),
            detail,
        };
        let number = |key: &str| -> Result<Option<u64>, SplitError> {
            entry(key)
                .map(|v| v.parse::<u64>().map_err(|_| bad(format!("{key} '{v}' is not a number"))))
                .transpose()
        };
        let (offset, length) = (number("offset")?.unwrap_or(0), number("length")?);
        let rel = Path::new(&location);
        if location.is_empty() || !rel.components().all(|c| matches!(c, Component::Normal(_))) {
            return Err(bad("the location must be a relative path inside the model's folder".into()));
        }
        let file = dir.join(rel);
        let file_len =
            fs::metadata(&file).map_err(|e| bad(format!("{} is missing: {e}", file.display())))?.len();
        let length = match length {
            Some(l) => l,
            None => {
                file_len.checked_sub(offset).ok_or_else(|| bad(format!("offset {offset} past its end")))?
            }
        };
        if offset.checked_add(length).is_none_or(|end| end > file_len) {
            return Err(bad(format!("bytes {offset}..+{length} are past the end of a {file_len}-byte file")));
        }
        total = total.saturating_add(length);
        if total > cap {
            return Err(bad(format!("external data totals more than the {cap}-byte cap")));
        }
        let mut f = fs::File::open(&file).map_err(|e| bad(e.to_string()))?;
        f.seek(SeekFrom::Start(offset)).map_err(|e| bad(e.to_string()))?;
        let mut data = Vec::with_capacity(length as usize);
        f.take(length).read_to_end(&mut data).map_err(|e| bad(e.to_string()))?;
        if data.len() as u64 != length {
            return Err(bad(format!("read {} of {length} bytes", data.len())));
        }
        t.raw_data = Some(data);
        t.data_location = None;
        t.external_data.clear();
    }
    Ok(())
}

/// Bytes of an initializer's data.
pub fn tensor_bytes(t: &TensorProto) -> u64 {
    if let Some(raw) = &t.raw_data
        && !raw.is_empty()
    {
        return raw.len() as u64;
    }
    let strings: usize = t.string_data.iter().map(Vec::len).sum();
    (4 * (t.float_data.len() + t.int32_data.len())
        + 8 * (t.int64_data.len() + t.double_data.len() + t.uint64_data.len())
        + strings) as u64
}

/// ONNX's name for an element type.
fn dtype_name(elem: i32) -> String {
    tensor_proto::DataType::try_from(elem)
        .map(|d| d.as_str_name().to_owned())
        .unwrap_or_else(|_| format!("type {elem}"))
}

fn tensor_info(vi: &ValueInfoProto) -> TensorInfo {
    let name = vi.name.clone().unwrap_or_default();
    match vi.r#type.as_ref().and_then(|t| t.value.as_ref()) {
        Some(type_proto::Value::TensorType(t)) => TensorInfo {
            name,
            dtype: dtype_name(t.elem_type.unwrap_or(0)),
            dims: t.shape.as_ref().map(|s| {
                s.dim
                    .iter()
                    .map(|d| match &d.value {
                        Some(super::proto::tensor_shape_proto::dimension::Value::DimValue(v)) => {
                            v.to_string()
                        }
                        Some(super::proto::tensor_shape_proto::dimension::Value::DimParam(p)) => p.clone(),
                        None => "?".into(),
                    })
                    .collect()
            }),
        },
        _ => TensorInfo { name, dtype: "not a tensor".into(), dims: None },
    }
}

fn elem_type_of(vi: &ValueInfoProto) -> Option<i32> {
    match vi.r#type.as_ref()?.value.as_ref()? {
        type_proto::Value::TensorType(t) => t.elem_type,
        _ => None,
    }
}

/// Ops whose (first) output has the element type of their first input.
const SAME_TYPE_OPS: &[&str] = &[
    "Abs",
    "Add",
    "BatchNormalization",
    "Ceil",
    "Clip",
    "Concat",
    "Conv",
    "Cos",
    "Div",
    "Dropout",
    "Elu",
    "Erf",
    "Exp",
    "Expand",
    "Flatten",
    "Floor",
    "Gather",
    "GatherElements",
    "Gelu",
    "Gemm",
    "GlobalAveragePool",
    "HardSigmoid",
    "Identity",
    "InstanceNormalization",
    "LayerNormalization",
    "LeakyRelu",
    "Log",
    "LogSoftmax",
    "MatMul",
    "Max",
    "MaxPool",
    "AveragePool",
    "Mean",
    "Min",
    "Mul",
    "Neg",
    "Pad",
    "Pow",
    "Reciprocal",
    "ReduceL2",
    "ReduceMax",
    "ReduceMean",
    "ReduceMin",
    "ReduceSum",
    "Relu",
    "Reshape",
    "Resize",
    "Sigmoid",
    "Sin",
    "Slice",
    "Softmax",
    "Softplus",
    "Split",
    "Sqrt",
    "Squeeze",
    "Sub",
    "Sum",
    "Tanh",
    "Tile",
    "Transpose",
    "Unsqueeze",
    "Where",
];

/// Ops whose output has the rank of their first input.
const RANK_KEEPING_OPS: &[&str] = &[
    "Abs",
    "BatchNormalization",
    "Cast",
    "Ceil",
    "Clip",
    "Cos",
    "Dropout",
    "Elu",
    "Erf",
    "Exp",
    "Floor",
    "Gelu",
    "HardSigmoid",
    "Identity",
    "InstanceNormalization",
    "LayerNormalization",
    "LeakyRelu",
    "Log",
    "LogSoftmax",
    "Neg",
    "Reciprocal",
    "Relu",
    "Sigmoid",
    "Sin",
    "Softmax",
    "Softplus",
    "Sqrt",
    "Tanh",
    "Transpose",
];

/// Broadcasting ops: the output's rank is the largest input rank.
const BROADCAST_OPS: &[&str] = &["Add", "Div", "Max", "Mean", "Min", "Mul", "Pow", "Sub", "Sum", "Where"];

/// Ops whose output is int64 whatever their inputs.
const INT64_OPS: &[&str] = &["ArgMax", "ArgMin", "NonZero", "Shape", "Size"];

/// One node, seen by the split: its inputs (including names its subgraphs capture).
struct NodeView<'a> {
    node: &'a NodeProto,
    inputs: Vec<&'a str>,
}

/// The model's graph, analysed once.
struct Analysis<'a> {
    graph: &'a GraphProto,
    /// Nodes in topological order.
    nodes: Vec<NodeView<'a>>,
    /// Tensor -> position of its producer.
    producer: HashMap<&'a str, usize>,
    /// Initializer name -> index in `graph.initializer` (`usize::MAX` + i for sparse ones).
    inits: HashMap<&'a str, Init<'a>>,
    /// Graph inputs that are not initializers, in graph order.
    graph_inputs: Vec<&'a str>,
    /// Value infos by name (graph value_info, inputs, outputs).
    infos: HashMap<&'a str, &'a ValueInfoProto>,
    /// Graph output names.
    outputs: Vec<&'a str>,
}

#[derive(Clone, Copy)]
enum Init<'a> {
    Dense(&'a TensorProto),
    Sparse(&'a super::proto::SparseTensorProto),
}

impl Init<'_> {
    fn bytes(&self) -> u64 {
        match self {
            Init::Dense(t) => tensor_bytes(t),
            Init::Sparse(s) => {
                s.values.as_ref().map_or(0, tensor_bytes) + s.indices.as_ref().map_or(0, tensor_bytes)
            }
        }
    }
}

/// Names a subgraph uses from outside itself (recursively).
fn captures<'a>(g: &'a GraphProto, out: &mut Vec<&'a str>) {
    let mut defined: HashSet<&str> = HashSet::new();
    defined.extend(g.input.iter().filter_map(|i| i.name.as_deref()));
    defined.extend(g.initializer.iter().filter_map(|i| i.name.as_deref()));
    defined.extend(g.sparse_initializer.iter().filter_map(|s| s.values.as_ref()?.name.as_deref()));
    for n in &g.node {
        let mut used: Vec<&str> = n.input.iter().map(String::as_str).collect();
        for a in &n.attribute {
            for sub in a.g.iter().chain(&a.graphs) {
                captures(sub, &mut used);
            }
        }
        out.extend(used.into_iter().filter(|u| !u.is_empty() && !defined.contains(u)));
        defined.extend(n.output.iter().map(String::as_str));
    }
}

impl<'a> Analysis<'a> {
    fn new(graph: &'a GraphProto) -> Result<Self, SplitError> {
        let mut inits = HashMap::new();
        for t in &graph.initializer {
            inits.insert(t.name.as_deref().unwrap_or(""), Init::Dense(t));
        }
        for s in &graph.sparse_initializer {
            if let Some(name) = s.values.as_ref().and_then(|v| v.name.as_deref()) {
                inits.insert(name, Init::Sparse(s));
            }
        }
        let graph_inputs: Vec<&str> =
            graph.input.iter().filter_map(|i| i.name.as_deref()).filter(|n| !inits.contains_key(n)).collect();
        let mut infos = HashMap::new();
        for vi in graph.value_info.iter().chain(&graph.input).chain(&graph.output) {
            if let Some(n) = vi.name.as_deref() {
                infos.insert(n, vi);
            }
        }
        let outputs: Vec<&str> = graph.output.iter().filter_map(|o| o.name.as_deref()).collect();

        // Who makes what, in file order; then a stable topological sort (Kahn, smallest index first).
        let views: Vec<NodeView<'a>> = graph
            .node
            .iter()
            .map(|node| {
                let mut inputs: Vec<&str> =
                    node.input.iter().map(String::as_str).filter(|s| !s.is_empty()).collect();
                for a in &node.attribute {
                    for sub in a.g.iter().chain(&a.graphs) {
                        captures(sub, &mut inputs);
                    }
                }
                NodeView { node, inputs }
            })
            .collect();
        let mut made_by: HashMap<&str, usize> = HashMap::new();
        for (i, v) in views.iter().enumerate() {
            for o in v.node.output.iter().filter(|o| !o.is_empty()) {
                if inits.contains_key(o.as_str()) || graph_inputs.contains(&o.as_str()) {
                    return Err(SplitError::Graph(format!("tensor '{o}' is both made by a node and given")));
                }
                if made_by.insert(o, i).is_some() {
                    return Err(SplitError::Graph(format!("tensor '{o}' is made by two nodes")));
                }
            }
        }
        let is_given = |t: &str| inits.contains_key(t) || graph_inputs.contains(&t);
        let mut waiting = vec![0usize; views.len()];
        let mut users: Vec<Vec<usize>> = vec![Vec::new(); views.len()];
        for (i, v) in views.iter().enumerate() {
            for t in &v.inputs {
                match made_by.get(t) {
                    Some(&p) => {
                        waiting[i] += 1;
                        users[p].push(i);
                    }
                    None if is_given(t) => {}
                    None => {
                        return Err(SplitError::Graph(format!(
                            "node '{}' ({}) uses tensor '{t}', which nothing defines",
                            v.node.name.as_deref().unwrap_or(""),
                            v.node.op_type.as_deref().unwrap_or("")
                        )));
                    }
                }
            }
        }
        let mut ready: BinaryHeap<Reverse<usize>> =
            (0..views.len()).filter(|&i| waiting[i] == 0).map(Reverse).collect();
        let mut order = Vec::with_capacity(views.len());
        while let Some(Reverse(i)) = ready.pop() {
            order.push(i);
            for &u in &users[i] {
                waiting[u] -= 1;
                if waiting[u] == 0 {
                    ready.push(Reverse(u));
                }
            }
        }
        if order.len() != views.len() {
            return Err(SplitError::Graph(format!("{} nodes are on a cycle", views.len() - order.len())));
        }
        for o in &outputs {
            if !made_by.contains_key(o) && !is_given(o) {
                return Err(SplitError::Graph(format!("graph output '{o}' is not defined")));
            }
        }
        let mut slots: Vec<Option<NodeView<'a>>> = views.into_iter().map(Some).collect();
        let nodes: Vec<NodeView<'a>> = order.iter().filter_map(|&i| slots[i].take()).collect();
        let mut producer = HashMap::new();
        for (p, v) in nodes.iter().enumerate() {
            for o in v.node.output.iter().filter(|o| !o.is_empty()) {
                producer.insert(o.as_str(), p);
            }
        }
        Ok(Analysis { graph, nodes, producer, inits, graph_inputs, infos, outputs })
    }

    /// Per made tensor, the graph inputs it depends on (bit sets over `graph_inputs`).
    fn dependencies(&self) -> HashMap<&'a str, Vec<u64>> {
        let words = self.graph_inputs.len().div_ceil(64).max(1);
        let mut deps: HashMap<&'a str, Vec<u64>> = HashMap::new();
        for (i, g) in self.graph_inputs.iter().enumerate() {
            let mut set = vec![0u64; words];
            set[i / 64] |= 1 << (i % 64);
            deps.insert(g, set);
        }
        for v in &self.nodes {
            let mut set = vec![0u64; words];
            for t in &v.inputs {
                if let Some(d) = deps.get(t) {
                    set.iter_mut().zip(d).for_each(|(a, b)| *a |= b);
                }
            }
            for o in v.node.output.iter().filter(|o| !o.is_empty()) {
                deps.insert(o, set.clone());
            }
        }
        deps
    }

    /// The valid cuts, in order, each with the reason it cannot be used (if any).
    fn cuts(&self) -> Vec<Cut<'a>> {
        let n = self.nodes.len();
        let deps = self.dependencies();
        let mut last_use: HashMap<&str, usize> = HashMap::new();
        for (p, v) in self.nodes.iter().enumerate() {
            for t in &v.inputs {
                if self.producer.contains_key(t) {
                    last_use.insert(t, p);
                }
            }
        }
        for o in &self.outputs {
            last_use.insert(o, n);
        }
        let mut live: BTreeSet<(usize, &str)> = BTreeSet::new(); // (producer position, name)
        let mut found: Vec<Cut<'a>> = Vec::new();
        for p in 1..n {
            let prev = &self.nodes[p - 1];
            for o in prev.node.output.iter().filter(|o| !o.is_empty()) {
                if last_use.get(o.as_str()).is_some_and(|&u| u >= p) {
                    live.insert((p - 1, o.as_str()));
                }
            }
            live.retain(|(_, t)| last_use.get(t).is_some_and(|&u| u >= p));
            let empty = Vec::new();
            let dep = |t: &str| deps.get(t).unwrap_or(&empty);
            let mut widest: Vec<u64> = Vec::new();
            for (_, t) in &live {
                let d = dep(t);
                if widest.len() < d.len() {
                    widest.resize(d.len(), 0);
                }
                widest.iter_mut().zip(d).for_each(|(a, b)| *a |= b);
            }
            if widest.iter().all(|w| *w == 0) {
                continue;
            }
            let main: Vec<&str> = live.iter().filter(|(_, t)| dep(t) == &widest).map(|&(_, t)| t).collect();
            if let [tensor] = main[..]
                && !self.outputs.contains(&tensor)
                && !found.iter().any(|c| c.tensor == tensor)
                && self.side_is_light(live.iter().map(|&(_, t)| t).filter(|&t| t != tensor))
            {
                found.push(Cut { tensor, position: p, problem: self.cut_problem(tensor) });
            }
        }
        found
    }

    /// Whether recomputing these side tensors from the graph inputs takes at most
    /// [`SIDE_RECOMPUTE_MAX_BYTES`] of weights (a mask bias does; a second copy of an embedding
    /// table, which the residual stream of a first layer depends on, does not).
    fn side_is_light<'s>(&self, side: impl Iterator<Item = &'s str>) -> bool
    where
        'a: 's,
    {
        let side: Vec<&str> = side.collect();
        side.is_empty() || self.stage_weight(&self.stage_nodes(None, &side)) <= SIDE_RECOMPUTE_MAX_BYTES
    }

    /// Why this tensor cannot carry a cut, if it cannot.
    fn cut_problem(&self, tensor: &'a str) -> Option<SplitError> {
        let p = *self.producer.get(tensor)?;
        let node = self.nodes[p].node;
        let op = node.op_type.clone().unwrap_or_default();
        let domain = match node.domain.as_deref() {
            None | Some("") | Some("ai.onnx") => String::new(),
            Some(d) => format!(" in domain {d}"),
        };
        let refuse = |detail: String| SplitError::UnsupportedAtCut {
            tensor: tensor.to_owned(),
            op: op.clone(),
            domain: domain.clone(),
            detail,
        };
        match self.elem_type(tensor, 0) {
            Some(FLOAT | INT64) if self.rank(tensor, 0).is_some() => None,
            Some(FLOAT | INT64) => Some(refuse(
                "its rank cannot be told (no shape in its value_info and the op is unknown to the split; \
                 run ONNX shape inference on the model first)"
                    .into(),
            )),
            Some(other) => Some(refuse(format!(
                "its type is {}; pipeline stages pass only FLOAT and INT64",
                dtype_name(other)
            ))),
            None => Some(refuse(
                "its type cannot be told (no value_info for it and the op is unknown to the split; \
                 run ONNX shape inference on the model first)"
                    .into(),
            )),
        }
    }

    /// Rank of a tensor: from value_info, initializers, else propagated through known ops.
    fn rank(&self, tensor: &str, depth: usize) -> Option<usize> {
        if let Some(vi) = self.infos.get(tensor) {
            return match vi.r#type.as_ref()?.value.as_ref()? {
                type_proto::Value::TensorType(t) => t.shape.as_ref().map(|s| s.dim.len()),
                _ => None,
            };
        }
        if let Some(init) = self.inits.get(tensor) {
            return Some(match init {
                Init::Dense(t) => t.dims.len(),
                Init::Sparse(s) => s.dims.len(),
            });
        }
        let node = self.nodes[*self.producer.get(tensor)?].node;
        if depth > 64 || !matches!(node.domain.as_deref(), None | Some("") | Some("ai.onnx")) {
            return None;
        }
        let input = |i: usize| node.input.get(i).and_then(|t| self.rank(t, depth + 1));
        let op = node.op_type.as_deref()?;
        if RANK_KEEPING_OPS.contains(&op) {
            return input(0);
        }
        if BROADCAST_OPS.contains(&op) {
            return (0..node.input.len()).map(input).try_fold(0, |acc, r| r.map(|r| acc.max(r)));
        }
        match op {
            "MatMul" => match (input(0)?, input(1)?) {
                (a, b) if a >= 2 && b >= 2 => Some(a.max(b)),
                _ => None,
            },
            "Gather" => (input(0)? + input(1)?).checked_sub(1),
            "Shape" => Some(1),
            "Size" => Some(0),
            _ => None,
        }
    }

    /// Element type of a tensor: from value_info, initializers, else propagated through known ops.
    fn elem_type(&self, tensor: &str, depth: usize) -> Option<i32> {
        if let Some(vi) = self.infos.get(tensor) {
            return elem_type_of(vi);
        }
        if let Some(init) = self.inits.get(tensor) {
            return match init {
                Init::Dense(t) => t.data_type,
                Init::Sparse(s) => s.values.as_ref()?.data_type,
            };
        }
        let node = self.nodes[*self.producer.get(tensor)?].node;
        if depth > 64 || !matches!(node.domain.as_deref(), None | Some("") | Some("ai.onnx")) {
            return None;
        }
        let op = node.op_type.as_deref()?;
        if INT64_OPS.contains(&op) {
            return Some(INT64);
        }
        if op == "Cast" {
            return node.attribute.iter().find(|a| a.name.as_deref() == Some("to"))?.i.map(|i| i as i32);
        }
        if op == "Gather" || op == "Where" {
            // Data is the first input of Gather, the second of Where.
            let data = if op == "Where" { node.input.get(1)? } else { node.input.first()? };
            return self.elem_type(data, depth + 1);
        }
        if SAME_TYPE_OPS.contains(&op) {
            return self.elem_type(node.input.first()?, depth + 1);
        }
        None
    }

    /// Node positions of the stage from `from` (None: the graph inputs) to `to` (None: the graph
    /// outputs), as `extract_model` would cut it.
    fn stage_nodes(&self, from: Option<&str>, to: &[&'a str]) -> Vec<usize> {
        let mut seen = vec![false; self.nodes.len()];
        let mut stack: Vec<&str> = to.to_vec();
        while let Some(t) = stack.pop() {
            if Some(t) == from {
                continue;
            }
            if let Some(&p) = self.producer.get(t)
                && !seen[p]
            {
                seen[p] = true;
                stack.extend(self.nodes[p].inputs.iter().copied());
            }
        }
        (0..self.nodes.len()).filter(|&p| seen[p]).collect()
    }

    fn stage_weight(&self, nodes: &[usize]) -> u64 {
        let used: HashSet<&str> = nodes
            .iter()
            .flat_map(|&p| self.nodes[p].inputs.iter().copied())
            .filter(|t| self.inits.contains_key(t))
            .collect();
        used.iter().filter_map(|t| self.inits.get(t)).map(Init::bytes).sum()
    }

    fn value_info_for(&self, tensor: &str) -> ValueInfoProto {
        if let Some(vi) = self.infos.get(tensor) {
            return (*vi).clone();
        }
        ValueInfoProto {
            name: Some(tensor.to_owned()),
            r#type: Some(TypeProto {
                value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                    elem_type: self.elem_type(tensor, 0),
                    shape: self.rank(tensor, 0).map(|r| TensorShapeProto {
                        dim: vec![super::proto::tensor_shape_proto::Dimension::default(); r],
                    }),
                })),
                denotation: None,
            }),
            ..Default::default()
        }
    }

    fn stage(
        &self,
        model: &ModelProto,
        k: usize,
        count: usize,
        from: Option<&'a str>,
        to: Option<&'a str>,
    ) -> Stage {
        let outputs: Vec<&str> = match to {
            Some(t) => vec![t],
            None => self.outputs.clone(),
        };
        let nodes = self.stage_nodes(from, &outputs);
        let used: HashSet<&str> = nodes.iter().flat_map(|&p| self.nodes[p].inputs.iter().copied()).collect();
        let made: HashSet<&str> =
            nodes.iter().flat_map(|&p| self.nodes[p].node.output.iter().map(String::as_str)).collect();
        let mut inputs: Vec<ValueInfoProto> = Vec::new();
        if let Some(c) = from {
            inputs.push(self.value_info_for(c));
        }
        for gi in self
            .graph
            .input
            .iter()
            .filter(|i| i.name.as_deref().is_some_and(|n| self.graph_inputs.contains(&n)))
        {
            let name = gi.name.as_deref().unwrap_or("");
            if used.contains(name) || (k == 0 && outputs.contains(&name)) {
                inputs.push(gi.clone());
            }
        }
        let out_infos: Vec<ValueInfoProto> = match to {
            Some(t) => vec![self.value_info_for(t)],
            None => self.graph.output.clone(),
        };
        let g = self.graph;
        let graph = GraphProto {
            node: nodes.iter().map(|&p| self.nodes[p].node.clone()).collect(),
            name: Some(format!("{}_stage{k}", g.name.as_deref().unwrap_or("graph"))),
            initializer: g
                .initializer
                .iter()
                .filter(|t| t.name.as_deref().is_some_and(|n| used.contains(n)))
                .cloned()
                .collect(),
            sparse_initializer: g
                .sparse_initializer
                .iter()
                .filter(|s| {
                    s.values.as_ref().and_then(|v| v.name.as_deref()).is_some_and(|n| used.contains(n))
                })
                .cloned()
                .collect(),
            doc_string: g.doc_string.clone(),
            value_info: g
                .value_info
                .iter()
                .filter(|v| v.name.as_deref().is_some_and(|n| made.contains(n) && !outputs.contains(&n)))
                .cloned()
                .collect(),
            input: inputs.clone(),
            output: out_infos.clone(),
            quantization_annotation: g
                .quantization_annotation
                .iter()
                .filter(|a| a.tensor_name.as_deref().is_some_and(|n| made.contains(n) || used.contains(n)))
                .cloned()
                .collect(),
            metadata_props: g.metadata_props.clone(),
        };
        let mut stage_model = model.clone();
        stage_model.graph = Some(graph);
        stage_model.training_info.clear();
        stage_model.doc_string = Some(format!(
            "stage {k} of {count} cut by troupe pipeline split{}",
            match (from, to) {
                (Some(a), Some(b)) => format!(" ({a} -> {b})"),
                (None, Some(b)) => format!(" (graph inputs -> {b})"),
                (Some(a), None) => format!(" ({a} -> graph outputs)"),
                (None, None) => String::new(),
            }
        ));
        Stage {
            weight_bytes: self.stage_weight(&nodes),
            nodes: nodes.len(),
            inputs: inputs.iter().map(tensor_info).collect(),
            outputs: out_infos.iter().map(tensor_info).collect(),
            model: stage_model,
        }
    }
}

/// A valid cut point.
struct Cut<'a> {
    tensor: &'a str,
    position: usize,
    problem: Option<SplitError>,
}

/// A cut point as reported by [`cut_points`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CutPoint {
    /// The tensor that crosses alone.
    pub tensor: String,
    /// Nodes before it (in topological order).
    pub position: usize,
    /// Why it cannot be used, if it cannot.
    pub problem: Option<String>,
}

/// Every valid cut point of a model, in order.
pub fn cut_points(model: &ModelProto) -> Result<Vec<CutPoint>, SplitError> {
    let graph = model.graph.as_ref().ok_or_else(|| SplitError::Graph("the model has no graph".into()))?;
    let a = Analysis::new(graph)?;
    Ok(a.cuts()
        .into_iter()
        .map(|c| CutPoint {
            tensor: c.tensor.to_owned(),
            position: c.position,
            problem: c.problem.map(|e| e.to_string()),
        })
        .collect())
}

/// Picks `k - 1` of the usable cuts minimising (largest stage bytes, sum of squares): a dynamic
/// programme over boundaries, `O(k m^2)` stage costs for `m` cuts (each costed once, memoised).
// The table is indexed by (stages, boundary) on both sides of each step; indices read clearer
// than iterator adaptors here.
#[allow(clippy::needless_range_loop)]
fn balance(a: &Analysis<'_>, cuts: &[&str], k: usize) -> Vec<usize> {
    let m = cuts.len();
    // Boundaries: 0 = graph inputs, 1..=m = cuts, m + 1 = graph outputs.
    let bound = |i: usize| -> Option<&str> { if i == 0 || i > m { None } else { Some(cuts[i - 1]) } };
    let mut cost: HashMap<(usize, usize), u64> = HashMap::new();
    let mut cost_of = |i: usize, j: usize| -> u64 {
        *cost.entry((i, j)).or_insert_with(|| {
            let to: Vec<&str> = match bound(j) {
                Some(t) => vec![t],
                None => a.outputs.clone(),
            };
            a.stage_weight(&a.stage_nodes(bound(i), &to))
        })
    };
    type Score = (u64, u128);
    // best[s][j]: best score of s + 1 stages ending at boundary j; with the previous boundary.
    let mut best: Vec<Vec<Option<(Score, usize)>>> = vec![vec![None; m + 2]; k];
    for j in 1..=m + 1 {
        let c = cost_of(0, j);
        best[0][j] = Some(((c, u128::from(c) * u128::from(c)), 0));
    }
    for s in 1..k {
        for j in (s + 1)..=m + 1 {
            let mut pick: Option<(Score, usize)> = None;
            for i in s..j {
                let Some(((mx, sq), _)) = best[s - 1][i] else { continue };
                let c = cost_of(i, j);
                let score = (mx.max(c), sq + u128::from(c) * u128::from(c));
                if pick.is_none_or(|(p, _)| score < p) {
                    pick = Some((score, i));
                }
            }
            best[s][j] = pick;
        }
    }
    let mut chosen = Vec::with_capacity(k - 1);
    let mut j = m + 1;
    for s in (1..k).rev() {
        let Some((_, i)) = best[s][j] else { break };
        chosen.push(i - 1);
        j = i;
    }
    chosen.reverse();
    chosen
}

/// Cuts a model into stages by `plan`.
pub fn split_model(model: &ModelProto, plan: &CutPlan) -> Result<Split, SplitError> {
    let graph = model.graph.as_ref().ok_or_else(|| SplitError::Graph("the model has no graph".into()))?;
    let a = Analysis::new(graph)?;
    let cuts = a.cuts();
    let describe = |cs: &[Cut<'_>]| -> String {
        let names: Vec<&str> = cs.iter().filter(|c| c.problem.is_none()).map(|c| c.tensor).collect();
        format!(
            "the graph has {} usable cut point(s){}",
            names.len(),
            if names.is_empty() { String::new() } else { format!(" ({})", names.join(", ")) }
        )
    };
    let chosen: Vec<&str> = match plan {
        CutPlan::Balanced { stages } => {
            let k = *stages;
            if k == 0 || k > MAX_STAGES {
                return Err(SplitError::BadStageCount { stages: k });
            }
            let usable: Vec<&str> = cuts.iter().filter(|c| c.problem.is_none()).map(|c| c.tensor).collect();
            if usable.len() < k - 1 {
                let described = describe(&cuts);
                // A cut refused for its op or type would have made it possible: name that problem.
                if usable.len() + cuts.iter().filter(|c| c.problem.is_some()).count() >= k - 1
                    && let Some(problem) = cuts.into_iter().find_map(|c| c.problem)
                {
                    return Err(problem);
                }
                return Err(SplitError::NoValidCut {
                    stages: k,
                    detail: format!("{described}; {k} stages need {}", k - 1),
                });
            }
            balance(&a, &usable, k).into_iter().map(|i| usable[i]).collect()
        }
        CutPlan::At(names) => {
            if names.len() + 1 > MAX_STAGES {
                return Err(SplitError::BadStageCount { stages: names.len() + 1 });
            }
            let mut last = 0usize;
            let mut chosen = Vec::new();
            for name in names {
                let Some(i) = cuts.iter().position(|c| c.tensor == name) else {
                    let detail = if a.producer.contains_key(name.as_str()) {
                        format!("another activation crosses there too; {}", describe(&cuts))
                    } else {
                        format!("no node makes a tensor of that name; {}", describe(&cuts))
                    };
                    return Err(SplitError::NotACut { tensor: name.clone(), detail });
                };
                if i < last || chosen.contains(&cuts[i].tensor) {
                    return Err(SplitError::NotACut {
                        tensor: name.clone(),
                        detail: "cuts must be named in graph order, each once".into(),
                    });
                }
                last = i;
                chosen.push(cuts[i].tensor);
            }
            if let Some(problem) =
                cuts.into_iter().filter(|c| chosen.contains(&c.tensor)).find_map(|c| c.problem)
            {
                return Err(problem);
            }
            chosen
        }
    };
    let count = chosen.len() + 1;
    let stages = (0..count)
        .map(|k| {
            let from = if k == 0 { None } else { Some(chosen[k - 1]) };
            let to = chosen.get(k).copied();
            a.stage(model, k, count, from, to)
        })
        .collect();
    Ok(Split { cuts: chosen.iter().map(|s| (*s).to_owned()).collect(), stages })
}

/// Writes each stage as `DIR/{prefix}_stage{k}.onnx` and `DIR/{prefix}_split.json`, the manifest
/// (stage files, SHA-256, inputs/outputs, bytes, weight bytes). Returns what was written.
pub fn write_split(
    split: &Split,
    source: (&Path, &LoadedModel),
    dir: &Path,
    prefix: &str,
) -> Result<(Vec<WrittenStage>, PathBuf), SplitError> {
    fs::create_dir_all(dir).map_err(|source| SplitError::Io { path: dir.to_owned(), source })?;
    let mut written = Vec::with_capacity(split.stages.len());
    let mut entries = Vec::with_capacity(split.stages.len());
    for (k, stage) in split.stages.iter().enumerate() {
        let path = dir.join(format!("{prefix}_stage{k}.onnx"));
        let len = stage.model.encoded_len() as u64;
        if len > PROTOBUF_LIMIT {
            return Err(SplitError::TooLarge { path, bytes: len, cap: PROTOBUF_LIMIT });
        }
        let bytes = stage.model.encode_to_vec();
        write_atomic(&path, &bytes)?;
        let sha256 = sha256_hex(&bytes);
        let info = |ts: &[TensorInfo]| -> serde_json::Value {
            ts.iter()
                .map(|t| serde_json::json!({ "name": t.name, "dtype": t.dtype, "dims": t.dims }))
                .collect()
        };
        entries.push(serde_json::json!({
            "index": k,
            "file": path.file_name().map(|f| f.to_string_lossy().into_owned()),
            "sha256": sha256,
            "bytes": bytes.len(),
            "weight_bytes": stage.weight_bytes,
            "nodes": stage.nodes,
            "inputs": info(&stage.inputs),
            "outputs": info(&stage.outputs),
        }));
        written.push(WrittenStage { path, sha256, bytes: bytes.len() as u64 });
    }
    let manifest = serde_json::json!({
        "format": "troupe-pipeline-split/1",
        "source": {
            "file": source.0.display().to_string(),
            "sha256": source.1.sha256,
            "bytes": source.1.bytes,
        },
        "cuts": split.cuts,
        "stages": entries,
    });
    let path = dir.join(format!("{prefix}_split.json"));
    let text = serde_json::to_vec_pretty(&manifest)
        .map_err(|e| SplitError::Io { path: path.clone(), source: std::io::Error::other(e) })?;
    write_atomic(&path, &text)?;
    Ok((written, path))
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), SplitError> {
    let tmp = path.with_extension("tmp");
    let io = |source| SplitError::Io { path: path.to_owned(), source };
    fs::write(&tmp, bytes).map_err(io)?;
    fs::rename(&tmp, path).map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::onnx::writer::{FLOAT, float_tensor, int_attribute, model, node, value_info};
    use crate::onnx::{NamedTensor, OnnxSession, SessionConfig};

    fn w(name: &str, seed: f32) -> TensorProto {
        let data: Vec<f32> = (0..16).map(|i| ((i as f32) * 0.37 + seed).sin()).collect();
        float_tensor(name, &[4, 4], &data)
    }

    /// x, m: f32 [N, 4]. a = x W0; b = relu(a); ms = m * c2 (side: depends on m only);
    /// c = b + ms; d = c W1; y = d + ms. Cuts: a, b, c, d (after ms, b and ms both cross).
    fn side_graph() -> ModelProto {
        let io = [Err("n"), Ok(4)];
        model(GraphProto {
            node: vec![
                node("MatMul", &["x", "w0"], &["a"], vec![]),
                node("Relu", &["a"], &["b"], vec![]),
                node("Mul", &["m", "c2"], &["ms"], vec![]),
                node("Add", &["b", "ms"], &["c"], vec![]),
                node("MatMul", &["c", "w1"], &["d"], vec![]),
                node("Add", &["d", "ms"], &["y"], vec![]),
            ],
            name: Some("side".into()),
            initializer: vec![w("w0", 0.1), w("w1", 0.7), float_tensor("c2", &[], &[0.5])],
            input: vec![value_info("x", FLOAT, &io), value_info("m", FLOAT, &io)],
            output: vec![value_info("y", FLOAT, &io)],
            ..Default::default()
        })
    }

    fn run_chain(stages: &[ModelProto], x: &[f32], m: &[f32]) -> Vec<f32> {
        let mut have: HashMap<String, NamedTensor> = HashMap::new();
        have.insert("x".into(), NamedTensor::f32("x", vec![2, 4], x.to_vec()));
        have.insert("m".into(), NamedTensor::f32("m", vec![2, 4], m.to_vec()));
        for (k, s) in stages.iter().enumerate() {
            let bytes = s.encode_to_vec();
            let mut sess =
                OnnxSession::from_bytes(&bytes, &format!("stage{k}"), &SessionConfig::default()).unwrap();
            let feed: Vec<NamedTensor> = sess.inputs().iter().map(|i| have[&i.name].clone()).collect();
            for t in sess.run(&feed).unwrap() {
                have.insert(t.name.clone(), t);
            }
        }
        have["y"].as_f32().unwrap().to_vec()
    }

    #[test]
    fn finds_single_tensor_cuts_with_side_inputs_passing_through() {
        let m = side_graph();
        let cuts: Vec<String> = cut_points(&m).unwrap().into_iter().map(|c| c.tensor).collect();
        assert_eq!(cuts, ["a", "b", "c", "d"]);
        let split = split_model(&m, &CutPlan::At(vec!["c".into()])).unwrap();
        let names = |ts: &[TensorInfo]| ts.iter().map(|t| t.name.clone()).collect::<Vec<_>>();
        assert_eq!(names(&split.stages[0].inputs), ["x", "m"]);
        assert_eq!(names(&split.stages[0].outputs), ["c"]);
        // The side tensor ms is recomputed from m in stage 1.
        assert_eq!(names(&split.stages[1].inputs), ["c", "m"]);
        assert_eq!(split.stages[1].nodes, 3);
        assert_eq!(split.stages[1].weight_bytes, 64 + 4);
    }

    #[test]
    fn balanced_stages_chain_on_onnx_runtime_like_the_whole_model() {
        let m = side_graph();
        let x: Vec<f32> = (0..8).map(|i| i as f32 * 0.25 - 1.0).collect();
        let mm: Vec<f32> = (0..8).map(|i| (i as f32 * 0.9).cos()).collect();
        let whole = run_chain(std::slice::from_ref(&m), &x, &mm);
        for k in 1..=5 {
            let split = split_model(&m, &CutPlan::Balanced { stages: k }).unwrap();
            assert_eq!(split.stages.len(), k);
            let models: Vec<ModelProto> = split.stages.iter().map(|s| s.model.clone()).collect();
            assert_eq!(run_chain(&models, &x, &mm), whole, "K = {k}, cuts {:?}", split.cuts);
        }
        // K = 2: w0 alone (64 bytes) against w1 + c2 (68): the most even split.
        let split = split_model(&m, &CutPlan::Balanced { stages: 2 }).unwrap();
        let bytes: Vec<u64> = split.stages.iter().map(|s| s.weight_bytes).collect();
        assert_eq!(bytes, [64, 68], "cuts {:?}", split.cuts);
    }

    #[test]
    fn refuses_more_stages_than_cuts_and_names_that_are_no_cut() {
        let m = side_graph();
        let err = split_model(&m, &CutPlan::Balanced { stages: 6 }).unwrap_err();
        assert!(matches!(err, SplitError::NoValidCut { stages: 6, .. }), "{err}");
        assert!(err.to_string().contains("4 usable cut point(s) (a, b, c, d)"), "{err}");
        let err = split_model(&m, &CutPlan::At(vec!["ms".into()])).unwrap_err();
        assert!(matches!(&err, SplitError::NotACut { tensor, .. } if tensor == "ms"), "{err}");
        let err = split_model(&m, &CutPlan::At(vec!["nope".into()])).unwrap_err();
        assert!(err.to_string().contains("no node makes a tensor of that name"), "{err}");
        let err = split_model(&m, &CutPlan::At(vec!["c".into(), "a".into()])).unwrap_err();
        assert!(err.to_string().contains("graph order"), "{err}");
        assert!(matches!(
            split_model(&m, &CutPlan::Balanced { stages: 0 }),
            Err(SplitError::BadStageCount { .. })
        ));
    }

    /// x -> OP -> t -> Relu -> y: `t` is the only possible cut.
    fn one_cut(op: NodeProto) -> ModelProto {
        let io = [Err("n"), Ok(4)];
        model(GraphProto {
            node: vec![op, node("Relu", &["t"], &["y"], vec![])],
            input: vec![value_info("x", FLOAT, &io)],
            output: vec![value_info("y", FLOAT, &io)],
            ..Default::default()
        })
    }

    #[test]
    fn refuses_an_unknown_op_or_an_uncarried_type_at_the_cut() {
        let mut custom = node("Frobnicate", &["x"], &["t"], vec![]);
        custom.domain = Some("com.example".into());
        let err = split_model(&one_cut(custom.clone()), &CutPlan::Balanced { stages: 2 }).unwrap_err();
        assert!(
            matches!(&err, SplitError::UnsupportedAtCut { tensor, op, .. } if tensor == "t" && op == "Frobnicate")
        );
        assert!(err.to_string().contains("in domain com.example"), "{err}");
        // With a value_info for t, the type is known and the cut is fine.
        let mut typed = one_cut(custom);
        if let Some(g) = typed.graph.as_mut() {
            g.value_info.push(value_info("t", FLOAT, &[Err("n"), Ok(4)]));
        }
        assert_eq!(split_model(&typed, &CutPlan::Balanced { stages: 2 }).unwrap().cuts, ["t"]);
        // A type without a shape is not enough: stages declare the rank of what they pass.
        if let Some(g) = typed.graph.as_mut()
            && let Some(type_proto::Value::TensorType(t)) =
                g.value_info[0].r#type.as_mut().and_then(|t| t.value.as_mut())
        {
            t.shape = None;
        }
        let err = split_model(&typed, &CutPlan::Balanced { stages: 2 }).unwrap_err();
        assert!(err.to_string().contains("rank cannot be told"), "{err}");
        // A double tensor cannot travel between pipeline stages.
        let cast = node("Cast", &["x"], &["t"], vec![int_attribute("to", 11)]);
        let err = split_model(&one_cut(cast), &CutPlan::At(vec!["t".into()])).unwrap_err();
        assert!(err.to_string().contains("DOUBLE"), "{err}");
    }

    #[test]
    fn refuses_broken_graphs() {
        let mut m = side_graph();
        if let Some(g) = m.graph.as_mut() {
            g.node[0].input[0] = "d".into(); // a <- d <- c <- b <- a
        }
        let err = split_model(&m, &CutPlan::Balanced { stages: 2 }).unwrap_err();
        assert!(err.to_string().contains("cycle"), "{err}");
        let mut m = side_graph();
        if let Some(g) = m.graph.as_mut() {
            g.node[1].input[0] = "ghost".into();
        }
        let err = split_model(&m, &CutPlan::Balanced { stages: 2 }).unwrap_err();
        assert!(err.to_string().contains("'ghost', which nothing defines"), "{err}");
        let err = decode_model(&[0xff; 16], "junk").unwrap_err();
        assert!(matches!(err, SplitError::Decode { .. }), "{err}");
    }

    fn with_external_w0(location: &str, length: Option<u64>) -> ModelProto {
        let mut m = side_graph();
        if let Some(g) = m.graph.as_mut() {
            let t = &mut g.initializer[0];
            t.raw_data = None;
            t.data_location = Some(tensor_proto::DataLocation::External as i32);
            let entry = |k: &str, v: String| super::super::proto::StringStringEntryProto {
                key: Some(k.into()),
                value: Some(v),
            };
            t.external_data.push(entry("location", location.into()));
            t.external_data.push(entry("offset", "0".into()));
            if let Some(l) = length {
                t.external_data.push(entry("length", l.to_string()));
            }
        }
        m
    }

    #[test]
    fn external_data_is_inlined_when_present_and_refused_when_missing_or_outside() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.onnx");
        let raw = side_graph().graph.unwrap().initializer[0].raw_data.clone().unwrap();

        fs::write(&path, with_external_w0("w0.bin", Some(64)).encode_to_vec()).unwrap();
        let err = load_model(&path, &Limits::default()).unwrap_err();
        assert!(matches!(&err, SplitError::ExternalData { tensor, .. } if tensor == "w0"), "{err}");
        assert!(err.to_string().contains("is missing"), "{err}");

        fs::write(dir.path().join("w0.bin"), &raw[..32]).unwrap();
        let err = load_model(&path, &Limits::default()).unwrap_err();
        assert!(err.to_string().contains("past the end"), "{err}");

        fs::write(dir.path().join("w0.bin"), &raw).unwrap();
        let loaded = load_model(&path, &Limits::default()).unwrap();
        let g = loaded.model.graph.as_ref().unwrap();
        assert_eq!(g.initializer[0].raw_data.as_deref(), Some(raw.as_slice()));
        assert!(g.initializer[0].external_data.is_empty());
        let limits = Limits { max_external_bytes: 63, ..Limits::default() };
        assert!(load_model(&path, &limits).unwrap_err().to_string().contains("cap"));

        fs::write(&path, with_external_w0("../w0.bin", None).encode_to_vec()).unwrap();
        let err = load_model(&path, &Limits::default()).unwrap_err();
        assert!(err.to_string().contains("inside the model's folder"), "{err}");
    }

    #[test]
    fn refuses_a_file_above_the_cap_before_reading_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.onnx");
        let bytes = side_graph().encode_to_vec();
        fs::write(&path, &bytes).unwrap();
        let limits = Limits { max_model_bytes: 100, ..Limits::default() };
        let err = load_model(&path, &limits).unwrap_err();
        assert!(matches!(err, SplitError::TooLarge { cap: 100, .. }), "{err}");
        assert_eq!(load_model(&path, &Limits::default()).unwrap().bytes, bytes.len() as u64);
        let err = load_model(&dir.path().join("absent.onnx"), &Limits::default()).unwrap_err();
        assert!(err.to_string().contains("absent.onnx"), "{err}");
    }

    #[test]
    fn writes_stage_files_and_a_manifest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("side.onnx");
        fs::write(&path, side_graph().encode_to_vec()).unwrap();
        let loaded = load_model(&path, &Limits::default()).unwrap();
        let split = split_model(&loaded.model, &CutPlan::Balanced { stages: 3 }).unwrap();
        let out = dir.path().join("out");
        let (written, manifest) = write_split(&split, (&path, &loaded), &out, "side").unwrap();
        assert_eq!(written.len(), 3);
        let json: serde_json::Value = serde_json::from_slice(&fs::read(manifest).unwrap()).unwrap();
        assert_eq!(json["source"]["sha256"], loaded.sha256.as_str());
        for (k, w) in written.iter().enumerate() {
            let bytes = fs::read(&w.path).unwrap();
            assert_eq!(sha256_hex(&bytes), w.sha256);
            assert_eq!(json["stages"][k]["sha256"], w.sha256.as_str());
            assert_eq!(json["stages"][k]["file"], format!("side_stage{k}.onnx").as_str());
            assert!(decode_model(&bytes, "stage").is_ok());
        }
    }
}

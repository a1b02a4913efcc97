//! Reads back an MLP that [`writer::mlp_model`](super::writer::mlp_model) wrote: the chain
//! `MatMul -> Add (bias) [-> Relu]` per layer, ReLU between layers only, then `Softmax` over the
//! last axis or nothing (logits). Anything else is refused, naming the node or tensor, so the
//! MLP engine ([`crate::mlp_engine`]) never runs a graph it would compute differently from
//! ONNX Runtime. The file is untrusted: its size, the layer count and the widths are capped
//! before anything is allocated from them.

use std::collections::HashMap;
use std::ops::Range;

use prost::Message;
use prost::encoding::{DecodeContext, WireType, decode_key, decode_varint, skip_field};

use super::proto::{GraphProto, ModelProto, NodeProto, TensorProto, tensor_proto};
use super::writer::{DenseLayer, FLOAT};

/// Caps applied to an (untrusted) MLP model before anything is sized from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlpLimits {
    /// Largest model, bytes (checked before decoding).
    pub max_model_bytes: usize,
    /// Most dense layers.
    pub max_layers: usize,
    /// Widest layer (inputs or outputs).
    pub max_width: usize,
}

impl Default for MlpLimits {
    /// 512 MiB models, 64 layers, 65536 wide.
    fn default() -> Self {
        MlpLimits { max_model_bytes: 512 << 20, max_layers: 64, max_width: 1 << 16 }
    }
}

/// An MLP read from ONNX: its I/O names, dense layers and whether it ends in a softmax.
#[derive(Clone, Debug, PartialEq)]
pub struct MlpGraph {
    /// The graph input (`[batch, layers[0].inputs]`).
    pub input: String,
    /// The graph output (`[batch, last outputs]`).
    pub output: String,
    /// Dense layers in order; ReLU follows every one but the last.
    pub layers: Vec<DenseLayer>,
    /// Whether a row softmax ends the graph (else the output is the last layer's logits).
    pub softmax: bool,
    /// Where each layer's weights and biases lie in the model's bytes, when every one is inline
    /// little-endian `raw_data` starting at a multiple of 4 (so an engine can read them in place,
    /// see [`crate::mlp_engine::ArenaMlp`]); `None` otherwise.
    pub ranges: Option<Vec<LayerRanges>>,
}

/// Byte ranges of one dense layer's parameters inside the model file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerRanges {
    /// The `[inputs, outputs]` weights.
    pub weights: Range<usize>,
    /// The `[outputs]` biases.
    pub bias: Range<usize>,
}

/// Why a model is not an MLP the engine runs.
#[derive(Debug, thiserror::Error)]
pub enum MlpGraphError {
    /// The model is above the byte cap.
    #[error("model of {bytes} bytes is above the {cap}-byte cap")]
    TooLarge {
        /// Its size.
        bytes: usize,
        /// The cap.
        cap: usize,
    },
    /// The bytes are not an ONNX model.
    #[error("not an ONNX model: {0}")]
    Decode(#[from] prost::DecodeError),
    /// The graph is not the writer's dense/bias/ReLU(/Softmax) chain.
    #[error("not a dense/bias/ReLU MLP: {0}")]
    NotMlp(String),
}

fn not_mlp(problem: impl Into<String>) -> MlpGraphError {
    MlpGraphError::NotMlp(problem.into())
}

/// The node's name for messages: its name, else its op and first output.
fn label(n: &NodeProto) -> String {
    let op = n.op_type.as_deref().unwrap_or("?");
    match n.name.as_deref() {
        Some(name) if !name.is_empty() => format!("node {name:?} ({op})"),
        _ => format!("{op} node producing {:?}", n.output.first().map_or("", String::as_str)),
    }
}

/// A float initializer's dims and values, refusing other types, external data and sizes past
/// the width cap (checked before the values are copied).
fn float_values(t: &TensorProto, limits: &MlpLimits) -> Result<(Vec<usize>, Vec<f32>), MlpGraphError> {
    let name = t.name.as_deref().unwrap_or("");
    if t.data_type != Some(FLOAT) {
        return Err(not_mlp(format!("initializer {name:?} has data type {:?}, not FLOAT", t.data_type)));
    }
    if t.data_location == Some(tensor_proto::DataLocation::External as i32) {
        return Err(not_mlp(format!("initializer {name:?} keeps its data in an external file")));
    }
    let mut dims = Vec::with_capacity(t.dims.len().min(2));
    for &d in &t.dims {
        match usize::try_from(d) {
            Ok(d) if d > 0 && d <= limits.max_width => dims.push(d),
            _ => {
                return Err(not_mlp(format!(
                    "initializer {name:?} has dimension {d} (1 to {} allowed)",
                    limits.max_width
                )));
            }
        }
    }
    if dims.len() > 2 {
        return Err(not_mlp(format!("initializer {name:?} has rank {}", dims.len())));
    }
    let count = dims.iter().product::<usize>();
    let values: Vec<f32> = match (&t.raw_data, t.float_data.is_empty()) {
        (Some(raw), true) if raw.len() == 4 * count => {
            raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
        }
        (None, false) if t.float_data.len() == count => t.float_data.clone(),
        _ => {
            let got = t.raw_data.as_ref().map_or(4 * t.float_data.len(), Vec::len);
            return Err(not_mlp(format!(
                "initializer {name:?} holds {got} bytes of data for dims {dims:?} ({} expected)",
                4 * count
            )));
        }
    };
    Ok((dims, values))
}

/// Checks a node's domain (default only) and that it carries no attributes but `allowed`.
fn check_node(n: &NodeProto, inputs: usize, allowed: &[&str]) -> Result<(), MlpGraphError> {
    if !matches!(n.domain.as_deref(), None | Some("") | Some("ai.onnx")) {
        return Err(not_mlp(format!("{} is in domain {:?}", label(n), n.domain)));
    }
    if n.input.len() != inputs || n.output.len() != 1 {
        return Err(not_mlp(format!(
            "{} has {} inputs and {} outputs ({inputs} and 1 expected)",
            label(n),
            n.input.len(),
            n.output.len()
        )));
    }
    if let Some(a) = n.attribute.iter().find(|a| !allowed.contains(&a.name.as_deref().unwrap_or(""))) {
        return Err(not_mlp(format!("{} has attribute {:?}", label(n), a.name)));
    }
    Ok(())
}

/// Decode `bytes` and read the MLP chain (see the module docs).
pub fn parse_mlp(bytes: &[u8], limits: &MlpLimits) -> Result<MlpGraph, MlpGraphError> {
    if bytes.len() > limits.max_model_bytes {
        return Err(MlpGraphError::TooLarge { bytes: bytes.len(), cap: limits.max_model_bytes });
    }
    let model = ModelProto::decode(bytes)?;
    let graph = model.graph.ok_or_else(|| not_mlp("the model has no graph"))?;
    let (mut mlp, names) = read_graph(&graph, limits)?;
    mlp.ranges = layer_ranges(bytes, &mlp.layers, &names)?;
    Ok(mlp)
}

/// Each layer's parameter ranges (see [`MlpGraph::ranges`]), `None` unless every one is an
/// inline `raw_data` of exactly the decoded length at a 4-byte aligned offset.
fn layer_ranges(
    bytes: &[u8],
    layers: &[DenseLayer],
    names: &[(String, String)],
) -> Result<Option<Vec<LayerRanges>>, MlpGraphError> {
    let raw = raw_data_ranges(bytes)?;
    let place = |name: &str, floats: usize| {
        raw.get(name).filter(|r| r.len() == 4 * floats && r.start.is_multiple_of(4)).cloned()
    };
    Ok(layers
        .iter()
        .zip(names)
        .map(|(l, (w, b))| {
            Some(LayerRanges { weights: place(w, l.weights.len())?, bias: place(b, l.bias.len())? })
        })
        .collect())
}

/// Initializer name -> byte range of its `raw_data` in `bytes` (a serialised `ModelProto`),
/// with protobuf's rules: a later graph's initializers are appended, a later `raw_data` or name
/// in one tensor replaces the earlier, and a later tensor of the same name wins.
pub fn raw_data_ranges(bytes: &[u8]) -> Result<HashMap<String, Range<usize>>, MlpGraphError> {
    const MODEL_GRAPH: u32 = 7;
    const GRAPH_INITIALIZER: u32 = 5;
    const TENSOR_NAME: u32 = 8;
    const TENSOR_RAW_DATA: u32 = 9;
    let mut out = HashMap::new();
    each_field(bytes, 0, |tag, graph| {
        if tag != MODEL_GRAPH {
            return Ok(());
        }
        each_field(&bytes[graph.clone()], graph.start, |tag, tensor| {
            if tag != GRAPH_INITIALIZER {
                return Ok(());
            }
            let (mut name, mut raw) = (None, None);
            each_field(&bytes[tensor.clone()], tensor.start, |tag, field| {
                match tag {
                    TENSOR_NAME => name = Some(field),
                    TENSOR_RAW_DATA => raw = Some(field),
                    _ => {}
                }
                Ok(())
            })?;
            if let (Some(name), Some(raw)) = (name, raw) {
                out.insert(String::from_utf8_lossy(&bytes[name]).into_owned(), raw);
            }
            Ok(())
        })
    })?;
    Ok(out)
}

/// Calls `visit` with the tag and the payload's range in the file of each length-delimited field
/// of the message `msg` (which starts at `base` in the file), in order; other wire types are
/// skipped. Nothing is allocated per field, so a file of many tiny fields costs no memory.
fn each_field(
    msg: &[u8],
    base: usize,
    mut visit: impl FnMut(u32, Range<usize>) -> Result<(), MlpGraphError>,
) -> Result<(), MlpGraphError> {
    let mut buf = msg;
    while !buf.is_empty() {
        let (tag, wire) = decode_key(&mut buf)?;
        if wire != WireType::LengthDelimited {
            skip_field(wire, tag, &mut buf, DecodeContext::default())?;
            continue;
        }
        let len = usize::try_from(decode_varint(&mut buf)?).unwrap_or(usize::MAX);
        if len > buf.len() {
            return Err(not_mlp(format!("a field of {len} bytes at byte {base} runs past its message")));
        }
        let start = base + (msg.len() - buf.len());
        visit(tag, start..start + len)?;
        buf = &buf[len..];
    }
    Ok(())
}

/// The MLP chain of `g` (ranges not yet filled), with each layer's weight and bias names.
#[allow(clippy::type_complexity)]
fn read_graph(
    g: &GraphProto,
    limits: &MlpLimits,
) -> Result<(MlpGraph, Vec<(String, String)>), MlpGraphError> {
    if !g.sparse_initializer.is_empty() {
        return Err(not_mlp("the graph has sparse initializers"));
    }
    if g.initializer.len() > 2 * limits.max_layers {
        return Err(not_mlp(format!(
            "{} initializers, more than {} layers need",
            g.initializer.len(),
            limits.max_layers
        )));
    }
    let inits: HashMap<&str, &TensorProto> =
        g.initializer.iter().map(|t| (t.name.as_deref().unwrap_or(""), t)).collect();
    let inputs: Vec<&str> =
        g.input.iter().filter_map(|v| v.name.as_deref()).filter(|n| !inits.contains_key(n)).collect();
    let [input] = inputs.as_slice() else {
        return Err(not_mlp(format!("{} graph inputs besides initializers, 1 expected", inputs.len())));
    };
    let [out] = g.output.as_slice() else {
        return Err(not_mlp(format!("{} graph outputs, 1 expected", g.output.len())));
    };
    let output = out.name.clone().unwrap_or_default();
    let op = |n: &NodeProto| n.op_type.clone().unwrap_or_default();

    let mut layers: Vec<DenseLayer> = Vec::new();
    let mut names: Vec<(String, String)> = Vec::new();
    let mut relu_after: Vec<bool> = Vec::new();
    let mut softmax = false;
    let mut cur = (*input).to_string();
    let mut nodes = g.node.iter().peekable();
    while let Some(n) = nodes.next() {
        if softmax {
            return Err(not_mlp(format!("{} follows the softmax", label(n))));
        }
        match op(n).as_str() {
            "MatMul" => {
                check_node(n, 2, &[])?;
                if n.input[0] != cur {
                    return Err(not_mlp(format!(
                        "{} reads {:?}, not the chain's {cur:?}",
                        label(n),
                        n.input[0]
                    )));
                }
                if layers.len() == limits.max_layers {
                    return Err(not_mlp(format!("more than {} dense layers", limits.max_layers)));
                }
                let w = inits.get(n.input[1].as_str()).ok_or_else(|| {
                    not_mlp(format!(
                        "{} multiplies by {:?}, which is not an initializer",
                        label(n),
                        n.input[1]
                    ))
                })?;
                let (wd, weights) = float_values(w, limits)?;
                let &[inputs_w, outputs] = wd.as_slice() else {
                    return Err(not_mlp(format!("weight {:?} has dims {wd:?}, not [in, out]", n.input[1])));
                };
                let want_in = layers.last().map(|l| l.outputs);
                if want_in.is_some_and(|w| w != inputs_w) {
                    return Err(not_mlp(format!(
                        "weight {:?} takes {inputs_w} inputs, the previous layer gives {want_in:?}",
                        n.input[1]
                    )));
                }
                let add = nodes
                    .next()
                    .filter(|a| op(a) == "Add")
                    .ok_or_else(|| not_mlp(format!("{} is not followed by a bias Add", label(n))))?;
                check_node(add, 2, &[])?;
                let mm = &n.output[0];
                let bias_name = match (&add.input[0], &add.input[1]) {
                    (a, b) if a == mm => b,
                    (a, b) if b == mm => a,
                    _ => return Err(not_mlp(format!("{} does not add to {mm:?}", label(add)))),
                };
                let b = inits.get(bias_name.as_str()).ok_or_else(|| {
                    not_mlp(format!("{} adds {bias_name:?}, which is not an initializer", label(add)))
                })?;
                let (bd, bias) = float_values(b, limits)?;
                if bd != [outputs] {
                    return Err(not_mlp(format!("bias {bias_name:?} has dims {bd:?}, not [{outputs}]")));
                }
                layers.push(DenseLayer { inputs: inputs_w, outputs, weights, bias });
                names.push((n.input[1].clone(), bias_name.clone()));
                relu_after.push(false);
                cur = add.output[0].clone();
            }
            "Relu" => {
                check_node(n, 1, &[])?;
                let Some(last) = relu_after.last_mut().filter(|r| !**r) else {
                    return Err(not_mlp(format!("{} does not follow a dense layer", label(n))));
                };
                if n.input[0] != cur {
                    return Err(not_mlp(format!(
                        "{} reads {:?}, not the chain's {cur:?}",
                        label(n),
                        n.input[0]
                    )));
                }
                *last = true;
                cur = n.output[0].clone();
            }
            "Softmax" => {
                check_node(n, 1, &["axis"])?;
                let axis = n.attribute.first().and_then(|a| a.i).unwrap_or(-1);
                if axis != -1 && axis != 1 {
                    return Err(not_mlp(format!("{} is over axis {axis}, not the last", label(n))));
                }
                if n.input[0] != cur || layers.is_empty() {
                    return Err(not_mlp(format!("{} does not follow a dense layer", label(n))));
                }
                softmax = true;
                cur = n.output[0].clone();
            }
            other => return Err(not_mlp(format!("{} has op {other:?}", label(n)))),
        }
    }
    if layers.is_empty() {
        return Err(not_mlp("no dense layers"));
    }
    let relus = relu_after.len() - 1;
    if relu_after[..relus].iter().any(|r| !r) || relu_after[relus] {
        return Err(not_mlp(format!(
            "ReLU pattern {relu_after:?}: the writer puts ReLU after every layer but the last"
        )));
    }
    if cur != output {
        return Err(not_mlp(format!("the chain ends at {cur:?}, the graph output is {output:?}")));
    }
    Ok((MlpGraph { input: (*input).to_string(), output, layers, softmax, ranges: None }, names))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::onnx::writer::{mlp_model, node, tests::layer};

    fn decoded(layers: &[DenseLayer]) -> ModelProto {
        ModelProto::decode(mlp_model(layers, "x", "y").unwrap().as_slice()).unwrap()
    }

    fn refusal(m: &ModelProto) -> String {
        parse_mlp(&m.encode_to_vec(), &MlpLimits::default()).unwrap_err().to_string()
    }

    #[test]
    fn reads_back_what_the_writer_wrote() {
        let layers = vec![layer(6, 5, 1), layer(5, 4, 2), layer(4, 3, 3)];
        let g = parse_mlp(&mlp_model(&layers, "x", "y").unwrap(), &MlpLimits::default()).unwrap();
        assert_eq!((g.input.as_str(), g.output.as_str(), g.softmax), ("x", "y", true));
        assert_eq!(g.layers, layers);
    }

    #[test]
    fn logits_without_softmax_are_read() {
        let mut m = decoded(&[layer(3, 2, 1)]);
        let graph = m.graph.as_mut().unwrap();
        graph.node.pop();
        graph.output[0].name = Some("y0".into());
        let g = parse_mlp(&m.encode_to_vec(), &MlpLimits::default()).unwrap();
        assert!(!g.softmax);
        assert_eq!(g.output, "y0");
    }

    #[test]
    fn refusals_name_the_op_or_tensor() {
        // An op the writer never writes.
        let mut m = decoded(&[layer(3, 2, 1), layer(2, 2, 2)]);
        m.graph.as_mut().unwrap().node[2].op_type = Some("Sigmoid".into());
        let e = refusal(&m);
        assert!(e.contains("\"Sigmoid\""), "{e}");

        // A weight that is not float.
        let mut m = decoded(&[layer(3, 2, 1)]);
        m.graph.as_mut().unwrap().initializer[0].data_type = Some(7);
        let e = refusal(&m);
        assert!(e.contains("\"w0\"") && e.contains("not FLOAT"), "{e}");

        // A weight whose data does not fill its dims.
        let mut m = decoded(&[layer(3, 2, 1)]);
        m.graph.as_mut().unwrap().initializer[0].raw_data.as_mut().unwrap().truncate(8);
        let e = refusal(&m);
        assert!(e.contains("\"w0\"") && e.contains("8 bytes"), "{e}");

        // A ReLU after the last layer.
        let mut m = decoded(&[layer(3, 2, 1)]);
        let graph = m.graph.as_mut().unwrap();
        graph.node.pop();
        graph.node.push(node("Relu", &["y0"], &["y"], vec![]));
        let e = refusal(&m);
        assert!(e.contains("ReLU pattern"), "{e}");

        // A bias of the wrong width.
        let mut m = decoded(&[layer(3, 2, 1)]);
        m.graph.as_mut().unwrap().initializer[1] = crate::onnx::writer::float_tensor("b0", &[3], &[0.0; 3]);
        let e = refusal(&m);
        assert!(e.contains("\"b0\"") && e.contains("[3]"), "{e}");

        // Not a model at all.
        assert!(matches!(parse_mlp(b"\xff\xff\xff", &MlpLimits::default()), Err(MlpGraphError::Decode(_))));
    }

    #[test]
    fn raw_data_walk_refuses_a_field_past_its_message_and_skips_the_rest() {
        // Field 7 (the graph), length-delimited, claims 5 bytes where 1 follows.
        let e = raw_data_ranges(&[0x3a, 0x05, 0x01]).unwrap_err().to_string();
        assert!(e.contains("5 bytes") && e.contains("runs past its message"), "{e}");
        // Many tiny fields of other kinds (varint field 1): nothing found, nothing refused.
        let tiny: Vec<u8> = (0..10_000).flat_map(|_| [0x08, 0x01]).collect();
        assert!(raw_data_ranges(&tiny).unwrap().is_empty());
    }

    #[test]
    fn caps_apply_before_decoding_and_to_widths() {
        let bytes = mlp_model(&[layer(8, 4, 1)], "x", "y").unwrap();
        let small = MlpLimits { max_model_bytes: 16, ..MlpLimits::default() };
        assert!(matches!(parse_mlp(&bytes, &small), Err(MlpGraphError::TooLarge { cap: 16, .. })));
        let narrow = MlpLimits { max_width: 4, ..MlpLimits::default() };
        let e = parse_mlp(&bytes, &narrow).unwrap_err().to_string();
        assert!(e.contains("\"w0\"") && e.contains("dimension 8"), "{e}");
        let shallow = MlpLimits { max_layers: 1, ..MlpLimits::default() };
        let two = mlp_model(&[layer(3, 2, 1), layer(2, 2, 2)], "x", "y").unwrap();
        assert!(parse_mlp(&two, &shallow).is_err());
    }
}

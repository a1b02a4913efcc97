//! A minimal ONNX model writer: MLP graphs (MatMul, Add, Relu, Softmax) at opset 17 built from the
//! prost types in [`proto`](super::proto) and encoded with prost, so programs can make real ONNX
//! models without Python. The small builders ([`float_tensor`], [`node`], [`value_info`],
//! [`model`]) are public for other graph code and tests.

use prost::Message;

use super::mlp_graph::raw_data_ranges;

use super::proto::{
    AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, TensorProto, TensorShapeProto,
    TypeProto, ValueInfoProto, attribute_proto, tensor_shape_proto, type_proto,
};

/// IR version written (ONNX 1.13+, understood by every ONNX Runtime since 1.14).
pub const IR_VERSION: u64 = 8;
/// Default-domain opset written.
pub const OPSET: u64 = 17;
/// `TensorProto.DataType.FLOAT`.
pub const FLOAT: i32 = 1;
/// `TensorProto.DataType.INT64`.
pub const INT64: i32 = 7;

/// A float initializer `name` of shape `dims` (little-endian raw data).
pub fn float_tensor(name: &str, dims: &[usize], data: &[f32]) -> TensorProto {
    TensorProto {
        dims: dims.iter().map(|&d| d as i64).collect(),
        data_type: Some(FLOAT),
        name: Some(name.to_owned()),
        raw_data: Some(data.iter().flat_map(|v| v.to_le_bytes()).collect()),
        ..Default::default()
    }
}

/// An integer attribute.
pub fn int_attribute(name: &str, value: i64) -> AttributeProto {
    AttributeProto {
        name: Some(name.to_owned()),
        i: Some(value),
        r#type: Some(attribute_proto::AttributeType::Int as i32),
        ..Default::default()
    }
}

/// A default-domain node `op(inputs) -> outputs`, named `{op}_{first output}`.
pub fn node(op: &str, inputs: &[&str], outputs: &[&str], attributes: Vec<AttributeProto>) -> NodeProto {
    NodeProto {
        input: inputs.iter().map(|s| (*s).to_owned()).collect(),
        output: outputs.iter().map(|s| (*s).to_owned()).collect(),
        name: Some(format!("{op}_{}", outputs.first().copied().unwrap_or(""))),
        op_type: Some(op.to_owned()),
        attribute: attributes,
        ..Default::default()
    }
}

/// A tensor value info: element type and dims, `Err(name)` a symbolic dimension.
pub fn value_info(name: &str, elem_type: i32, dims: &[Result<i64, &str>]) -> ValueInfoProto {
    let dim = dims
        .iter()
        .map(|d| tensor_shape_proto::Dimension {
            value: Some(match d {
                Ok(v) => tensor_shape_proto::dimension::Value::DimValue(*v),
                Err(p) => tensor_shape_proto::dimension::Value::DimParam((*p).to_owned()),
            }),
            denotation: None,
        })
        .collect();
    ValueInfoProto {
        name: Some(name.to_owned()),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: Some(elem_type),
                shape: Some(TensorShapeProto { dim }),
            })),
            denotation: None,
        }),
        ..Default::default()
    }
}

/// A model around `graph` at [`IR_VERSION`] and default-domain opset [`OPSET`].
pub fn model(graph: GraphProto) -> ModelProto {
    ModelProto {
        ir_version: Some(IR_VERSION as i64),
        producer_name: Some("troupe".into()),
        opset_import: vec![OperatorSetIdProto { domain: Some(String::new()), version: Some(OPSET as i64) }],
        graph: Some(graph),
        ..Default::default()
    }
}

/// A dense layer `y = x W + b` with `W` row-major `[inputs, outputs]`.
#[derive(Clone, Debug, PartialEq)]
pub struct DenseLayer {
    /// Input width.
    pub inputs: usize,
    /// Output width.
    pub outputs: usize,
    /// `inputs * outputs` weights, row-major.
    pub weights: Vec<f32>,
    /// `outputs` biases.
    pub bias: Vec<f32>,
}

impl DenseLayer {
    /// Bytes of parameters (f32).
    pub fn param_bytes(&self) -> u64 {
        4 * (self.weights.len() + self.bias.len()) as u64
    }
}

/// Why an MLP description cannot be written.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WriterError {
    /// No layers.
    #[error("an MLP needs at least one layer")]
    NoLayers,
    /// A layer's arrays do not match its widths, or widths do not chain.
    #[error("layer {index}: {problem}")]
    BadLayer {
        /// Which layer.
        index: usize,
        /// What is wrong.
        problem: String,
    },
}

fn check_layers(layers: &[DenseLayer]) -> Result<(), WriterError> {
    if layers.is_empty() {
        return Err(WriterError::NoLayers);
    }
    for (index, l) in layers.iter().enumerate() {
        let bad = |problem: String| WriterError::BadLayer { index, problem };
        if l.inputs == 0 || l.outputs == 0 {
            return Err(bad("zero width".into()));
        }
        if l.weights.len() != l.inputs * l.outputs {
            return Err(bad(format!("{} weights for {}x{}", l.weights.len(), l.inputs, l.outputs)));
        }
        if l.bias.len() != l.outputs {
            return Err(bad(format!("{} biases for {} outputs", l.bias.len(), l.outputs)));
        }
        if index > 0 && layers[index - 1].outputs != l.inputs {
            return Err(bad(format!(
                "takes {} inputs, previous layer gives {}",
                l.inputs,
                layers[index - 1].outputs
            )));
        }
    }
    Ok(())
}

/// Serialise an MLP as an ONNX model: `input [batch, in]` -> dense layers with ReLU between
/// them -> softmax -> `output [batch, out]`.
///
/// Every initializer's `raw_data` starts at a multiple of 4 bytes in the file, so an engine can
/// run the weights where the file's bytes lie ([`crate::mlp_engine::ArenaMlp`]) instead of
/// copying them. The padding that does it is meaningless text: the graph's name aligns the first
/// initializer, and each initializer's `doc_string` (encoded after its data) aligns the next.
pub fn mlp_model(layers: &[DenseLayer], input: &str, output: &str) -> Result<Vec<u8>, WriterError> {
    check_layers(layers)?;
    // Each pass aligns the first misaligned initializer with the padding just before it; a
    // longer pad can lengthen a varint ahead of the others, so every pass re-checks them all.
    let mut pads = vec![0usize; 2 * layers.len()];
    let mut bytes = mlp_model_padded(layers, input, output, &pads);
    for _ in 0..4 * pads.len() + 8 {
        // Our own encoding always walks; were it not to, the model stays valid, just unaligned.
        let Ok(ranges) = raw_data_ranges(&bytes) else { break };
        let misaligned = (0..pads.len()).find_map(|j| {
            let start = ranges.get(&initializer_name(j))?.start;
            (!start.is_multiple_of(4)).then_some((j, 4 - start % 4))
        });
        let Some((j, add)) = misaligned else { break };
        pads[j] += add;
        bytes = mlp_model_padded(layers, input, output, &pads);
    }
    Ok(bytes)
}

/// Initializer `j` of an MLP: `w{i}` for even `j`, `b{i}` for odd.
fn initializer_name(j: usize) -> String {
    format!("{}{}", if j.is_multiple_of(2) { 'w' } else { 'b' }, j / 2)
}

/// The MLP model with `pads[j]` bytes of padding before initializer `j`'s data (see
/// [`mlp_model`]).
fn mlp_model_padded(layers: &[DenseLayer], input: &str, output: &str, pads: &[usize]) -> Vec<u8> {
    let mut nodes = Vec::with_capacity(3 * layers.len());
    let mut x = input.to_string();
    for i in 0..layers.len() {
        let (w, b) = (initializer_name(2 * i), initializer_name(2 * i + 1));
        let (mm, y) = (format!("mm{i}"), format!("y{i}"));
        nodes.push(node("MatMul", &[&x, &w], &[&mm], vec![]));
        nodes.push(node("Add", &[&mm, &b], &[&y], vec![]));
        x = y;
        if i + 1 < layers.len() {
            let r = format!("r{i}");
            nodes.push(node("Relu", &[&x], &[&r], vec![]));
            x = r;
        }
    }
    nodes.push(node("Softmax", &[&x], &[output], vec![int_attribute("axis", -1)]));
    let mut initializer: Vec<TensorProto> = layers
        .iter()
        .enumerate()
        .flat_map(|(i, l)| {
            [
                float_tensor(&initializer_name(2 * i), &[l.inputs, l.outputs], &l.weights),
                float_tensor(&initializer_name(2 * i + 1), &[l.outputs], &l.bias),
            ]
        })
        .collect();
    // Initializer j's doc_string comes after its raw_data: it pads initializer j + 1.
    for (j, t) in initializer.iter_mut().enumerate() {
        t.doc_string = Some(" ".repeat(pads.get(j + 1).copied().unwrap_or(0)));
    }
    let width = |w: usize| [Err("batch"), Ok(w as i64)];
    let graph = GraphProto {
        node: nodes,
        name: Some(format!("troupe_mlp{}", "_".repeat(pads[0]))),
        initializer,
        input: vec![value_info(input, FLOAT, &width(layers[0].inputs))],
        output: vec![value_info(output, FLOAT, &width(layers[layers.len() - 1].outputs))],
        ..Default::default()
    };
    model(graph).encode_to_vec()
}

/// The same forward pass in plain Rust (the reference the writer is tested against): `x` is
/// `[batch, in]` row-major; returns `[batch, out]` softmax probabilities.
pub fn mlp_forward(layers: &[DenseLayer], x: &[f32], batch: usize) -> Vec<f32> {
    let mut cur = x.to_vec();
    for (i, l) in layers.iter().enumerate() {
        let mut next = vec![0f32; batch * l.outputs];
        for r in 0..batch {
            let row = &cur[r * l.inputs..(r + 1) * l.inputs];
            let out = &mut next[r * l.outputs..(r + 1) * l.outputs];
            out.copy_from_slice(&l.bias);
            for (k, &xv) in row.iter().enumerate() {
                let w = &l.weights[k * l.outputs..(k + 1) * l.outputs];
                for (o, &wv) in out.iter_mut().zip(w) {
                    *o += xv * wv;
                }
            }
            if i + 1 < layers.len() {
                out.iter_mut().for_each(|v| *v = v.max(0.0));
            }
        }
        cur = next;
    }
    let width = layers.last().map_or(0, |l| l.outputs);
    for r in cur.chunks_mut(width.max(1)) {
        let m = r.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut s = 0.0;
        for v in r.iter_mut() {
            *v = (*v - m).exp();
            s += *v;
        }
        r.iter_mut().for_each(|v| *v /= s);
    }
    cur
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::onnx::{NamedTensor, OnnxSession, SessionConfig};

    /// A dense layer with deterministic weights (shared with the other ONNX modules' tests).
    pub(crate) fn layer(inputs: usize, outputs: usize, seed: u32) -> DenseLayer {
        // A deterministic, sign-mixed pattern (no RNG needed in a unit test).
        let val = |i: usize| {
            let h = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed.wrapping_mul(40_503));
            ((h >> 8) % 2001) as f32 / 1000.0 - 1.0
        };
        DenseLayer {
            inputs,
            outputs,
            weights: (0..inputs * outputs).map(|i| val(i) * 0.3).collect(),
            bias: (0..outputs).map(|i| val(i + 7) * 0.1).collect(),
        }
    }

    #[test]
    fn every_initializer_starts_4_byte_aligned_and_ranges_hold_its_values() {
        // Widths that put the data at every residue mod 4 before padding, up to 3 layers.
        for (a, b, c) in [(1, 1, 1), (3, 5, 2), (64, 96, 10), (7, 130, 3), (200, 33, 129)] {
            for depth in 1..=3 {
                let layers: Vec<DenseLayer> = [(a, b), (b, c), (c, a)]
                    .iter()
                    .take(depth)
                    .enumerate()
                    .map(|(i, &(x, y))| layer(x, y, i as u32))
                    .collect();
                let bytes = mlp_model(&layers, "x", "y").unwrap();
                let g = crate::onnx::mlp_graph::parse_mlp(&bytes, &Default::default()).unwrap();
                let ranges = g.ranges.unwrap_or_else(|| panic!("{a} {b} {c} x{depth}: not aligned"));
                for (l, r) in layers.iter().zip(&ranges) {
                    assert!(r.weights.start % 4 == 0 && r.bias.start % 4 == 0);
                    let floats = |r: &std::ops::Range<usize>| -> Vec<f32> {
                        bytes[r.clone()]
                            .chunks_exact(4)
                            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                            .collect()
                    };
                    assert_eq!(floats(&r.weights), l.weights);
                    assert_eq!(floats(&r.bias), l.bias);
                }
            }
        }
    }

    #[test]
    fn written_mlp_decodes_back_with_its_layers() {
        let layers = vec![layer(4, 3, 1), layer(3, 2, 2)];
        let bytes = mlp_model(&layers, "x", "y").unwrap();
        let m = ModelProto::decode(bytes.as_slice()).unwrap();
        assert_eq!(m.ir_version, Some(IR_VERSION as i64));
        let g = m.graph.unwrap();
        let ops: Vec<&str> = g.node.iter().filter_map(|n| n.op_type.as_deref()).collect();
        assert_eq!(ops, ["MatMul", "Add", "Relu", "MatMul", "Add", "Softmax"]);
        assert_eq!(g.initializer.len(), 4);
        assert_eq!(g.initializer[0].dims, [4, 3]);
        assert_eq!(g.initializer[0].raw_data.as_ref().map(Vec::len), Some(4 * 12));
    }

    #[test]
    fn written_mlp_runs_in_onnx_runtime_like_the_reference() {
        let layers = vec![layer(64, 48, 1), layer(48, 32, 2), layer(32, 5, 3)];
        let bytes = mlp_model(&layers, "x", "probs").unwrap();
        let mut s = OnnxSession::from_bytes(&bytes, "written-mlp", &SessionConfig::default()).unwrap();
        assert_eq!(s.inputs()[0].name, "x");
        assert_eq!(s.inputs()[0].dims, vec![None, Some(64)]);
        assert_eq!(s.outputs()[0].dims, vec![None, Some(5)]);
        let batch = 3;
        let x: Vec<f32> = (0..batch * 64).map(|i| (i % 17) as f32 / 16.0).collect();
        let out = s.run(&[NamedTensor::f32("x", vec![batch, 64], x.clone())]).unwrap();
        let got = out[0].as_f32().unwrap();
        let want = mlp_forward(&layers, &x, batch);
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() < 1e-5, "{g} vs {w}");
        }
        // Rows are distributions and differ between inputs.
        assert!((got[..5].iter().sum::<f32>() - 1.0).abs() < 1e-5);
        assert_ne!(&got[..5], &got[5..10]);
    }

    #[test]
    fn rejects_layers_that_do_not_chain() {
        assert_eq!(mlp_model(&[], "x", "y"), Err(WriterError::NoLayers));
        let err = mlp_model(&[layer(4, 3, 1), layer(2, 2, 1)], "x", "y").unwrap_err();
        assert!(matches!(err, WriterError::BadLayer { index: 1, .. }), "{err}");
    }
}

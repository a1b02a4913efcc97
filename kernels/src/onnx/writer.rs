//! A minimal ONNX model writer: protobuf wire format by hand (varints and length-delimited
//! fields), enough for MLP graphs (MatMul, Add, Relu, Softmax) at opset 17, so programs can make
//! real ONNX models without Python.
//!
//! Field numbers follow `onnx.proto3`: ModelProto (ir_version 1, graph 7, opset_import 8),
//! GraphProto (node 1, name 2, initializer 5, input 11, output 12), NodeProto (input 1, output 2,
//! name 3, op_type 4, attribute 5), AttributeProto (name 1, i 3, type 20), TensorProto (dims 1,
//! data_type 2, name 8, raw_data 9), ValueInfoProto (name 1, type 2), TypeProto (tensor_type 1),
//! TypeProto.Tensor (elem_type 1, shape 2), TensorShapeProto (dim 1), Dimension (dim_value 1,
//! dim_param 2).

/// IR version written (ONNX 1.13+, understood by every ONNX Runtime since 1.14).
pub const IR_VERSION: u64 = 8;
/// Default-domain opset written.
pub const OPSET: u64 = 17;
/// `TensorProto.DataType.FLOAT`.
const FLOAT: u64 = 1;
/// `AttributeProto.AttributeType.INT`.
const ATTR_INT: u64 = 2;

/// Append a varint.
fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Append a varint field (wire type 0).
fn field_varint(out: &mut Vec<u8>, field: u32, v: u64) {
    varint(out, u64::from(field) << 3);
    varint(out, v);
}

/// Append a length-delimited field (wire type 2).
fn field_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    varint(out, (u64::from(field) << 3) | 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
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

fn tensor(name: &str, dims: &[usize], data: &[f32]) -> Vec<u8> {
    let mut t = Vec::with_capacity(data.len() * 4 + 64);
    for &d in dims {
        field_varint(&mut t, 1, d as u64);
    }
    field_varint(&mut t, 2, FLOAT);
    field_bytes(&mut t, 8, name.as_bytes());
    // raw_data: little-endian f32s.
    varint(&mut t, (9 << 3) | 2);
    varint(&mut t, (data.len() * 4) as u64);
    for v in data {
        t.extend_from_slice(&v.to_le_bytes());
    }
    t
}

fn node(op: &str, inputs: &[&str], output: &str, axis: Option<i64>) -> Vec<u8> {
    let mut n = Vec::new();
    for i in inputs {
        field_bytes(&mut n, 1, i.as_bytes());
    }
    field_bytes(&mut n, 2, output.as_bytes());
    field_bytes(&mut n, 3, format!("{op}_{output}").as_bytes());
    field_bytes(&mut n, 4, op.as_bytes());
    if let Some(axis) = axis {
        let mut a = Vec::new();
        field_bytes(&mut a, 1, b"axis");
        field_varint(&mut a, 3, axis as u64);
        field_varint(&mut a, 20, ATTR_INT);
        field_bytes(&mut n, 5, &a);
    }
    n
}

/// A float tensor value info `[batch, width]` with a symbolic batch dimension.
fn value_info(name: &str, width: usize) -> Vec<u8> {
    let mut batch = Vec::new();
    field_bytes(&mut batch, 2, b"batch");
    let mut w = Vec::new();
    field_varint(&mut w, 1, width as u64);
    let mut shape = Vec::new();
    field_bytes(&mut shape, 1, &batch);
    field_bytes(&mut shape, 1, &w);
    let mut tensor_type = Vec::new();
    field_varint(&mut tensor_type, 1, FLOAT);
    field_bytes(&mut tensor_type, 2, &shape);
    let mut ty = Vec::new();
    field_bytes(&mut ty, 1, &tensor_type);
    let mut vi = Vec::new();
    field_bytes(&mut vi, 1, name.as_bytes());
    field_bytes(&mut vi, 2, &ty);
    vi
}

/// Serialise an MLP as an ONNX model: `input [batch, in]` -> dense layers with ReLU between
/// them -> softmax -> `output [batch, out]`.
pub fn mlp_model(layers: &[DenseLayer], input: &str, output: &str) -> Result<Vec<u8>, WriterError> {
    check_layers(layers)?;
    let mut graph = Vec::with_capacity(layers.iter().map(|l| l.param_bytes() as usize).sum::<usize>() + 4096);
    let mut x = input.to_string();
    for i in 0..layers.len() {
        let (w, b, mm, y) = (format!("w{i}"), format!("b{i}"), format!("mm{i}"), format!("y{i}"));
        field_bytes(&mut graph, 1, &node("MatMul", &[&x, &w], &mm, None));
        field_bytes(&mut graph, 1, &node("Add", &[&mm, &b], &y, None));
        x = y;
        if i + 1 < layers.len() {
            let r = format!("r{i}");
            field_bytes(&mut graph, 1, &node("Relu", &[&x], &r, None));
            x = r;
        }
    }
    field_bytes(&mut graph, 1, &node("Softmax", &[&x], output, Some(-1)));
    field_bytes(&mut graph, 2, b"troupe_mlp");
    for (i, l) in layers.iter().enumerate() {
        field_bytes(&mut graph, 5, &tensor(&format!("w{i}"), &[l.inputs, l.outputs], &l.weights));
        field_bytes(&mut graph, 5, &tensor(&format!("b{i}"), &[l.outputs], &l.bias));
    }
    field_bytes(&mut graph, 11, &value_info(input, layers[0].inputs));
    field_bytes(&mut graph, 12, &value_info(output, layers[layers.len() - 1].outputs));

    let mut model = Vec::with_capacity(graph.len() + 64);
    field_varint(&mut model, 1, IR_VERSION);
    field_bytes(&mut model, 2, b"troupe");
    let mut opset = Vec::new();
    field_bytes(&mut opset, 1, b"");
    field_varint(&mut opset, 2, OPSET);
    field_bytes(&mut model, 8, &opset);
    field_bytes(&mut model, 7, &graph);
    Ok(model)
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
mod tests {
    use super::*;
    use crate::onnx::{NamedTensor, OnnxSession, SessionConfig};

    fn layer(inputs: usize, outputs: usize, seed: u32) -> DenseLayer {
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
    fn varints_encode_like_protobuf() {
        let mut v = Vec::new();
        varint(&mut v, 1);
        varint(&mut v, 300);
        varint(&mut v, 0);
        assert_eq!(v, vec![0x01, 0xAC, 0x02, 0x00]);
        let mut f = Vec::new();
        field_bytes(&mut f, 2, b"hi");
        assert_eq!(f, vec![0x12, 2, b'h', b'i']);
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

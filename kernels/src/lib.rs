//! troupe's compute: tensors, devices, ops, memory pools, the tiered weight store, the ONNX executor.

pub mod assets;
pub mod onnx;
pub mod tokenizer;

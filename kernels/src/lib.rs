//! troupe's compute: tensors, devices, ops, memory pools, the tiered weight store, the ONNX executor.

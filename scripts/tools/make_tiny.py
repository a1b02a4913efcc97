"""Tiny ONNX models with weights given by formulas, so tests can recompute the expected outputs.
usage: make_tiny.py OUT_DIR
tiny_mlp.onnx:  x float [N,4] -> y float [N,2],  y = relu(x @ W1 + b1) @ W2 + b2 with
                W1[i][j] = 0.1*(i+1) - 0.2*j   (4x3)     b1[j] = 0.05*j - 0.1   (3)
                W2[j][k] = 0.3*(j+1) * (+1 if k == 0 else -1)   (3x2)     b2 = [0.5, -0.25]
tiny_int.onnx:  ids int64 [N] -> out int64 [N], out = 2*ids + 1 (exercises int64 in and out)
tiny_check.json: an input and the outputs Python onnxruntime gives for both models."""
import json
import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def mlp_weights():
    w1 = np.array([[0.1 * (i + 1) - 0.2 * j for j in range(3)] for i in range(4)], np.float32)
    b1 = np.array([0.05 * j - 0.1 for j in range(3)], np.float32)
    w2 = np.array([[0.3 * (j + 1) * (1 if k == 0 else -1) for k in range(2)] for j in range(3)], np.float32)
    b2 = np.array([0.5, -0.25], np.float32)
    return w1, b1, w2, b2


def save(graph, path):
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8,
                              producer_name="troupe scripts/tools/make_tiny.py")
    onnx.checker.check_model(model)
    onnx.save(model, path)


def main(out_dir):
    w1, b1, w2, b2 = mlp_weights()
    mlp = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W1"], ["xw"]), helper.make_node("Add", ["xw", "b1"], ["z"]),
         helper.make_node("Relu", ["z"], ["h"]), helper.make_node("MatMul", ["h", "W2"], ["hw"]),
         helper.make_node("Add", ["hw", "b2"], ["y"])],
        "tiny_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])],
        [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(b1, "b1"),
         numpy_helper.from_array(w2, "W2"), numpy_helper.from_array(b2, "b2")])
    save(mlp, os.path.join(out_dir, "tiny_mlp.onnx"))
    ints = helper.make_graph(
        [helper.make_node("Mul", ["ids", "two"], ["twice"]), helper.make_node("Add", ["twice", "one"], ["out"])],
        "tiny_int",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N"])],
        [helper.make_tensor_value_info("out", TensorProto.INT64, ["N"])],
        [numpy_helper.from_array(np.array(2, np.int64), "two"), numpy_helper.from_array(np.array(1, np.int64), "one")])
    save(ints, os.path.join(out_dir, "tiny_int.onnx"))

    x = np.array([[1, 2, 3, 4], [-1, 0.5, 2, -3], [0, 0, 0, 0]], np.float32)
    ids = np.array([0, 1, -7, 1 << 40], np.int64)
    y = ort.InferenceSession(os.path.join(out_dir, "tiny_mlp.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]
    out = ort.InferenceSession(os.path.join(out_dir, "tiny_int.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"ids": ids})[0]
    check = {"mlp": {"x_shape": list(x.shape), "x": x.ravel().tolist(), "y_shape": list(y.shape),
                     "y": [float(v) for v in y.ravel()]},
             "int": {"ids": ids.tolist(), "out": out.tolist()}}
    with open(os.path.join(out_dir, "tiny_check.json"), "w") as f:
        json.dump(check, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])

"""Export scikit-learn's bundled digits (1797 grey 8x8 images, 10 classes) as one compact binary file,
and train a small MLP on them, written as ONNX (an image 'expert' for drift experiments).
usage: export_digits.py OUT_DIGITS.bin OUT_MLP.onnx

digits.bin layout (all integers little-endian):
  offset 0   8 bytes  magic b"TRDIGIT1"
  offset 8   u32      count  (1797)
  offset 12  u32      rows   (8)
  offset 16  u32      cols   (8)
  offset 20  count*rows*cols u8 pixels, image-major then row-major, values 0..=16
  then       count u8 labels, values 0..=9
digits_mlp.onnx: x float [N,64] (pixels / 16) -> probs float [N,10]; 64-32-10, ReLU, softmax.
Trained with MLPClassifier(random_state=0) on a stratified 70% split (train_test_split random_state=0)."""
import struct
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier

MAGIC = b"TRDIGIT1"


def write_digits(path, images, labels):
    count, rows, cols = images.shape
    pixels = images.astype(np.uint8)
    assert pixels.max() <= 16 and labels.max() <= 9
    with open(path, "wb") as f:
        f.write(MAGIC + struct.pack("<III", count, rows, cols))
        f.write(pixels.tobytes(order="C"))
        f.write(labels.astype(np.uint8).tobytes())


def write_mlp(path, clf):
    w1, w2 = (c.astype(np.float32) for c in clf.coefs_)
    b1, b2 = (c.astype(np.float32) for c in clf.intercepts_)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W1"], ["xw"]), helper.make_node("Add", ["xw", "b1"], ["z"]),
         helper.make_node("Relu", ["z"], ["h"]), helper.make_node("MatMul", ["h", "W2"], ["hw"]),
         helper.make_node("Add", ["hw", "b2"], ["logits"]), helper.make_node("Softmax", ["logits"], ["probs"], axis=-1)],
        "digits_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["N", 10])],
        [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(b1, "b1"),
         numpy_helper.from_array(w2, "W2"), numpy_helper.from_array(b2, "b2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8,
                              producer_name="troupe scripts/tools/export_digits.py")
    onnx.checker.check_model(model)
    onnx.save(model, path)


def main(digits_path, mlp_path):
    data = load_digits()
    write_digits(digits_path, data.images, data.target)
    x = (data.data / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, data.target, test_size=0.3, random_state=0, stratify=data.target)
    clf = MLPClassifier((32,), max_iter=500, random_state=0).fit(xtr, ytr)
    print(f"export_digits: {len(data.target)} images; MLP test accuracy {clf.score(xte, yte):.3f}", file=sys.stderr)
    write_mlp(mlp_path, clf)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

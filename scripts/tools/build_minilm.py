"""Write all-MiniLM-L6-v2 (a 6-layer BERT encoder, hidden 384) as one ONNX graph straight from its
safetensors weights with onnx.helper: no torch, no exporter.
usage: build_minilm.py MODEL_DIR OUT.onnx
Graph: input_ids, attention_mask int64 [batch, seq] (token_type_ids taken as 0) ->
sentence_embedding float [batch, 384] (mean pooling over the mask + L2 normalisation, as
sentence-transformers does). The encoder layer outputs are named hidden_0 .. hidden_5, [batch, seq, 384],
so the graph can be cut between layers (`troupe pipeline split`, run by scripts/setup)."""
import json
import struct
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64}


def load_safetensors(path):
    """Parse the safetensors container: u64 LE header length, JSON header, raw little-endian data."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        data = f.read()
    weights = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        dtype = SAFETENSORS_DTYPES[info["dtype"]]
        weights[name] = np.frombuffer(data[start:end], dtype=dtype).reshape(info["shape"]).astype(np.float32)
    return weights


class Graph:
    """Collects nodes and initializers; every helper returns the name of the tensor it produced."""

    def __init__(self, weights):
        self.w = weights
        self.nodes = []
        self.inits = []

    def const(self, name, value):
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def weight(self, key, transpose=False):
        value = self.w[key].T if transpose else self.w[key]
        return self.const(key + (".T" if transpose else ""), value)

    def op(self, op_type, inputs, out, **attrs):
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=f"{out}/{op_type}", **attrs))
        return out

    def linear(self, x, prefix, out):
        y = self.op("MatMul", [x, self.weight(prefix + ".weight", transpose=True)], out + ".matmul")
        return self.op("Add", [y, self.weight(prefix + ".bias")], out)

    def layer_norm(self, x, prefix, out, eps):
        return self.op("LayerNormalization", [x, self.weight(prefix + ".weight"), self.weight(prefix + ".bias")],
                       out, axis=-1, epsilon=eps)


def build(model_dir, out_path):
    cfg = json.load(open(f"{model_dir}/config.json"))
    g = Graph(load_safetensors(f"{model_dir}/model.safetensors"))
    hidden, heads, layers, eps = (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"],
                                  cfg["layer_norm_eps"])
    head_dim = hidden // heads
    one = g.const("one", np.array(1.0, np.float32))
    half = g.const("half", np.array(0.5, np.float32))
    inv_sqrt2 = g.const("inv_sqrt2", np.array(1.0 / np.sqrt(2.0), np.float32))
    scale = g.const("attn_scale", np.array(1.0 / np.sqrt(head_dim), np.float32))
    split_heads = g.const("shape_split_heads", np.array([0, 0, heads, head_dim], np.int64))
    merge_heads = g.const("shape_merge_heads", np.array([0, 0, hidden], np.int64))

    # Embeddings: word + position (rows 0..seq of the table) + token type 0, then LayerNorm.
    # Position rows via Shape(start=1,end=2) -> Slice; a Shape->Gather->Range form trips ORT 1.31.
    word = g.op("Gather", [g.weight("embeddings.word_embeddings.weight"), "input_ids"], "emb.word", axis=0)
    seq_len = g.op("Shape", ["input_ids"], "seq_len", start=1, end=2)
    pos = g.op("Slice", [g.weight("embeddings.position_embeddings.weight"), g.const("zero_1d", np.array([0], np.int64)),
                         seq_len, g.const("axis0_1d", np.array([0], np.int64))], "emb.pos")
    tok0 = g.const("emb.token_type0", g.w["embeddings.token_type_embeddings.weight"][0])
    x = g.op("Add", [g.op("Add", [word, pos], "emb.word_pos"), tok0], "emb.sum")
    x = g.layer_norm(x, "embeddings.LayerNorm", "embeddings", eps)

    # Additive attention mask [batch, 1, 1, seq]: 0 where attended, -10000 at padding.
    mask_f = g.op("Cast", ["attention_mask"], "mask.f32", to=TensorProto.FLOAT)
    neg = g.op("Mul", [g.op("Sub", [one, mask_f], "mask.inv"), g.const("neg_big", np.array(-1e4, np.float32))],
               "mask.neg")
    attn_bias = g.op("Unsqueeze", [neg, g.const("axes_1_2", np.array([1, 2], np.int64))], "mask.bias")

    for i in range(layers):
        p, t = f"encoder.layer.{i}.", f"l{i}."

        def project(name, perm):
            y = g.linear(x, p + "attention.self." + name, t + name)
            y = g.op("Reshape", [y, split_heads], t + name + ".heads")
            return g.op("Transpose", [y], t + name + ".t", perm=perm)

        q = project("query", [0, 2, 1, 3])   # [b, h, s, d]
        k = project("key", [0, 2, 3, 1])     # [b, h, d, s]
        v = project("value", [0, 2, 1, 3])   # [b, h, s, d]
        scores = g.op("Mul", [g.op("MatMul", [q, k], t + "scores.raw"), scale], t + "scores")
        probs = g.op("Softmax", [g.op("Add", [scores, attn_bias], t + "scores.masked")], t + "probs", axis=-1)
        ctx = g.op("Transpose", [g.op("MatMul", [probs, v], t + "ctx")], t + "ctx.t", perm=[0, 2, 1, 3])
        ctx = g.op("Reshape", [ctx, merge_heads], t + "ctx.merged")
        attn = g.linear(ctx, p + "attention.output.dense", t + "attn.out")
        h = g.layer_norm(g.op("Add", [attn, x], t + "attn.res"), p + "attention.output.LayerNorm", t + "attn.norm", eps)
        # FFN with exact GELU: 0.5 * f * (1 + erf(f / sqrt(2)))
        f = g.linear(h, p + "intermediate.dense", t + "ffn.in")
        erf = g.op("Erf", [g.op("Mul", [f, inv_sqrt2], t + "gelu.scaled")], t + "gelu.erf")
        gelu = g.op("Mul", [g.op("Mul", [f, g.op("Add", [erf, one], t + "gelu.1p")], t + "gelu.prod"), half], t + "gelu")
        out = g.linear(gelu, p + "output.dense", t + "ffn.out")
        x = g.layer_norm(g.op("Add", [out, h], t + "ffn.res"), p + "output.LayerNorm", f"hidden_{i}", eps)

    # Head: mean over attended positions, then L2 normalisation.
    mask3 = g.op("Unsqueeze", [mask_f, g.const("axes_last", np.array([-1], np.int64))], "pool.mask")
    axis_seq = g.const("axes_seq", np.array([1], np.int64))
    total = g.op("ReduceSum", [g.op("Mul", [x, mask3], "pool.masked"), axis_seq], "pool.sum", keepdims=0)
    count = g.op("Max", [g.op("ReduceSum", [mask3, axis_seq], "pool.count.raw", keepdims=0),
                         g.const("pool_eps", np.array(1e-9, np.float32))], "pool.count")
    mean = g.op("Div", [total, count], "pool.mean")
    norm = g.op("Max", [g.op("ReduceL2", [mean], "norm.l2", axes=[-1], keepdims=1),
                        g.const("norm_eps", np.array(1e-12, np.float32))], "norm.clamped")
    g.op("Div", [mean, norm], "sentence_embedding")

    graph = helper.make_graph(
        g.nodes, "all-MiniLM-L6-v2",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("sentence_embedding", TensorProto.FLOAT, ["batch", hidden])],
        initializer=g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8,
                              producer_name="troupe scripts/tools/build_minilm.py")
    onnx.checker.check_model(model)
    # Shape inference gives every hidden_i a value_info, so stage cuts carry types and ranks.
    model = onnx.shape_inference.infer_shapes(model)
    for vi in model.graph.value_info:
        dims = vi.type.tensor_type.shape.dim
        if vi.name.startswith("hidden_") and len(dims) == 3:
            dims[0].dim_param, dims[1].dim_param = "batch", "seq"
    onnx.save(model, out_path)


if __name__ == "__main__":
    build(sys.argv[1], sys.argv[2])

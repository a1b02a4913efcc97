"""Write all-mpnet-base-v2 (a 12-layer MPNet encoder, hidden 768, 110M parameters: ~4.8x MiniLM) as one
ONNX graph straight from its safetensors weights with onnx.helper, like build_minilm.py.
usage: build_mpnet.py MODEL_DIR OUT.onnx
Graph: input_ids, attention_mask int64 [batch, seq] -> sentence_embedding float [batch, 768] (mean pooling
over the mask + L2 normalisation, the sentence-transformers modules of all-mpnet-base-v2).
MPNet differs from BERT in three places, all following Hugging Face's modeling_mpnet.py:
  - position ids come from input_ids: cumsum(input_ids != pad) * (input_ids != pad) + pad (pad id 1),
    so padding rows take position 1 and the first token position 2;
  - no token-type embedding;
  - every layer adds one relative-position attention bias [1, heads, seq, seq], computed once from the
    sequence length: bucket(j - i) (32 buckets, max distance 128, `relative_position_bucket`) looked up in
    encoder.relative_attention_bias. The buckets of every offset in -(L-1)..(L-1) (L = 512 positions) are
    a 1023-entry table; the graph slices an arange by seq, forms j - i, gathers bucket then bias. The bias
    needs ~14 KB of weights, so a later pipeline stage recomputes it (a side tensor, like the mask).
The encoder layer outputs are named hidden_0 .. hidden_11, [batch, seq, 768]."""
import json
import math
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper

from build_minilm import OPSET, Graph, load_safetensors

PAD_ID = 1
MAX_POSITIONS = 512  # 514 position rows minus the pad offset


def relative_position_bucket(rel, num_buckets=32, max_distance=128):
    """Hugging Face MPNet's bucket of each relative position (memory - context), in float32 as torch does."""
    n = -rel.astype(np.int64)
    half = num_buckets // 2
    ret = (n < 0).astype(np.int64) * half
    n = np.abs(n)
    max_exact = half // 2
    with np.errstate(divide="ignore"):
        scaled = (np.log(n.astype(np.float32) / np.float32(max_exact)) / np.float32(math.log(max_distance / max_exact))
                  * np.float32(half - max_exact))
    large = max_exact + np.where(n < max_exact, 0, scaled).astype(np.int64)
    large = np.minimum(large, half - 1)
    return ret + np.where(n < max_exact, n, large)


def build(model_dir, out_path):
    cfg = json.load(open(f"{model_dir}/config.json"))
    if cfg.get("model_type") != "mpnet":
        sys.exit(f"build_mpnet: {model_dir}/config.json is model_type {cfg.get('model_type')!r}, not mpnet")
    g = Graph(load_safetensors(f"{model_dir}/model.safetensors"))
    hidden, heads, layers, eps = (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"],
                                  cfg["layer_norm_eps"])
    buckets = cfg["relative_attention_num_buckets"]
    head_dim = hidden // heads
    one = g.const("one", np.array(1.0, np.float32))
    half = g.const("half", np.array(0.5, np.float32))
    inv_sqrt2 = g.const("inv_sqrt2", np.array(1.0 / np.sqrt(2.0), np.float32))
    scale = g.const("attn_scale", np.array(1.0 / np.sqrt(head_dim), np.float32))
    split_heads = g.const("shape_split_heads", np.array([0, 0, heads, head_dim], np.int64))
    merge_heads = g.const("shape_merge_heads", np.array([0, 0, hidden], np.int64))

    # Embeddings: word + position (ids from input_ids, pad-aware), then LayerNorm.
    word = g.op("Gather", [g.weight("embeddings.word_embeddings.weight"), "input_ids"], "emb.word", axis=0)
    not_pad = g.op("Cast", [g.op("Not", [g.op("Equal", ["input_ids", g.const("pad_id", np.array(PAD_ID, np.int64))],
                                               "pos.is_pad")], "pos.not_pad.b")], "pos.not_pad", to=TensorProto.INT64)
    counted = g.op("CumSum", [not_pad, g.const("axis1", np.array(1, np.int64))], "pos.cumsum")
    pos_ids = g.op("Add", [g.op("Mul", [counted, not_pad], "pos.masked"), g.const("pad_offset", np.array(PAD_ID, np.int64))],
                   "pos.ids")
    pos = g.op("Gather", [g.weight("embeddings.position_embeddings.weight"), pos_ids], "emb.pos", axis=0)
    x = g.layer_norm(g.op("Add", [word, pos], "emb.sum"), "embeddings.LayerNorm", "embeddings", eps)

    # Additive attention mask [batch, 1, 1, seq]: 0 where attended, -10000 at padding.
    mask_f = g.op("Cast", ["attention_mask"], "mask.f32", to=TensorProto.FLOAT)
    neg = g.op("Mul", [g.op("Sub", [one, mask_f], "mask.inv"), g.const("neg_big", np.array(-1e4, np.float32))],
               "mask.neg")
    attn_bias = g.op("Unsqueeze", [neg, g.const("axes_1_2", np.array([1, 2], np.int64))], "mask.bias")

    # Relative-position bias [1, heads, seq, seq]; seq via Shape(start=1,end=2) -> Slice (see build_minilm).
    seq_len = g.op("Shape", ["input_ids"], "seq_len", start=1, end=2)
    ar = g.op("Slice", [g.const("arange", np.arange(MAX_POSITIONS, dtype=np.int64)),
                        g.const("zero_1d", np.array([0], np.int64)), seq_len,
                        g.const("axis0_1d", np.array([0], np.int64))], "rel.arange")
    rel = g.op("Sub", [g.op("Unsqueeze", [ar, g.const("axes_0", np.array([0], np.int64))], "rel.memory"),
                       g.op("Unsqueeze", [ar, g.const("axes_1", np.array([1], np.int64))], "rel.context")], "rel.pos")
    offsets = np.arange(-(MAX_POSITIONS - 1), MAX_POSITIONS, dtype=np.int64)
    idx = g.op("Add", [rel, g.const("rel_offset", np.array(MAX_POSITIONS - 1, np.int64))], "rel.index")
    bucket = g.op("Gather", [g.const("rel_bucket_table", relative_position_bucket(offsets, buckets)), idx],
                  "rel.bucket", axis=0)
    values = g.op("Gather", [g.weight("encoder.relative_attention_bias.weight"), bucket], "rel.values", axis=0)
    pos_bias = g.op("Unsqueeze", [g.op("Transpose", [values], "rel.heads", perm=[2, 0, 1]), g.const("axes_0b", np.array([0], np.int64))],
                    "rel.bias")

    for i in range(layers):
        p, t = f"encoder.layer.{i}.", f"l{i}."

        def project(name, perm):
            y = g.linear(x, p + "attention.attn." + name, t + name)
            y = g.op("Reshape", [y, split_heads], t + name + ".heads")
            return g.op("Transpose", [y], t + name + ".t", perm=perm)

        q = project("q", [0, 2, 1, 3])   # [b, h, s, d]
        k = project("k", [0, 2, 3, 1])   # [b, h, d, s]
        v = project("v", [0, 2, 1, 3])   # [b, h, s, d]
        scores = g.op("Mul", [g.op("MatMul", [q, k], t + "scores.raw"), scale], t + "scores")
        scores = g.op("Add", [scores, pos_bias], t + "scores.rel")
        probs = g.op("Softmax", [g.op("Add", [scores, attn_bias], t + "scores.masked")], t + "probs", axis=-1)
        ctx = g.op("Transpose", [g.op("MatMul", [probs, v], t + "ctx")], t + "ctx.t", perm=[0, 2, 1, 3])
        ctx = g.op("Reshape", [ctx, merge_heads], t + "ctx.merged")
        attn = g.linear(ctx, p + "attention.attn.o", t + "attn.out")
        h = g.layer_norm(g.op("Add", [attn, x], t + "attn.res"), p + "attention.LayerNorm", t + "attn.norm", eps)
        f = g.linear(h, p + "intermediate.dense", t + "ffn.in")
        erf = g.op("Erf", [g.op("Mul", [f, inv_sqrt2], t + "gelu.scaled")], t + "gelu.erf")
        gelu = g.op("Mul", [g.op("Mul", [f, g.op("Add", [erf, one], t + "gelu.1p")], t + "gelu.prod"), half], t + "gelu")
        out = g.linear(gelu, p + "output.dense", t + "ffn.out")
        x = g.layer_norm(g.op("Add", [out, h], t + "ffn.res"), p + "output.LayerNorm", f"hidden_{i}", eps)

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
        g.nodes, "all-mpnet-base-v2",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("sentence_embedding", TensorProto.FLOAT, ["batch", hidden])],
        initializer=g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8,
                              producer_name="troupe scripts/tools/build_mpnet.py")
    onnx.checker.check_model(model)
    model = onnx.shape_inference.infer_shapes(model)
    for vi in model.graph.value_info:
        dims = vi.type.tensor_type.shape.dim
        if vi.name.startswith("hidden_") and len(dims) == 3:
            dims[0].dim_param, dims[1].dim_param = "batch", "seq"
    onnx.save(model, out_path)


if __name__ == "__main__":
    build(sys.argv[1], sys.argv[2])

"""Check the generated all-mpnet-base-v2 graphs and record reference embeddings for the Rust tests.
usage: check_mpnet.py MODEL_DIR MODELS_OUT_DIR STAGES
The package ships no expected outputs, so the reference is an independent numpy forward pass in float64
straight from the safetensors weights (Hugging Face modeling_mpnet.py written out: pad-aware position ids,
relative-position buckets computed per offset with math.log, post-LN layers, exact GELU, mean pooling, L2
norm). Checks: the whole ONNX graph on Python onnxruntime equals it (<= 1e-4), the STAGES stage files
cut by `troupe pipeline split` chained by tensor name equal the whole graph (<= 1e-5), and a related
sentence pair is closer than an unrelated one.
Writes mpnet_check.json: {"texts", "ids", "attention_mask", "embedding_dim", "embeddings" (flattened,
from the whole graph), "numpy_max_abs_err", "chained_max_abs_err", "cosines"}."""
import json
import math
import os
import sys

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from build_minilm import load_safetensors
from build_mpnet import PAD_ID

TEXTS = ["A man is eating food.", "A man is eating a piece of bread.",
         "The new movie is awesome and everyone loved it.", "A cheetah is running behind its prey on the savanna."]
MAX_SEQ = 384  # sentence_bert_config.json max_seq_length


def bucket(rel, num_buckets=32, max_distance=128):
    n = -rel
    half = num_buckets // 2
    ret = half if n < 0 else 0
    n = abs(n)
    max_exact = half // 2
    if n < max_exact:
        return ret + n
    return ret + min(max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact) * (half - max_exact)),
                     half - 1)


def layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def reference(model_dir, ids, mask):
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    w = {k: v.astype(np.float64) for k, v in load_safetensors(os.path.join(model_dir, "model.safetensors")).items()}
    heads, eps = cfg["num_attention_heads"], cfg["layer_norm_eps"]
    batch, seq = ids.shape
    not_pad = (ids != PAD_ID).astype(np.int64)
    pos_ids = np.cumsum(not_pad, axis=1) * not_pad + PAD_ID
    x = w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][pos_ids]
    x = layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
    buckets = np.array([[bucket(j - i, cfg["relative_attention_num_buckets"]) for j in range(seq)] for i in range(seq)])
    pos_bias = w["encoder.relative_attention_bias.weight"][buckets].transpose(2, 0, 1)[None]  # [1, h, s, s]
    mask_bias = ((1.0 - mask) * -1e4)[:, None, None, :]
    d = x.shape[-1] // heads

    def lin(v, name):
        return v @ w[name + ".weight"].T + w[name + ".bias"]

    def split(v):
        return v.reshape(batch, seq, heads, d).transpose(0, 2, 1, 3)

    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        q, k, v = (split(lin(x, p + "attention.attn." + n)) for n in "qkv")
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d) + pos_bias + mask_bias
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        probs = scores / scores.sum(-1, keepdims=True)
        ctx = (probs @ v).transpose(0, 2, 1, 3).reshape(batch, seq, -1)
        h = layer_norm(lin(ctx, p + "attention.attn.o") + x, w[p + "attention.LayerNorm.weight"],
                       w[p + "attention.LayerNorm.bias"], eps)
        f = lin(h, p + "intermediate.dense")
        f = 0.5 * f * (1.0 + np.vectorize(math.erf)(f / math.sqrt(2.0)))
        x = layer_norm(lin(f, p + "output.dense") + h, w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"],
                       eps)
    m = mask[:, :, None].astype(np.float64)
    mean = (x * m).sum(1) / np.maximum(m.sum(1), 1e-9)
    return mean / np.maximum(np.linalg.norm(mean, axis=-1, keepdims=True), 1e-12)


def session(path):
    return ort.InferenceSession(path, providers=["CPUExecutionProvider"])


def main(model_dir, out_dir, stages):
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    tok.enable_truncation(MAX_SEQ)
    tok.enable_padding(pad_id=PAD_ID, pad_token="<pad>")
    enc = tok.encode_batch(TEXTS)
    ids = np.array([e.ids for e in enc], np.int64)
    mask = np.array([e.attention_mask for e in enc], np.int64)
    m = lambda name: os.path.join(out_dir, name)
    feed = {"input_ids": ids, "attention_mask": mask}
    whole = session(m("mpnet_whole.onnx")).run(None, feed)[0]
    ref_err = float(np.abs(whole - reference(model_dir, ids, mask)).max())
    have = dict(feed)
    for k in range(int(stages)):
        s = session(m(f"mpnet_stage{k}.onnx"))
        missing = [i.name for i in s.get_inputs() if i.name not in have]
        if missing:
            sys.exit(f"check_mpnet: mpnet_stage{k}.onnx needs {missing}, which no earlier stage produces")
        have.update(zip([o.name for o in s.get_outputs()], s.run(None, {i.name: have[i.name] for i in s.get_inputs()})))
    chain_err = float(np.abs(have["sentence_embedding"] - whole).max())
    cos = whole @ whole.T
    print(f"check_mpnet: whole vs numpy reference max abs err {ref_err:.2e}; chained ({stages} stages) vs whole "
          f"{chain_err:.2e}; cosine(0,1) = {cos[0, 1]:.4f}, cosine(0,3) = {cos[0, 3]:.4f}", file=sys.stderr)
    if ref_err > 1e-4 or chain_err > 1e-5 or not cos[0, 1] > cos[0, 3] + 0.2:
        sys.exit("check_mpnet: the generated graphs do not reproduce all-mpnet-base-v2")
    with open(m("mpnet_check.json"), "w") as f:
        json.dump({"texts": TEXTS, "ids": ids.tolist(), "attention_mask": mask.tolist(),
                   "embedding_dim": int(whole.shape[1]), "embeddings": [float(v) for v in whole.ravel()],
                   "numpy_max_abs_err": ref_err, "chained_max_abs_err": chain_err,
                   "cosines": [[float(c) for c in row] for row in cos]}, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])

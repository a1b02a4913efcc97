"""Run the generated MiniLM graphs in Python onnxruntime: check that the chained stages equal the whole
model and that a known sentence pair has cosine 0.755, and record reference embeddings for Rust tests.
usage: check_minilm.py MODEL_DIR MODELS_OUT_DIR
Writes minilm_check.json: {"texts", "ids", "attention_mask", "embedding_dim", "embeddings" (flattened)}."""
import json
import os
import sys

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

TEXTS = ["A man is eating food.", "A man is eating a piece of bread.",
         "The new movie is awesome and everyone loved it.", "A cheetah is running behind its prey on the savanna."]


def session(path):
    return ort.InferenceSession(path, providers=["CPUExecutionProvider"])


def main(model_dir, out_dir):
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    tok.enable_truncation(256)
    tok.enable_padding(pad_id=0, pad_token="[PAD]")
    enc = tok.encode_batch(TEXTS)
    ids = np.array([e.ids for e in enc], np.int64)
    mask = np.array([e.attention_mask for e in enc], np.int64)
    m = lambda name: os.path.join(out_dir, name)
    whole = session(m("minilm_whole.onnx")).run(None, {"input_ids": ids, "attention_mask": mask})[0]
    # The stages as `troupe pipeline split` cut them: each takes, by name, the graph inputs and what the
    # stages before it produced (the cut tensors are whatever the split chose: see minilm_split.json).
    have = {"input_ids": ids, "attention_mask": mask}
    for k in range(3):
        s = session(m(f"minilm_stage{k}.onnx"))
        missing = [i.name for i in s.get_inputs() if i.name not in have]
        if missing:
            sys.exit(f"check_minilm: minilm_stage{k}.onnx needs {missing}, which no earlier stage produces")
        outs = s.run(None, {i.name: have[i.name] for i in s.get_inputs()})
        have.update(zip([o.name for o in s.get_outputs()], outs))
    chained = have["sentence_embedding"]
    err = float(np.abs(chained - whole).max())
    cos = float(whole[0] @ whole[1])
    print(f"check_minilm: chained vs whole max abs err {err:.2e}; cosine(text0, text1) = {cos:.4f}", file=sys.stderr)
    if err > 1e-5 or abs(cos - 0.755) > 0.005:
        sys.exit("check_minilm: the generated graphs do not reproduce all-MiniLM-L6-v2")
    with open(m("minilm_check.json"), "w") as f:
        json.dump({"texts": TEXTS, "ids": ids.tolist(), "attention_mask": mask.tolist(),
                   "embedding_dim": int(whole.shape[1]), "embeddings": [float(v) for v in whole.ravel()]}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""Cut a whole-model ONNX file into consecutive stage files at named tensors.
usage: split_stages.py WHOLE.onnx OUT_PREFIX CUT1,CUT2,...
Stage 0 takes the graph inputs; stage k>0 takes cut k-1 plus attention_mask (the side input every
encoder layer and the pooling head need); the last stage produces the graph outputs."""
import sys

import onnx
from onnx.utils import extract_model

SIDE_INPUTS = ["attention_mask"]


def main(whole, prefix, cuts):
    model = onnx.load(whole, load_external_data=False)
    graph_inputs = [i.name for i in model.graph.input]
    graph_outputs = [o.name for o in model.graph.output]
    stage_inputs = [graph_inputs] + [[c] + SIDE_INPUTS for c in cuts]
    stage_outputs = [[c] for c in cuts] + [graph_outputs]
    for k, (ins, outs) in enumerate(zip(stage_inputs, stage_outputs)):
        path = f"{prefix}_stage{k}.onnx"
        extract_model(whole, path, ins, outs, check_model=True)
        stage = onnx.load(path)
        got_in = [i.name for i in stage.graph.input]
        got_out = [o.name for o in stage.graph.output]
        if got_in != ins or got_out != outs:
            sys.exit(f"split_stages: {path} has inputs {got_in} outputs {got_out}, wanted {ins} -> {outs}")
        print(f"split_stages: {path}: {got_in} -> {got_out}, {len(stage.graph.node)} nodes", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3].split(","))

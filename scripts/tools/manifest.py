"""Write or verify .cache/manifest.json: every file setup produced, with sha256 and size, plus the
ONNX Runtime shared library (the one inside the onnxruntime wheel) that the Rust executor loads.
usage: manifest.py write CACHE_DIR ORT_VERSION [--large]   list the files and record them (--large: with
                                                 the large model's files, `scripts/setup --large`)
       manifest.py verify CACHE_DIR [--large]    exit 1, naming each missing or changed file (--large: the
                                                 large model's files must be listed too)
       manifest.py ort CACHE_DIR                 print the absolute path of the ONNX Runtime library
       manifest.py ort-record CACHE_DIR          exit 1 unless the library matches the wheel's RECORD
       manifest.py ort-venv CACHE_DIR            print that library's absolute path from the venv (no manifest
                                                 needed: setup runs troupe before the manifest is written)
Paths in the manifest are relative to CACHE_DIR, so the repository can move."""
import base64
import csv
import glob
import hashlib
import json
import os
import sys

PRODUCED = [
    "models/minilm_whole.onnx", "models/minilm_stage0.onnx", "models/minilm_stage1.onnx",
    "models/minilm_stage2.onnx", "models/minilm_split.json", "models/minilm_check.json", "models/tiny_mlp.onnx", "models/tiny_int.onnx",
    "models/tiny_check.json", "models/digits_mlp.onnx", "models/vocab.txt", "models/tokenizer_config.json",
    "models/tokenizer_check.json", "data/digits.bin", "src/minilm/model.safetensors",
]

# Built by `scripts/setup --large` only: listed when that ran, verified whenever listed.
LARGE = [
    "models/mpnet_whole.onnx", "models/mpnet_stage0.onnx", "models/mpnet_stage1.onnx", "models/mpnet_stage2.onnx",
    "models/mpnet_stage3.onnx", "models/mpnet_split.json", "models/mpnet_check.json", "src/mpnet/model.safetensors",
]


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def find_ort_library(cache):
    hits = glob.glob(os.path.join(cache, "venv", "lib", "python3*", "site-packages", "onnxruntime", "capi",
                                  "libonnxruntime.so.*"))
    if len(hits) != 1:
        sys.exit(f"manifest: expected one libonnxruntime.so.* in the venv's onnxruntime/capi, found {hits}")
    return os.path.relpath(hits[0], cache)


def ort_matches_record(cache):
    """True when the installed libonnxruntime.so has the sha256 pip recorded when it installed the wheel."""
    lib = glob.glob(os.path.join(cache, "venv", "lib", "python3*", "site-packages", "onnxruntime", "capi",
                                 "libonnxruntime.so.*"))
    records = glob.glob(os.path.join(cache, "venv", "lib", "python3*", "site-packages", "onnxruntime-*.dist-info",
                                     "RECORD"))
    if len(lib) != 1 or len(records) != 1:
        return False
    site = os.path.dirname(os.path.dirname(records[0]))
    rel = os.path.relpath(lib[0], site)
    with open(records[0], newline="") as f:
        for row in csv.reader(f):
            if len(row) >= 2 and row[0] == rel and row[1].startswith("sha256="):
                digest = base64.urlsafe_b64encode(bytes.fromhex(sha256_of(lib[0]))).rstrip(b"=").decode()
                return row[1] == "sha256=" + digest
    return False


def write(cache, ort_version, large=False):
    ort_lib = find_ort_library(cache)
    files = {}
    for rel in PRODUCED + (LARGE if large else []) + [ort_lib]:
        path = os.path.join(cache, rel)
        files[rel] = {"sha256": sha256_of(path), "bytes": os.path.getsize(path)}
    manifest = {"format": 1, "ort_version": ort_version, "ort_library": ort_lib, "files": files}
    tmp = os.path.join(cache, "manifest.json.tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(cache, "manifest.json"))


def verify(cache, large=False):
    path = os.path.join(cache, "manifest.json")
    try:
        manifest = json.load(open(path))
        files = manifest["files"]
    except (OSError, ValueError, KeyError) as e:
        print(f"setup: {path} unreadable ({e})", file=sys.stderr)
        return 1
    bad = 0
    for rel in sorted(set(PRODUCED) | set(LARGE if large else []) | set(files)):
        full = os.path.join(cache, rel)
        if rel not in files:
            print(f"setup: {full} is not in the manifest", file=sys.stderr)
            bad += 1
        elif not os.path.isfile(full):
            print(f"setup: {full} is missing", file=sys.stderr)
            bad += 1
        elif sha256_of(full) != files[rel]["sha256"]:
            print(f"setup: {full} has changed (sha256 differs from the manifest)", file=sys.stderr)
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    cmd, cache = sys.argv[1], sys.argv[2]
    large = "--large" in sys.argv[3:]
    if cmd == "write":
        write(cache, sys.argv[3], large)
    elif cmd == "verify":
        sys.exit(verify(cache, large))
    elif cmd == "ort-record":
        sys.exit(0 if ort_matches_record(cache) else 1)
    elif cmd == "ort-venv":
        print(os.path.join(os.path.abspath(cache), find_ort_library(cache)))
    elif cmd == "ort":
        print(os.path.join(os.path.abspath(cache), json.load(open(os.path.join(cache, "manifest.json")))["ort_library"]))
    else:
        sys.exit(f"manifest: unknown command {cmd}")

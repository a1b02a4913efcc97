"""Copy the MiniLM WordPiece vocabulary, write troupe's tokenizer config, and record reference token ids
from the `tokenizers` package (the Rust tokenizer in kernels/src/tokenizer.rs must reproduce them).
usage: tokenizer_files.py MODEL_DIR OUT_DIR
Writes vocab.txt, tokenizer_config.json and tokenizer_check.json:
  {"max_len": 256, "single": [{"text", "ids"}...], "batch": {"texts", "ids", "attention_mask"}}"""
import json
import os
import shutil
import sys

from tokenizers import Tokenizer

MAX_LEN = 256

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome and everyone loved it.",
    "Héllo Wörld! Café naïve résumé, façade and Ångström.",
    "don't stop-believing, U.S.A. e-mail: test@example.com",
    "unaffable hyperparameterization of transformers",
    "  multiple   spaces\tand\ttabs\nand newlines  ",
    "",
    "中文字符 and 日本語のテキスト mixed with 한국어",
    "Emoji 😀 and symbols ™ © ½ → ∞",
    "Numbers 3.14159, 1,000,000 and the 42nd time",
    "ALL CAPS SHOUTING AND MiXeD CaSe",
    "Ελληνικά και Русский текст",
    "zero\u200bwidth and control\u0007chars\ufffd here",
    "«quoted» — dash… ellipsis ¿qué? ¡sí!",
    "$100 & 50% off #deal ^_^ `code` ~tilde~ {braces} [brackets] <angle> |pipe| \\back",
    "İstanbul straße ǅemal ﬁnance",
    "x" * 120 + " after a very long word",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "The quick brown fox jumps over the lazy dog. " * 40,
]


def main(model_dir, out_dir):
    shutil.copyfile(os.path.join(model_dir, "vocab.txt"), os.path.join(out_dir, "vocab.txt"))
    config = {
        "vocab": "vocab.txt", "lowercase": True, "strip_accents": True, "handle_cjk": True,
        "max_len": MAX_LEN, "max_chars_per_word": 100, "continuing_prefix": "##",
        "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "pad": "[PAD]",
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)

    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(MAX_LEN)
    single = [{"text": s, "ids": tok.encode(s).ids} for s in SENTENCES]
    tok.enable_padding(pad_id=0, pad_token="[PAD]")
    batch_texts = SENTENCES[:3] + [SENTENCES[7]]
    enc = tok.encode_batch(batch_texts)
    batch = {"texts": batch_texts, "ids": [e.ids for e in enc], "attention_mask": [e.attention_mask for e in enc]}
    with open(os.path.join(out_dir, "tokenizer_check.json"), "w") as f:
        json.dump({"max_len": MAX_LEN, "single": single, "batch": batch}, f, ensure_ascii=False)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

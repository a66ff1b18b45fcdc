"""Differential tokenizer test: nibble's ids and decode against tiktoken (o200k_base, from the
committed .tiktoken file) and HF tokenizers (the committed gpt-oss o200k_harmony tokenizer.json) on
thousands of random strings: Unicode across planes, whitespace runs, digits, code, contractions,
special-token text. One nibble process per mode (`nibble tokenize --jsonl`), not one per string.

A fixed seed runs every time, plus a fresh seed (NIBBLE_TOKDIFF_SEED overrides it) printed on failure
so a failing string can be regenerated.
"""
import json
import os
import pathlib
import random
import subprocess
import sys
import unicodedata

import pytest

tiktoken = pytest.importorskip("tiktoken")
tiktoken_load = pytest.importorskip("tiktoken.load")
tokenizers = pytest.importorskip("tokenizers")

ROOT = pathlib.Path(__file__).resolve().parents[2]
NIBBLE = os.environ.get("NIBBLE_BIN", str(ROOT / "build" / "src" / "nibble"))
DATA = ROOT / "tests" / "data" / "tokenizer"
TIKTOKEN_FILE = DATA / "o200k_base.tiktoken"
HARMONY_JSON = DATA / "o200k_harmony" / "tokenizer.json"

FIXED_SEED = 20240605
FRESH_SEED = int(os.environ.get("NIBBLE_TOKDIFF_SEED", random.SystemRandom().randrange(1 << 31)))
N_FIXED, N_FRESH = 2500, 1000

sys.path.insert(0, str(ROOT / "tools" / "reference"))
from make_tokenizer_goldens import O200K_PATTERN, O200K_SPECIALS  # noqa: E402

WHITESPACE = [" ", " ", " ", "\t", "\n", "\r", "\r\n", "\x0b", "\x0c", "\u00a0", "\u0085", "\u1680", "\u2003",
              "\u2028", "\u2029", "\u202f", "\u3000", "\u180e", "\u200b", "\ufeff"]
SNIPPETS = ["def f(x):\n    return x**2\n", "for (int i = 0; i < n; ++i) {", "}\n", "#include <vector>", "=> ",
            "fn main() -> Result<(), E> {", "SELECT * FROM t WHERE a='b';", "<div class=\"x\">", "</div>",
            "    ", "\t\t", "// TODO", "/* c */", "x+=1;", "$ ls -la | grep .py", "[1, 2, 3]", "{\"a\": null}",
            "0x1F", "1e-9", "http://a.b/c?d=e", "C:\\path\\to", "a/b/c/", "...", "!==", "::", "->", "'''"]
WORDS = ["the", "The", "THE", "don't", "I'M", "we'Ve", "they'LL", "it'S", "'s", "'d", "o'clock", "naïve", "Straße",
         "İstanbul", "ǅemal", "東京", "北京大学", "こんにちは", "한국어", "مرحبا", "नमस्ते", "สวัสดี", "Привет",
         "Ελλάδα", "e\u0301", "\u0915\u094d\u0937", "👍🏽", "👩‍👩‍👧‍👦", "🏳️‍🌈", "🇯🇵", "1️⃣", "𝔘𝔫𝔦", "𠜎"]
SPECIALS = ["<|endoftext|>", "<|endofprompt|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
            "<|return|>", "<|call|>", "<|constrain|>", "<|startoftext|>", "<|reserved_200013|>", "<|endoftext",
            "<|", "|>", "<<|end|>|>"]


def assigned_chars():
    """Assigned, non-surrogate code points in every plane (Python's Unicode 14 tables, which match
    PCRE2 10.42's; later additions would compare nibble's Unicode tables with the references')."""
    chars = [chr(c) for c in range(0x110000) if unicodedata.category(chr(c)) not in ("Cn", "Cs")]
    by_plane = {}
    for ch in chars:
        by_plane.setdefault(ord(ch) >> 16, []).append(ch)
    return chars, by_plane


CHARS, BY_PLANE = assigned_chars()
BMP_BLOCKS = [(0x20, 0x7f), (0xa0, 0x250), (0x300, 0x370), (0x370, 0x530), (0x590, 0x700), (0x900, 0xe80),
              (0x1100, 0x1200), (0x2000, 0x2070), (0x3000, 0x3100), (0x4e00, 0x4f00), (0xac00, 0xad00),
              (0xfe00, 0xff00), (0xff00, 0xfff0)]


def random_piece(rng):
    kind = rng.randrange(10)
    if kind == 0:  # any assigned character, any plane
        plane = rng.choice(list(BY_PLANE))
        return "".join(rng.choice(BY_PLANE[plane]) for _ in range(rng.randint(1, 6)))
    if kind == 1:  # a script block
        lo, hi = rng.choice(BMP_BLOCKS)
        s = "".join(chr(rng.randrange(lo, hi)) for _ in range(rng.randint(1, 12)))
        return "".join(c for c in s if unicodedata.category(c) not in ("Cn", "Cs"))
    if kind == 2:
        return "".join(rng.choice(WHITESPACE) for _ in range(rng.randint(1, 12)))
    if kind == 3:
        digits = "0123456789" if rng.random() < 0.8 else "٠١٢٣٤٥٦٧٨٩०१२३४५६७८९"
        return "".join(rng.choice(digits) for _ in range(rng.randint(1, 40)))
    if kind == 4:
        return rng.choice(SNIPPETS)
    if kind == 5:
        return rng.choice(SPECIALS)
    if kind == 6:
        return "".join(chr(rng.randrange(0x20, 0x7f)) for _ in range(rng.randint(1, 20)))
    if kind == 7:  # long run without spaces: exercises BPE on big pieces
        return rng.choice(["a", "ab", "=", "-", "x1", "é", "中"]) * rng.randint(10, 300)
    return rng.choice(WORDS)


def random_text(rng):
    n = rng.choice([0, 1, 1, 2, 3, 5, 8, 13, 30])
    seps = ["", " ", " ", "\n", "'", "-", "."]
    return "".join(random_piece(rng) + rng.choice(seps) for _ in range(n))


def corpus():
    fixed = random.Random(FIXED_SEED)
    fresh = random.Random(FRESH_SEED)
    return [random_text(fixed) for _ in range(N_FIXED)] + [random_text(fresh) for _ in range(N_FRESH)]


def run_nibble(model, lines, *flags):
    assert os.path.exists(NIBBLE), f"nibble binary not found at {NIBBLE} (set NIBBLE_BIN)"
    stdin = "".join(json.dumps(x) + "\n" for x in lines)
    proc = subprocess.run([NIBBLE, "tokenize", "-m", str(model), "--jsonl", *flags], input=stdin,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    out = [json.loads(line) for line in proc.stdout.split("\n")[:-1]]
    assert len(out) == len(lines)
    return out


def compare(name, texts, got, want):
    bad = [(t, g, w) for t, g, w in zip(texts, got, want) if g != w]
    if bad:
        t, g, w = bad[0]
        pytest.fail(f"{name}: {len(bad)}/{len(texts)} strings differ (fixed seed {FIXED_SEED}, fresh seed "
                    f"{FRESH_SEED}; rerun with NIBBLE_TOKDIFF_SEED={FRESH_SEED}); first: {json.dumps(t)}\n"
                    f"  nibble:    {g}\n  reference: {w}")


@pytest.fixture(scope="module")
def texts():
    return corpus()


@pytest.fixture(scope="module")
def base():
    ranks = tiktoken_load.load_tiktoken_bpe(str(TIKTOKEN_FILE))
    return tiktoken.Encoding(name="o200k_base_local", pat_str=O200K_PATTERN, mergeable_ranks=ranks,
                             special_tokens=O200K_SPECIALS)


def test_tiktoken_o200k_base(texts, base):
    compare("tiktoken ordinary", texts, run_nibble(TIKTOKEN_FILE, texts),
            [base.encode(t, disallowed_special=()) for t in texts])
    compare("tiktoken special", texts, run_nibble(TIKTOKEN_FILE, texts, "--special"),
            [base.encode(t, allowed_special="all") for t in texts])


def test_hf_o200k_harmony(texts):
    hf = tokenizers.Tokenizer.from_file(str(HARMONY_JSON))
    compare("hf special", texts, run_nibble(HARMONY_JSON, texts, "--special"),
            [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)])
    hf.encode_special_tokens = True
    compare("hf ordinary", texts, run_nibble(HARMONY_JSON, texts),
            [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)])


def test_decode_round_trip(texts, base):
    ids = [base.encode(t, allowed_special="all") for t in texts]
    compare("decode", texts, run_nibble(TIKTOKEN_FILE, ids, "--decode"), texts)
    hf = tokenizers.Tokenizer.from_file(str(HARMONY_JSON))
    hf_ids = [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]
    compare("decode harmony", texts, run_nibble(HARMONY_JSON, hf_ids, "--decode"),
            hf.decode_batch(hf_ids, skip_special_tokens=False))


def test_decode_bad_id_is_one_line_error():
    proc = subprocess.run([NIBBLE, "tokenize", "-m", str(TIKTOKEN_FILE), "--decode"], input="1 2 999999 3",
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "999999" in lines[0], proc.stderr

#!/usr/bin/env python3
"""Token-id goldens for nibble's tokenizer: an awkward corpus encoded by tiktoken (o200k_base, built
from the local .tiktoken file) and by HF tokenizers (the gpt-oss o200k_harmony tokenizer.json), with
and without special tokens allowed, and once more by HF with ignore_merges turned off (merge-list BPE). Writes OUT_DIR/goldens.json; tests/text/tokenizer_test.cc needs
nibble's ids to match exactly.

usage: make_tokenizer_goldens.py O200K_BASE.tiktoken O200K_HARMONY_TOKENIZER.json OUT_DIR
"""
import json
import os
import sys
import tempfile

import tiktoken
import tiktoken.load
import tokenizers

# tiktoken_ext/openai_public.py, o200k_base.
O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
O200K_SPECIALS = {"<|endoftext|>": 199999, "<|endofprompt|>": 200018}

CODE_PY = '''def fib(n: int) -> int:
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):\r\n        a, b = b, a + b  # tuple swap
    return a\n\n\nprint(f"{fib(90):,}")\t\t
'''
CODE_CPP = '''template <typename T>
std::vector<T> topk(const std::vector<T>& v, size_t k) {
  auto out = v;  std::partial_sort(out.begin(), out.begin() + k, out.end(), std::greater<>());
  out.resize(k); return out;   // O(n log k)
}
#define NB_CHECK(x) do { if (!(x)) abort(); } while (0)
'''
CODE_RS = 'fn main() { let v: Vec<u64> = (1..=10).map(|x| x * x).collect(); println!("{:?}", v); }'
CODE_JS = 'const f = async (x) => { await fetch(`/api/${x}?q=1&r=2`); return x ?? null; }; // ok'
CODE_SQL = "SELECT u.id, COUNT(*) AS n FROM users u LEFT JOIN orders o ON o.user_id=u.id WHERE u.name LIKE '%O''Brien%' GROUP BY 1;"
CODE_HTML = '<div class="a&amp;b" data-x=\'1\'><br/><!-- comment --></div>\n<script>if (a<b && c>d) {}</script>'
CODE_SHELL = 'for f in *.txt; do grep -nE "^(foo|bar)\\s+[0-9]{3,}$" "$f" || echo "miss: $f" >&2; done'

CORPUS = [
    "",
    " ",
    "a",
    "Hello, world!",
    "hello world",
    "  leading and trailing spaces   ",
    "tabs\tand\t\ttabs\t",
    "line1\nline2\r\nline3\rline4\n\n\n",
    "\n\n\n\n",
    "\r\n\r\n  \r\n\t\n",
    "trailing spaces   \n  indented\n\t\tmixed \t \n",
    " " * 33 + "x" + "\t" * 9 + "y" + "\n" * 7,
    "I'm you're he's we've they'll she'd it's",
    "I'M YOU'RE HE'S WE'VE THEY'LL SHE'D IT'S",
    "It'S they'Ll We'Ve 'S 'll 'VE 's' ''s",
    "don't can't won't shouldn't y'all o'clock rock'n'roll",
    "1234567890123456789012345678901234567890",
    "3.14159265358979323846 -0.0001 1e-10 6.022e23 0x7fffffff 1_000_000",
    "Phone: +1 (555) 123-4567, ZIP 90210-1234, 2024-06-01T12:34:56Z",
    "١٢٣٤٥ ٠٫٥ ۱۲۳ १२३४ ๑๒๓",
    "中文分词测试：我们今天去北京大学。",
    "日本語のテキスト、カタカナとひらがな。漢字も。",
    "한국어 텍스트입니다. 안녕하세요!",
    "العربية: مرحبا بالعالم، كيف حالك؟",
    "हिन्दी में पाठ: नमस्ते दुनिया।",
    "ภาษาไทย: สวัสดีชาวโลก",
    "Ελληνικά: Γειά σου Κόσμε. Русский: Привет, мир!",
    "e\u0301 vs \u00e9, a\u0308o\u0308u\u0308, Z\u0335\u0321\u0327a\u0336l\u0337g\u0338o\u0334",
    "\u1100\u1161\u11a8 (jamo) vs \uac01",
    "👍 👍🏽 👩‍👩‍👧‍👦 🏳️‍🌈 🇺🇸🇯🇵 ❤️‍🔥 🧑🏿‍💻 1️⃣",
    "emoji💯in🔥the🚀middle",
    "math: ∀x∈ℝ, ∑ᵢ xᵢ² ≤ ∫₀^∞ e^{-x} dx ≠ ∞; α→β ⇒ γ",
    "fullwidth ＡＢＣ１２３ halfwidth ｶﾀｶﾅ",
    "ligatures ﬁ ﬂ ﬀ and ßẞ İı ǅ ǈ",
    "\u00a0nbsp\u2003em\u3000ideographic\u2028ls\u2029ps\u0085nel\u180emvs\u200bzwsp\ufeffbom",
    "controls \x00\x01\x07\x1b[31mred\x1b[0m\x7f\x1c\x1d\x1e\x1f",
    "\ufffd replacement \uffff noncharacter \ue000 private \U0010fffd",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝐁𝐨𝐥𝐝 𓀀𓁐 𠜎𠜱𠝹 (astral)",
    "URLs: https://example.com/a/b?c=d&e=f#g mailto:x@y.z ftp://[::1]:21/",
    "path/to/file.txt C:\\Windows\\System32 ../../etc/passwd ~/.bashrc",
    "!!!??? ... --- === +++ *** ### @@@ $$$ %%% ^^^ &&& ((( ))) [[[ ]]] {{{ }}}",
    "a/b/c//d///e\n/\n//\n",
    "CamelCaseIdentifier snake_case_identifier SCREAMING_CASE kebab-case",
    "HTTPServerError XMLHttpRequest iPhone eBay McDonald's O'Neil",
    "<|endoftext|>",
    "<|endofprompt|>",
    "text before<|endoftext|>text after",
    "<|start|>user<|message|>hi<|end|><|start|>assistant",
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\"}<|call|>",
    "<|reserved_200000|><|reserved_201087|><|startoftext|><|return|>",
    "<|endoftext|><|endoftext|>  <|endoftext|>\n",
    "<|endoftext <|endoftext|| <|not_a_token|> <<|start|>|> <|<|end|>|>",
    "<|END|> <| start |> < |start| > <|start|",
    "\\x00 \\xff \\u00e9 %C3%A9 &#233; &eacute;",
    CODE_PY,
    CODE_CPP,
    CODE_RS,
    CODE_JS,
    CODE_SQL,
    CODE_HTML,
    CODE_SHELL,
    '{"key": "value", "nested": {"list": [1, 2.5, true, null, "x\\ny"]}}',
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "=" * 100 + "\n" + "-" * 77,
    "Pneumonoultramicroscopicsilicovolcanoconiosis supercalifragilisticexpialidocious",
    "Donaudampfschifffahrtsgesellschaftskapitänsmütze",
    "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
    "The slings and arrows of outrageous fortune,\nOr to take arms against a sea of troubles",
]


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    tiktoken_path, hf_path, out_dir = sys.argv[1:]
    ranks = tiktoken.load.load_tiktoken_bpe(tiktoken_path)
    base = tiktoken.Encoding(name="o200k_base_local", pat_str=O200K_PATTERN, mergeable_ranks=ranks,
                             special_tokens=O200K_SPECIALS)
    hf = tokenizers.Tokenizer.from_file(hf_path)
    hf_plain = tokenizers.Tokenizer.from_file(hf_path)
    hf_plain.encode_special_tokens = True  # special-token text encodes as ordinary text
    # The same vocabulary with ignore_merges off: every piece goes through the merge list, which
    # exercises nibble's merge-list BPE (tiktoken and ignore_merges take whole-vocab pieces directly).
    with open(hf_path, encoding="utf-8") as f:
        doc = json.load(f)
    doc["model"]["ignore_merges"] = False
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False, encoding="utf-8") as f:
        json.dump(doc, f)
    hf_merges = tokenizers.Tokenizer.from_file(f.name)
    os.unlink(f.name)

    cases = []
    for text in CORPUS:
        case = {
            "text": text,
            "o200k_base": base.encode(text, disallowed_special=()),
            "o200k_base_special": base.encode(text, allowed_special="all"),
            "harmony": hf_plain.encode(text, add_special_tokens=False).ids,
            "harmony_special": hf.encode(text, add_special_tokens=False).ids,
            "harmony_merges_special": hf_merges.encode(text, add_special_tokens=False).ids,
        }
        for key in ("o200k_base", "o200k_base_special"):
            assert base.decode_bytes(case[key]) == text.encode(), (key, text)
        cases.append(case)

    specials = {t.content: i for i, t in hf.get_added_tokens_decoder().items()
                if t.special and not t.content.startswith("<|reserved_")}
    out = {
        "generator": "tools/reference/make_tokenizer_goldens.py",
        "versions": {"tiktoken": tiktoken.__version__, "tokenizers": tokenizers.__version__},
        "harmony_vocab_size": hf.get_vocab_size(with_added_tokens=True),
        "harmony_specials": dict(sorted(specials.items(), key=lambda kv: kv[1])),
        "cases": cases,
    }
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "goldens.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=True, indent=1)
        f.write("\n")
    print(f"wrote {path}: {len(cases)} cases")


if __name__ == "__main__":
    main()

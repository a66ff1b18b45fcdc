"""Quality of the bundled demo models (issue: Quality), black-box through the nibble binary.

* `nibble quantize` reproduces the committed quantized demo checkpoints byte for byte from the committed
  BF16 ones (so models/ holds what the documented command makes), and its outputs load.
* FP4 perplexity bound: on the first ~1,500 held-out tokens (the last 10 % of data/tinyshakespeare.txt,
  never trained on), each FP4 demo model's perplexity stays within 5 % of its BF16 checkpoint, its mean
  KL divergence from BF16 below 0.02 nats and its top-1 agreement above 85 %. Measured over the whole
  held-out text (docs/quality.md): ppl ratio 0.994 (gpt-oss, MXFP4 experts) and 0.9999 (qwen3, NVFP4),
  KL 0.0069 / 0.0034, top-1 93.5 % / 95.1 %. A quantization bug (wrong nibble order, scale or
  rounding) moves KL by orders of magnitude, far past these bounds, while the bounds leave room for
  legitimate recipe changes (e.g. another MXFP4 scale rule).
* Bad input gets one line on stderr and a non-zero exit.
"""
import json
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NIBBLE = os.environ.get("NIBBLE_BIN", str(ROOT / "build" / "src" / "nibble"))
MODELS = ROOT / "models"
HELDOUT_OFFSET = 1003856  # tools/train_demo/train.py: the held-out text starts here (a line start)
HELDOUT_BYTES = 4000  # 1,517 tokens: six 256-token windows, a few seconds on one CPU core

PPL_RATIO_MAX = 1.05
KL_MEAN_MAX = 0.02
TOP1_MIN = 0.85

DEMOS = [  # (BF16 dir, quantized dir, format)
    ("gpt-oss-demo-bf16", "gpt-oss-demo-mxfp4", "mxfp4"),
    ("qwen3-demo-bf16", "qwen3-demo-nvfp4", "nvfp4"),
]


def nibble(*args, check=True, env=None):
    proc = subprocess.run([NIBBLE, *map(str, args)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"nibble {' '.join(map(str, args))} failed ({proc.returncode}): {proc.stderr}")
    return proc


def assert_one_line_error(proc, *needles):
    assert proc.returncode != 0, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one error line, got: {proc.stderr!r}"
    for n in needles:
        assert n in lines[0], f"{n!r} not in {lines[0]!r}"


@pytest.fixture(scope="module")
def heldout(tmp_path_factory):
    data = (ROOT / "data" / "tinyshakespeare.txt").read_bytes()[HELDOUT_OFFSET:HELDOUT_OFFSET + HELDOUT_BYTES]
    path = tmp_path_factory.mktemp("heldout") / "heldout.txt"
    path.write_bytes(data[:data.rindex(b"\n") + 1])
    return path


def evaluate(model, ref, text, env=None):
    out = nibble("eval", "-m", model, "--ref-model", ref, "--text-file", text, "--seq-len", 256, "--json",
                 "--device", "cpu", env=env)
    return json.loads(out.stdout)


@pytest.mark.parametrize("bf16,quantized,fmt", DEMOS)
def test_quantize_reproduces_committed_model(bf16, quantized, fmt, tmp_path):
    out = tmp_path / quantized
    nibble("quantize", "-m", MODELS / bf16, "-o", out, "--format", fmt)
    assert (out / "model.safetensors").read_bytes() == (MODELS / quantized / "model.safetensors").read_bytes()
    for f in ["config.json", "tokenizer.json"] + (["hf_quant_config.json"] if fmt == "nvfp4" else []):
        assert json.loads((out / f).read_text()) == json.loads((MODELS / quantized / f).read_text()), f


@pytest.mark.parametrize("bf16,quantized,fmt", DEMOS)
def test_fp4_perplexity_within_bound_of_bf16(bf16, quantized, fmt, heldout):
    base = evaluate(MODELS / bf16, MODELS / bf16, heldout)
    assert base["kl_mean"] < 1e-9 and base["top1_agree"] == 1.0  # a model against itself
    q = evaluate(MODELS / quantized, MODELS / bf16, heldout)
    assert q["n_tokens"] == base["n_tokens"] > 1000
    ratio = q["ppl"] / base["ppl"]
    print(f"{quantized}: ppl {q['ppl']:.3f} vs BF16 {base['ppl']:.3f} (ratio {ratio:.4f}), "
          f"KL mean {q['kl_mean']:.5f} p99 {q['kl_p99']:.5f}, top-1 {q['top1_agree']:.4f}")
    assert ratio < PPL_RATIO_MAX
    assert q["kl_mean"] < KL_MEAN_MAX
    assert q["kl_p99"] >= q["kl_mean"] > 0
    assert q["top1_agree"] > TOP1_MIN
    assert base["ppl"] < 150  # the demo models learned something (held-out ppl ~82-87, uniform 2048)


@pytest.mark.parametrize("bf16,quantized,fmt", DEMOS)
def test_fp8_activation_emulation_costs_little_over_fp4(bf16, quantized, fmt, heldout):
    # NIBBLE_GEMM_FP8=1 on the CPU emulates the sm_90a FP8 GEMMs' roundings (E4M3 activations, NVFP4 weight
    # products rounded to E4M3). Over the whole held-out text it raised KL 0.0069 -> 0.0076 (gpt-oss) and
    # 0.0034 -> 0.0042 (qwen3), as the GPU did (docs/quality.md): bounded here at 1.6x FP4's own KL, and it
    # must change something (the switch reached the matmuls).
    w4a16 = evaluate(MODELS / quantized, MODELS / bf16, heldout)
    w4a8 = evaluate(MODELS / quantized, MODELS / bf16, heldout, {"NIBBLE_GEMM_FP8": "1"})
    print(f"{quantized}: KL {w4a16['kl_mean']:.5f} -> {w4a8['kl_mean']:.5f} with FP8 activations, "
          f"top-1 {w4a16['top1_agree']:.4f} -> {w4a8['top1_agree']:.4f}")
    assert w4a8["kl_mean"] != w4a16["kl_mean"]
    assert w4a8["kl_mean"] < 1.6 * w4a16["kl_mean"]
    assert w4a8["top1_agree"] > TOP1_MIN


def test_fp8_quantize_loads_and_is_closer_than_fp4(heldout, tmp_path):
    out = tmp_path / "qwen3-demo-fp8"
    nibble("quantize", "-m", MODELS / "qwen3-demo-bf16", "-o", out, "--format", "fp8")
    fp8 = evaluate(out, MODELS / "qwen3-demo-bf16", heldout)
    fp4 = evaluate(MODELS / "qwen3-demo-nvfp4", MODELS / "qwen3-demo-bf16", heldout)
    assert fp8["kl_mean"] < fp4["kl_mean"] / 4


def test_default_model_writes_shakespeare():
    out = nibble("run", "-m", MODELS / "default", "-p", "ROMEO:", "-n", 48, "--temperature", 0.8, "--seed", 1,
                 "--device", "cpu").stdout
    words = out.split()
    assert len(words) > 15
    assert any(w.endswith(":") and w[:-1].isupper() for w in words), out  # a speaker line such as "JULIET:"


def test_quantize_bad_input_one_line(tmp_path):
    out = tmp_path / "out"
    bf16 = MODELS / "qwen3-demo-bf16"
    assert_one_line_error(nibble("quantize", "-m", tmp_path / "missing", "-o", out, "--format", "nvfp4", check=False),
                          "not a directory")
    assert_one_line_error(nibble("quantize", "-m", bf16, "-o", out, "--format", "nvfp4", "--layers", "attn,bogus",
                                 check=False), "--layers", "bogus")
    assert_one_line_error(nibble("quantize", "-m", bf16, "-o", out, "--format", "mxfp4", check=False), "--format mxfp4")
    assert_one_line_error(nibble("quantize", "-m", bf16, "-o", out, "--format", "nvfp4", "--layers", "lm_head",
                                 check=False), "--layers lm_head")
    assert_one_line_error(nibble("quantize", "-m", MODELS / "gpt-oss-demo-bf16", "-o", out, "--format", "nvfp4",
                                 check=False), "--format nvfp4", "gpt-oss")
    assert_one_line_error(nibble("quantize", "-m", MODELS / "gpt-oss-demo-mxfp4", "-o", out, "--format", "mxfp4",
                                 check=False), "already quantized")
    assert_one_line_error(nibble("quantize", "-m", bf16, "-o", out, "--format", "int4", check=False), "--format")
    assert not (out / "model.safetensors").exists()


def test_eval_ref_model_errors(heldout):
    golden = ROOT / "tests" / "data" / "models" / "llama_bf16"
    assert_one_line_error(nibble("eval", "-m", MODELS / "qwen3-demo-bf16", "--ref-model", golden, "--text-file",
                                 heldout, check=False), "--ref-model", "vocabulary")
    assert_one_line_error(nibble("eval", "-m", MODELS / "qwen3-demo-bf16", "--ref-model", MODELS / "missing",
                                 "--text-file", heldout, check=False), "--ref-model")
    assert_one_line_error(nibble("eval", "-m", MODELS / "qwen3-demo-bf16", "--text-file", heldout, "--device", "cpu",
                                 "--kv-cache-dtype", "fp8", check=False), "--kv-cache-dtype")

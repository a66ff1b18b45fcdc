"""The command-line contract (issue: Foundation, item 8), black-box through the nibble binary.

`nibble run` greedy ids and `nibble eval --json` NLL are checked against the HF transformers
references committed with each tiny golden checkpoint (tests/data/models/*/reference.json), with the
CI bounds: NLL within 0.02 per position; greedy ids equal up to the first step whose reference
top-2 margin is below 0.05. Every error case must print exactly one line on stderr and exit non-zero.
"""
import json
import math
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NIBBLE = os.environ.get("NIBBLE_BIN", str(ROOT / "build" / "src" / "nibble"))
MODELS = ROOT / "tests" / "data" / "models"
MODEL_NAMES = sorted(p.name for p in MODELS.iterdir() if (p / "reference.json").exists()) if MODELS.exists() else []


def nibble(*args, stdin=None, check=True, env=None):
    proc = subprocess.run([NIBBLE, *map(str, args)], input=stdin, capture_output=True, text=True, timeout=600,
                          env=None if env is None else {**os.environ, **env})
    if check and proc.returncode != 0:
        raise AssertionError(f"nibble {' '.join(map(str, args))} failed ({proc.returncode}): {proc.stderr}")
    return proc


def assert_one_line_error(proc, *needles):
    assert proc.returncode != 0, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one error line, got: {proc.stderr!r}"
    for n in needles:
        assert n in lines[0], f"{n!r} not in {lines[0]!r}"


def reference(name):
    return json.loads((MODELS / name / "reference.json").read_text())


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_eval_matches_reference_nll(name, tmp_path):
    ref = reference(name)
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(" ".join(map(str, ref["tokens"])) + "\n")
    out = json.loads(nibble("eval", "-m", MODELS / name, "--tokens-file", tokens, "--json", "--chunk", 20).stdout)
    assert out["n_tokens"] == len(ref["tokens"])
    assert len(out["nll"]) == len(ref["nll"])
    worst = max(abs(a - b) for a, b in zip(out["nll"], ref["nll"]))
    assert worst <= 0.02, f"{name}: max |nll - ref| = {worst}"
    assert out["ppl"] == pytest.approx(math.exp(out["mean_nll"]), rel=1e-9)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_run_greedy_matches_reference(name):
    ref = reference(name)["greedy"]
    prompt = " ".join(map(str, ref["prompt"]))
    n = len(ref["ids"])
    out = nibble("run", "-m", MODELS / name, "--prompt-tokens", prompt, "-n", n, "--temperature", 0,
                 "--print-tokens", "--ignore-eos").stdout.split()
    got = [int(x) for x in out]
    for step, (want, margin) in enumerate(zip(ref["ids"], ref["margins"])):
        if margin < 0.05:
            break
        assert step < len(got) and got[step] == want, f"{name}: step {step}: got {got[step:step+1]}, want {want}"


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_run_text_and_chat(name):
    out = nibble("run", "-m", MODELS / name, "-p", "ROMEO:", "-n", 8, "--temperature", 0)
    assert out.stdout.endswith("\n")
    out = nibble("run", "-m", MODELS / name, "--chat", "Hello", "-n", 4, "--temperature", 0.8, "--seed", 3)
    again = nibble("run", "-m", MODELS / name, "--chat", "Hello", "-n", 4, "--temperature", 0.8, "--seed", 3)
    assert out.stdout == again.stdout  # seeded sampling repeats


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_inspect(name):
    out = nibble("inspect", "-m", MODELS / name).stdout
    cfg = json.loads((MODELS / name / "config.json").read_text())
    assert cfg["model_type"] in out


def test_eval_text_file(tmp_path):
    if "gpt_oss_mxfp4" not in MODEL_NAMES:
        pytest.skip("no gpt-oss golden")
    text = tmp_path / "t.txt"
    text.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n")
    out = json.loads(nibble("eval", "-m", MODELS / "gpt_oss_mxfp4", "--text-file", text, "--json").stdout)
    assert out["n_tokens"] > 5 and out["ppl"] > 1


def test_errors_are_one_line(tmp_path):
    model = MODELS / MODEL_NAMES[0] if MODEL_NAMES else tmp_path
    assert_one_line_error(nibble("run", "-m", tmp_path / "missing", "-p", "x", check=False), "missing")
    assert_one_line_error(nibble("run", "-m", model, check=False), "prompt")
    assert_one_line_error(nibble("run", "-m", model, "-p", "x", "--chat", "y", check=False), "excludes")
    assert_one_line_error(nibble("run", "-m", model, "-p", "x", "--device", "tpu", check=False), "device")
    assert_one_line_error(nibble("run", "-m", model, "-p", "x", "--top-p", "2", check=False), "top-p")
    assert_one_line_error(nibble("run", "-m", model, "--prompt-tokens", "1 x 3", check=False), "'x'")
    assert_one_line_error(nibble("run", "-m", model, "--prompt-tokens", "99999999", check=False), "99999999")
    assert_one_line_error(nibble("frobnicate", check=False))
    bad = tmp_path / "bad.txt"
    bad.write_text("1 2 -5")
    assert_one_line_error(nibble("eval", "-m", model, "--tokens-file", bad, check=False), "bad.txt", "-5")
    assert_one_line_error(nibble("eval", "-m", model, "--tokens-file", tmp_path / "nope.txt", check=False), "nope.txt")
    assert_one_line_error(nibble("eval", "-m", model, check=False), "--tokens-file")
    assert_one_line_error(nibble("inspect", "-m", tmp_path, check=False), "config.json")
    assert_one_line_error(nibble("tokenize", "-m", tmp_path / "none.json", stdin="hi", check=False), "none.json")


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_dummy_weights_from_config_alone(name, tmp_path):
    """--dummy-weights: a directory with only config.json runs (random weights, CPU backend); token-id
    prompts work without a tokenizer, text needs one and says which file is missing."""
    (tmp_path / "config.json").write_text((MODELS / name / "config.json").read_text())
    out = nibble("run", "-m", tmp_path, "--dummy-weights", "--device", "cpu", "--prompt-tokens", "1 2 3", "-n", 5,
                 "--temperature", 0, "--print-tokens", "--ignore-eos").stdout.split()
    assert len(out) == 5 and all(t.isdigit() for t in out), out
    # Seeded sampling from the same random weights repeats.
    args = ["run", "-m", tmp_path, "--dummy-weights", "--device", "cpu", "--prompt-tokens", "4 5", "-n", 6,
            "--temperature", 1.0, "--top-k", 20, "--seed", 7, "--print-tokens", "--ignore-eos"]
    assert nibble(*args).stdout == nibble(*args).stdout
    assert_one_line_error(nibble("run", "-m", tmp_path, "--dummy-weights", "--device", "cpu", "-p", "hi",
                                 check=False), "tokenizer.json")
    assert_one_line_error(nibble("run", "-m", tmp_path, "--device", "cpu", "--prompt-tokens", "1", "--print-tokens",
                                 check=False), "safetensors")
    assert_one_line_error(nibble("eval", "-m", tmp_path, "--dummy-weights", "--device", "cpu", "--dense-format",
                                 "fp8", "--tokens-file", tmp_path / "config.json", check=False))
    # run and serve take the CUDA load options too; on the CPU backend they are one-line errors.
    assert_one_line_error(nibble("run", "-m", tmp_path, "--dummy-weights", "--device", "cpu", "--prompt-tokens", "1",
                                 "--kv-cache-dtype", "fp8", check=False), "--kv-cache-dtype", "CUDA backend")
    assert_one_line_error(nibble("serve", "-m", tmp_path, "--dummy-weights", "--device", "cpu",
                                 "--kv-cache-dtype", "fp8", check=False), "--kv-cache-dtype", "CUDA backend")


def test_dummy_weights_in_help():
    for cmd in ("run", "eval", "serve"):
        assert "--dummy-weights" in nibble(cmd, "--help").stdout, cmd


def test_gemm_activations_env_is_checked():
    """NIBBLE_GEMM_ACTIVATIONS takes fp16 or hi-lo (CUDA prefill GEMMs, one-token GEMVs); a misspelt value is a one-line
    error on any backend instead of a silently ignored setting."""
    model = ROOT / "models" / "default"
    args = ["run", "-m", model, "--device", "cpu", "--prompt-tokens", "1 2", "-n", 2, "--print-tokens"]
    assert_one_line_error(nibble(*args, check=False, env={"NIBBLE_GEMM_ACTIVATIONS": "hilo"}),
                          "NIBBLE_GEMM_ACTIVATIONS=hilo", "fp16 or hi-lo")
    for ok in ("fp16", "hi-lo"):
        assert len(nibble(*args, env={"NIBBLE_GEMM_ACTIVATIONS": ok}).stdout.split()) == 2


def test_gemm_measurement_envs_are_checked():
    """NIBBLE_WSP_STAGES (2: the portable warp-specialized GEMM tile at GB10's pipeline depth),
    NIBBLE_MOE_VARIANT (0-3: a portable block tile for the MoE GEMMs), NIBBLE_WS_RS (0-2: the sm_90a dense
    tile's variant), NIBBLE_WS_BM (128 or 256: its tokens per tile), NIBBLE_MOE_WSR (0-2: the sm_90a MoE
    GEMMs' tile), NIBBLE_MOE_WSR_BM (128 or 256: its tokens per tile) and NIBBLE_FA_BUFFERS (2: flash
    attention's two-buffer BF16 kernels) are measurement switches; a misspelt value is a one-line error, not a
    silent default."""
    model = ROOT / "models" / "default"
    args = ["run", "-m", model, "--device", "cpu", "--prompt-tokens", "1 2", "-n", 2, "--print-tokens"]
    for var, bad, needle in (("NIBBLE_WSP_STAGES", "4", "expected 2"), ("NIBBLE_WSP_STAGES", "two", "expected 2"),
                             ("NIBBLE_MOE_VARIANT", "x", "0, 1, 2 or 3"), ("NIBBLE_MOE_VARIANT", "4", "0, 1, 2 or 3"),
                             ("NIBBLE_WS_RS", "3", "0, 1 or 2"), ("NIBBLE_WS_RS", "on", "0, 1 or 2"),
                             ("NIBBLE_WS_BM", "64", "128 or 256"), ("NIBBLE_MOE_WSR", "off", "0, 1 or 2"),
                             ("NIBBLE_MOE_WSR_BM", "64", "128 or 256"), ("NIBBLE_FA_BUFFERS", "3", "expected 2"),
                             ("NIBBLE_FA_BUFFERS", "two", "expected 2")):
        assert_one_line_error(nibble(*args, check=False, env={var: bad}), f"{var}={bad}", needle)
    for var, ok in (("NIBBLE_WSP_STAGES", "2"), ("NIBBLE_MOE_VARIANT", "1"), ("NIBBLE_WS_RS", "2"),
                    ("NIBBLE_WS_BM", "128"), ("NIBBLE_MOE_WSR", "2"), ("NIBBLE_MOE_WSR_BM", "256"),
                    ("NIBBLE_FA_BUFFERS", "2")):
        assert len(nibble(*args, env={var: ok}).stdout.split()) == 2


@pytest.mark.parametrize("var", ["NIBBLE_FP4_STREAM", "NIBBLE_DECODE_FUSION", "NIBBLE_GEMM_WS", "NIBBLE_FC1_EVEN",
                                 "NIBBLE_ATTN_KEYS", "NIBBLE_L2_PREFETCH", "NIBBLE_FP4_MMA", "NIBBLE_WGMMA",
                                 "NIBBLE_DEFER_ROUTES", "NIBBLE_FUSED_HEAD", "NIBBLE_O_STAGED", "NIBBLE_GEMM_FP8",
                                 "NIBBLE_MOE_DENSE_GEMM", "NIBBLE_ATTN_GROUP"])
def test_zero_one_env_is_checked(var):
    """NIBBLE_FP4_STREAM (CUDA one-token FP4 GEMV), NIBBLE_DECODE_FUSION (CUDA decode fusions),
    NIBBLE_GEMM_WS (the warp-specialized sm_90a prefill GEMM), NIBBLE_FC1_EVEN (the one-token MoE FC1
    grid), NIBBLE_ATTN_KEYS (the lanes-over-keys decode attention), NIBBLE_L2_PREFETCH (CUDA L2
    prefetch of upcoming weights), NIBBLE_FP4_MMA (the 2..8-token FP4 GEMV), NIBBLE_WGMMA (the sm_90a
    prefill GEMM tile), NIBBLE_DEFER_ROUTES (the one-token MoE kernels selecting their experts),
    NIBBLE_FUSED_HEAD (the one-token attention head in one kernel), NIBBLE_O_STAGED (decode attention
    staging the O projection's input), NIBBLE_GEMM_FP8 (the sm_90a W4A8 dense prefill GEMMs) and
    NIBBLE_MOE_DENSE_GEMM (BF16 experts' prefill through cuBLASLt) and NIBBLE_ATTN_GROUP (the grouped long-context
    decode attention) take 0 or 1; anything else is a one-line error."""
    model = ROOT / "models" / "default"
    args = ["run", "-m", model, "--device", "cpu", "--prompt-tokens", "1 2", "-n", 2, "--print-tokens"]
    assert_one_line_error(nibble(*args, check=False, env={var: "off"}), f"{var}=off", "0 or 1")
    for ok in ("0", "1"):
        assert len(nibble(*args, env={var: ok}).stdout.split()) == 2


def test_stream_sms_env_is_checked():
    """NIBBLE_STREAM_SMS (a test switch: the one-token FP4 kernels' grids on at most that many SMs) takes a
    positive count; anything else is a one-line error."""
    model = ROOT / "models" / "default"
    args = ["run", "-m", model, "--device", "cpu", "--prompt-tokens", "1 2", "-n", 2, "--print-tokens"]
    for bad in ("0", "two", "2x", ""):
        assert_one_line_error(nibble(*args, check=False, env={"NIBBLE_STREAM_SMS": bad}),
                              f"NIBBLE_STREAM_SMS={bad}", "positive SM count")
    assert len(nibble(*args, env={"NIBBLE_STREAM_SMS": "2"}).stdout.split()) == 2


E2E_BENCH = pathlib.Path(NIBBLE).parent / "nibble_e2e_bench"


@pytest.mark.skipif(not E2E_BENCH.exists(), reason="no CUDA build (nibble_e2e_bench)")
@pytest.mark.parametrize("args,needles", [
    (["--dense-formats", "mxfp4,fp6"], ["--dense-formats", "'fp6'"]),
    (["--dense-formats", "mxfp4,"], ["--dense-formats", "''"]),
    (["--gemm-acts", "hilo"], ["--gemm-acts hilo", "fp16 or hi-lo"]),
    (["--pp-dense-format", "fp4"], ["--pp-dense-format fp4", "keep, fp8, mxfp4 or nvfp4"]),
    (["--depth", "4k"], ["--depth 4k", "token count"]),
    (["--depth", "-1"], ["--depth -1", "token count"]),
    (["--pp", "2k"], ["--pp 2k", "token counts"]),
    (["--pp", "512,,2048"], ["--pp 512,,2048", "token counts"]),
])
def test_e2e_bench_rejects_bad_arguments(args, needles):
    """The end-to-end benchmark checks its arguments before touching a GPU: one line, exit 2."""
    proc = subprocess.run([str(E2E_BENCH), *args, "configs/gpt-oss-20b"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 2
    assert_one_line_error(proc, *needles)


@pytest.mark.skipif(not E2E_BENCH.exists(), reason="no CUDA build (nibble_e2e_bench)")
def test_e2e_bench_rejects_bad_host_times_env():
    """NIBBLE_BENCH_HOST_TIMES (the host's time per decode step) takes 0 or 1: anything else is one line, exit 2."""
    env = dict(os.environ, NIBBLE_BENCH_HOST_TIMES="yes")
    proc = subprocess.run([str(E2E_BENCH), "configs/gpt-oss-20b"], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env=env)
    assert proc.returncode == 2
    assert_one_line_error(proc, "NIBBLE_BENCH_HOST_TIMES=yes", "0 or 1")


GEMM_BENCH = pathlib.Path(NIBBLE).parent / "nibble_gemm_bench"


@pytest.mark.skipif(not GEMM_BENCH.exists(), reason="no CUDA build (nibble_gemm_bench)")
@pytest.mark.parametrize("args,needles", [
    (["--m", "12x"], ["--m 12x", "token counts"]),
    (["--m", "512,"], ["--m 512,", "token counts"]),
    (["--m", "0"], ["--m 0", "token counts"]),
    (["--m"], ["'--m'", "--quick or --m"]),
    (["--quick", "--m", "128"], ["'--quick ...'", "--quick or --m"]),
    (["--bogus"], ["'--bogus'", "--quick or --m"]),
])
def test_gemm_bench_rejects_bad_arguments(args, needles):
    """The prefill GEMM benchmark checks its arguments before touching a GPU: one line, exit 2."""
    proc = subprocess.run([str(GEMM_BENCH), *args], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2
    assert_one_line_error(proc, *needles)


ATTENTION_BENCH = pathlib.Path(NIBBLE).parent / "nibble_attention_bench"


@pytest.mark.skipif(not ATTENTION_BENCH.exists(), reason="no CUDA build (nibble_attention_bench)")
@pytest.mark.parametrize("args,needles", [
    (["--fast"], ["'--fast'", "none or --quick"]),
    (["--quick", "2048"], ["'--quick ...'", "none or --quick"]),
])
def test_attention_bench_rejects_bad_arguments(args, needles):
    """The attention benchmark checks its arguments before touching a GPU: one line, exit 2."""
    proc = subprocess.run([str(ATTENTION_BENCH), *args], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2
    assert_one_line_error(proc, *needles)


KERNEL_BENCH = pathlib.Path(NIBBLE).parent / "nibble_kernel_bench"


@pytest.mark.skipif(not KERNEL_BENCH.exists(), reason="no CUDA build (nibble_kernel_bench)")
def test_kernel_bench_rejects_bad_activation_mode():
    """NIBBLE_GEMM_ACTIVATIONS is checked before touching a GPU: one line naming it, exit 2."""
    proc = subprocess.run([str(KERNEL_BENCH)], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, "NIBBLE_GEMM_ACTIVATIONS": "hilo"})
    assert proc.returncode == 2
    assert_one_line_error(proc, "NIBBLE_GEMM_ACTIVATIONS=hilo", "fp16 or hi-lo")

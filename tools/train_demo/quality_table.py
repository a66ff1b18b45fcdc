#!/usr/bin/env python3
"""The numbers of docs/quality.md: `nibble eval --json` over the held-out 10 % of the corpus for each
demo model and format, with KL divergence and top-1 agreement against the BF16 checkpoint.

Usage:
    python3 tools/train_demo/quality_table.py --nibble build/src/nibble --set cpu [--max-tokens N] [--out F.json]
    python3 tools/train_demo/quality_table.py --nibble build-gpu/src/nibble --set gpu --device cuda

--set cpu: every demo checkpoint (BF16, and the FP8 / NVFP4 / MXFP4 files `nibble quantize` makes,
           written to a temp dir first when not under models/), on the CPU reference backend.
--set gpu: the gpt-oss demo (MXFP4 experts) under every --dense-format x --kv-cache-dtype combination,
           and the qwen3 demo under every --dense-format, on the CUDA backend.
The held-out text is data/tinyshakespeare.txt from byte 1003856 (the split of tools/train_demo/train.py);
each row scores it as independent 256-token sequences (--seq-len 256, the training context).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
HELDOUT_OFFSET = 1003856  # train.py split_corpus(): first line start after 90 % of the characters


def heldout_file():
    with open(os.path.join(REPO, "data", "tinyshakespeare.txt"), "rb") as f:
        data = f.read()[HELDOUT_OFFSET:]
    tmp = tempfile.NamedTemporaryFile("wb", suffix=".txt", delete=False)
    tmp.write(data)
    tmp.close()
    return tmp.name


def ensure_quantized(nibble, bf16, fmt, tmpdir):
    out = os.path.join(tmpdir, os.path.basename(bf16).replace("bf16", fmt))
    subprocess.run([nibble, "quantize", "-m", bf16, "-o", out, "--format", fmt], check=True, capture_output=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nibble", default=os.path.join(REPO, "build", "src", "nibble"))
    ap.add_argument("--set", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", default="0")
    ap.add_argument("--out")
    a = ap.parse_args()
    m = lambda name: os.path.join(REPO, "models", name)  # noqa: E731
    text = heldout_file()
    tmpdir = tempfile.mkdtemp()
    rows = []
    if a.set == "cpu":
        rows += [("gpt-oss demo", "BF16", m("gpt-oss-demo-bf16"), m("gpt-oss-demo-bf16"), []),
                 ("gpt-oss demo", "MXFP4 experts", m("gpt-oss-demo-mxfp4"), m("gpt-oss-demo-bf16"), []),
                 ("qwen3 demo", "BF16", m("qwen3-demo-bf16"), m("qwen3-demo-bf16"), []),
                 ("qwen3 demo", "FP8 (attn, mlp)", ensure_quantized(a.nibble, m("qwen3-demo-bf16"), "fp8", tmpdir),
                  m("qwen3-demo-bf16"), []),
                 ("qwen3 demo", "NVFP4 (attn, mlp)", m("qwen3-demo-nvfp4"), m("qwen3-demo-bf16"), [])]
    else:
        for dense in ["keep", "fp8", "mxfp4", "nvfp4"]:
            for kv in ["bf16", "fp8"]:
                rows.append(("gpt-oss demo", "MXFP4 experts, --dense-format %s --kv-cache-dtype %s" % (dense, kv),
                             m("gpt-oss-demo-mxfp4"), m("gpt-oss-demo-bf16"),
                             ["--dense-format", dense, "--kv-cache-dtype", kv]))
        for dense in ["keep", "fp8", "mxfp4", "nvfp4"]:
            rows.append(("qwen3 demo", "BF16, --dense-format %s" % dense, m("qwen3-demo-bf16"), m("qwen3-demo-bf16"),
                         ["--dense-format", dense]))
    results = []
    for model_name, fmt, path, ref, extra in rows:
        cmd = [a.nibble, "eval", "-m", path, "--ref-model", ref, "--text-file", text, "--seq-len", "256", "--json",
               "--device", a.device, "--threads", a.threads] + extra
        t0 = time.time()
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            print("FAILED %s %s: %s" % (model_name, fmt, p.stderr.strip()), flush=True)
            results.append({"model": model_name, "format": fmt, "error": p.stderr.strip()})
            continue
        r = json.loads(p.stdout)
        row = {"model": model_name, "format": fmt, "n_tokens": r["n_tokens"], "predicted": len(r["nll"]),
               "ppl": r["ppl"], "mean_nll": r["mean_nll"], "kl_mean": r["kl_mean"], "kl_p99": r["kl_p99"],
               "top1_agree": r["top1_agree"], "seconds": round(time.time() - t0, 1)}
        results.append(row)
        print("| %s | %s | %.3f | %.5f | %.5f | %.2f %% |" % (model_name, fmt, row["ppl"], row["kl_mean"],
                                                           row["kl_p99"], 100 * row["top1_agree"]), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    os.unlink(text)
    sys.exit(1 if any("error" in r for r in results) else 0)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Cross-check a `nibble quantize` output (or any BF16 checkpoint) against HF transformers.

Usage:
    python3 tools/reference/check_quantized.py -m MODEL_DIR (--text-file F | --tokens-file F)
        [--seq-len 256] [--max-tokens N] [--nibble build/src/nibble | --nibble-json EVAL.json]
        [--device auto|cpu|cuda] [--tol 0.01] [--out summary.json]

How HF loads the checkpoint:
  * gpt-oss MXFP4 (quantization_config.quant_method "mxfp4"): transformers' own MXFP4 loader,
    Mxfp4Config(dequantize=True) (it reads the _blocks/_scales tensors and dequantizes them itself).
  * ModelOpt NVFP4 (hf_quant_config.json) and compressed-tensors FP8 "float-quantized": transformers
    has no built-in loader for them without extra packages, so the stored tensors are dequantized here
    with the formulas of docs/formats.md (ModelOpt: e2m1 * fp32(weight_scale) * weight_scale_2; FP8:
    e4m3 * weight_scale per row) and the model is built from config.json minus quantization_config.
  * BF16: from_pretrained as it is.
The model runs in float32 with eager attention over independent windows of --seq-len tokens (as
`nibble eval --seq-len`), and its per-position NLL is compared with `nibble eval --json` on the same
tokens (run here with --nibble, or read from --nibble-json). Exit status 1 when max |diff| > --tol.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def unpack_e2m1(packed):
    lo, hi = packed & 0x0F, packed >> 4
    codes = torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    return E2M1[codes.long()]


def read_state(mdir):
    st = {}
    for f in sorted(os.listdir(mdir)):
        if f.endswith(".safetensors"):
            st.update(load_file(os.path.join(mdir, f)))
    return st


def dequantized_state(mdir, st):
    """ModelOpt NVFP4 and compressed-tensors FP8 linear layers -> float32 weights; other tensors as stored."""
    out = {}
    for name, t in st.items():
        if name.endswith(".weight_scale") or name.endswith(".weight_scale_2") or name.endswith(".input_scale"):
            continue
        base = name[:-len(".weight")] if name.endswith(".weight") else None
        if base and t.dtype == torch.uint8 and base + ".weight_scale_2" in st:
            sb = st[base + ".weight_scale"].to(torch.float32)
            s2 = st[base + ".weight_scale_2"].to(torch.float32).reshape(())
            v = unpack_e2m1(t)
            n, k = v.shape
            out[name] = (v.reshape(n, k // 16, 16) * sb.unsqueeze(-1) * s2).reshape(n, k)
        elif base and t.dtype == torch.float8_e4m3fn:
            out[name] = t.to(torch.float32) * st[base + ".weight_scale"].to(torch.float32).reshape(-1, 1)
        else:
            out[name] = t.to(torch.float32)
    return out


def load_hf(mdir, device):
    from transformers import AutoConfig, AutoModelForCausalLM
    with open(os.path.join(mdir, "config.json")) as f:
        cfg = json.load(f)
    method = (cfg.get("quantization_config") or {}).get("quant_method")
    modelopt = os.path.exists(os.path.join(mdir, "hf_quant_config.json"))
    if method == "mxfp4":
        from transformers import Mxfp4Config
        model = AutoModelForCausalLM.from_pretrained(mdir, quantization_config=Mxfp4Config(dequantize=True),
                                                     dtype=torch.float32, attn_implementation="eager")
        how = "transformers Mxfp4Config(dequantize=True)"
    elif modelopt or method == "compressed-tensors":
        c = {k: v for k, v in cfg.items() if k != "quantization_config"}
        config = AutoConfig.for_model(c.pop("model_type"), **c)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
        sd = dequantized_state(mdir, read_state(mdir))
        if cfg.get("tie_word_embeddings") and "lm_head.weight" not in sd:
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        res = model.load_state_dict(sd, strict=True)
        assert not res.missing_keys and not res.unexpected_keys, res
        how = "dequantized here (%s), from_config + load_state_dict(strict)" % ("modelopt nvfp4" if modelopt else "ct fp8")
    else:
        model = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32, attn_implementation="eager")
        how = "from_pretrained (unquantized)"
    model = model.to(torch.float32).to(device).eval()
    return model, how


@torch.no_grad()
def hf_nll(model, tokens, seq_len, device):
    out = []
    for s in range(0, len(tokens) - 1, seq_len):
        seg = tokens[s:s + seq_len]
        if len(seg) < 2:
            break
        x = torch.tensor([seg], dtype=torch.long, device=device)
        lp = torch.log_softmax(model(input_ids=x).logits[0].double(), dim=-1)
        out += (-lp[:-1].gather(-1, x[0, 1:, None]).squeeze(-1)).tolist()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--text-file")
    ap.add_argument("--tokens-file")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=0, help="use only the first N tokens (0: all)")
    ap.add_argument("--nibble", help="nibble binary to run `eval --json` with")
    ap.add_argument("--nibble-json", help="output of `nibble eval --json` on the same tokens")
    ap.add_argument("--nibble-args", default="", help="extra arguments for nibble eval (e.g. --device cuda)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--tol", type=float, default=0.01)
    ap.add_argument("--out")
    a = ap.parse_args()
    device = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if a.device == "auto" else a.device))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    if a.tokens_file:
        tokens = [int(x) for x in open(a.tokens_file).read().split()]
    else:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(os.path.join(a.model, "tokenizer.json"))
        tokens = tok.encode(open(a.text_file, encoding="utf-8").read(), add_special_tokens=False).ids
    if a.max_tokens:
        tokens = tokens[:a.max_tokens]
    tmp = tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False)
    tmp.write(" ".join(map(str, tokens)) + "\n")
    tmp.close()

    if a.nibble_json:
        nib = json.load(open(a.nibble_json))
    elif a.nibble:
        cmd = [a.nibble, "eval", "-m", a.model, "--tokens-file", tmp.name, "--json", "--seq-len", str(a.seq_len)]
        cmd += a.nibble_args.split()
        nib = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    else:
        sys.exit("give --nibble BIN or --nibble-json FILE")

    model, how = load_hf(a.model, device)
    ref = hf_nll(model, tokens, a.seq_len, device)
    if len(ref) != len(nib["nll"]):
        sys.exit("length mismatch: HF %d positions, nibble %d" % (len(ref), len(nib["nll"])))
    diffs = [abs(x - y) for x, y in zip(ref, nib["nll"])]
    summary = {
        "model": os.path.basename(os.path.normpath(a.model)), "hf_load": how, "device": str(device),
        "positions": len(ref), "hf_mean_nll": sum(ref) / len(ref), "nibble_mean_nll": nib["mean_nll"],
        "max_abs_diff": max(diffs), "mean_abs_diff": sum(diffs) / len(diffs), "tol": a.tol,
        "ok": max(diffs) <= a.tol,
    }
    print(json.dumps(summary))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(summary, f, indent=1)
    os.unlink(tmp.name)
    sys.exit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Tiny random FP4 checkpoints + HF transformers reference outputs (goldens).

Usage:
    python3 tools/reference/make_goldens.py --out tests/data/models [--device auto|cpu|cuda] [--seed 0]
    python3 tools/reference/make_goldens.py --train-tokenizer   # re-train tools/reference/data/base_tokenizer.json

Writes four HF-style model directories under --out:

  gpt_oss_mxfp4/             gpt_oss, MXFP4 experts in the exact gpt-oss layout, 2 shards + index
  qwen3_moe_nvfp4_modelopt/  qwen3_moe, ModelOpt NVFP4 (legacy hf_quant_config.json), per-expert tensors
  qwen3_nvfp4_ct/            qwen3 dense, compressed-tensors nvfp4-pack-quantized, tied embeddings
  llama_bf16/                llama, BF16, llama3 rope scaling

each with config.json, *.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json and reference.json (see tools/reference/README.md for the fields).

Determinism
-----------
* Every random number comes from Python's `random.Random` (its `random()` stream is guaranteed stable
  across Python versions), seeded per tensor from sha256(seed, model, tensor name), and is turned
  into weights with plain IEEE arithmetic (no libm), then cast with torch's round-to-nearest-even
  casts.  All quantization runs on the CPU in float32.  So the checkpoint bytes do not depend on the
  device, on torch's RNG, or on the order in which tensors are made.
* The activation calibration for the NVFP4 input scales runs on the CPU and is rounded up to a power
  of two, so last-bit differences between torch builds cannot change it.
* The BPE tokenizer is trained once (--train-tokenizer) and committed as
  tools/reference/data/base_tokenizer.json; the per-family tokenizer.json files are that JSON plus the
  family's special tokens, serialized by this script.
* Only the reference numbers (reference.json) depend on the device/torch build, in the last digits.

References are computed with HF transformers from the *dequantized stored values* (read back from the
written files, dequantized in float32 with the formulas of docs/formats.md), model built from the
written config.json minus quantization_config, float32, eager attention, eager experts, TF32 off.
"""

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import sys

import torch
from safetensors.torch import load_file, save_file

import tokenizers
import transformers
from tokenizers import Tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
BASE_TOKENIZER = os.path.join(HERE, "data", "base_tokenizer.json")
CORPUS = os.path.join(REPO, "data", "tinyshakespeare.txt")

BASE_VOCAB = 480  # byte-level BPE: 256 bytes + 224 merges
VOCAB_PAD = 16  # config vocab_size = tokenizer size rounded up to a multiple of this (unused rows are zero)
LM_STD = 0.5  # lm_head init std: logits std ~ LM_STD * sqrt(hidden) ~ 4
SEQ_LEN = 64
PROMPT_LEN = 16
GEN_LEN = 24
# The fixed passage: the first ROMEO speech of the corpus (tokenized, first 64 tokens taken).
PASSAGE_ANCHOR = "\nROMEO:\n"
PASSAGE_CHARS = 600

SPECIALS = {
    "gpt_oss": ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>",
                "<|start|>", "<|end|>", "<|message|>", "<|call|>"],
    "qwen3": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
              "</tool_call>"],
    "llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
               "<|eot_id|>"],
}

# ----------------------------------------------------------------------------------------------
# Deterministic random numbers
# ----------------------------------------------------------------------------------------------


def _rng(seed, *names):
    h = hashlib.sha256(("%s|" % seed + "|".join(names)).encode()).digest()
    return random.Random(int.from_bytes(h[:8], "little"))


def randn(seed, name, shape, std=1.0, mean=0.0):
    """Approximately normal numbers (Irwin-Hall: sum of 4 uniforms, tails cut at 3.46 std) made
    with exact IEEE arithmetic only, so the values are identical on every machine."""
    n = 1
    for s in shape:
        n *= s
    r = _rng(seed, name).random
    c = std * math.sqrt(3.0) * 0.5  # var(sum of 4 U(-1,1)) = 4/3 -> std 1 after * sqrt(3)/2
    vals = [((r() + r() + r() + r()) * 2.0 - 4.0) * c + mean for _ in range(n)]
    return torch.tensor(vals, dtype=torch.float64).reshape(shape).to(torch.float32)


def bf16(t):
    """Round to BF16 (RNE) and return the BF16 tensor."""
    return t.to(torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# FP4 / FP8 codecs (docs/formats.md sections 1, 2.3, 3)
# ----------------------------------------------------------------------------------------------

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)


def e2m1_encode(x):
    """float32 tensor (already divided by its scale) -> uint8 codes 0..15.
    Round to nearest, ties to even, saturating; thresholds of formats.md 1.1. Sign kept (x<0 -> bit 3)."""
    a = x.abs()
    mag = ((a > 0.25).to(torch.uint8) + (a >= 0.75).to(torch.uint8) + (a > 1.25).to(torch.uint8)
           + (a >= 1.75).to(torch.uint8) + (a > 2.5).to(torch.uint8) + (a >= 3.5).to(torch.uint8)
           + (a > 5.0).to(torch.uint8))
    return mag | ((x < 0).to(torch.uint8) << 3)


def e2m1_decode(codes):
    return E2M1_VALUES[codes.long()]


def pack_nibbles(codes):
    """[..., K] codes -> [..., K/2] bytes, element 2i in the low nibble, 2i+1 in the high nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed):
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def to_e4m3(x):
    """float32 -> float8_e4m3fn, RNE with saturation to 448 (torch's cast is RNE but not satfinite)."""
    return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def mxfp4_quantize(w):
    """w: float32 [..., N, K] -> (blocks U8 [..., N, K/32, 16], scales U8 [..., N, K/32]).
    OCP MX rule: shared_exp = floor(log2(amax)) - 2, clamped to [-127, 127]; elements E2M1 RNE saturating."""
    *lead, n, k = w.shape
    assert k % 32 == 0
    wb = w.reshape(*lead, n, k // 32, 32)
    amax = wb.abs().amax(dim=-1)
    amax = torch.where(amax > 0, amax, torch.full_like(amax, 2.0 ** -126))  # all-zero block: smallest normal
    _, e = torch.frexp(amax)  # amax = m * 2^e, m in [0.5, 1) -> floor(log2(amax)) = e - 1 (exact)
    shared = (e - 1 - 2).clamp(-127, 127)
    scaled = torch.ldexp(wb, (-shared).unsqueeze(-1).to(torch.float32))  # exact power-of-two scaling
    codes = e2m1_encode(scaled)
    blocks = pack_nibbles(codes)  # [..., N, K/32, 16]
    scales = (shared + 127).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


def mxfp4_dequantize(blocks, scales):
    """gpt-oss layout: blocks [..., N, K/32, 16], scales [..., N, K/32] -> float32 [..., N, K]."""
    codes = unpack_nibbles(blocks)  # [..., N, K/32, 32]
    vals = e2m1_decode(codes)
    exp = scales.to(torch.int32) - 127
    out = torch.ldexp(vals, exp.unsqueeze(-1).to(torch.float32))
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)


def nvfp4_quantize_modelopt(w):
    """w float32 [N, K] -> (packed U8 [N, K/2], block scale F8 [N, K/16], weight_scale_2 F32 0-d).
    s2 = amax/(6*448); sb = E4M3(amax_blk/(6*s2)) (zero -> 1.0); codes = E2M1(w/(sb*s2))."""
    n, k = w.shape
    assert k % 16 == 0
    amax = w.abs().amax()
    s2 = (amax / (6.0 * 448.0)).to(torch.float32)
    wb = w.reshape(n, k // 16, 16)
    sb = to_e4m3(wb.abs().amax(dim=-1) / (6.0 * s2))
    sbf = sb.to(torch.float32)
    sbf = torch.where(sbf == 0, torch.ones_like(sbf), sbf)
    sb = sbf.to(torch.float8_e4m3fn)
    codes = e2m1_encode(wb / (sbf * s2).unsqueeze(-1)).reshape(n, k)
    return pack_nibbles(codes).contiguous(), sb.contiguous(), s2.reshape(())


def nvfp4_dequantize_modelopt(packed, sb, s2):
    codes = unpack_nibbles(packed)
    n, k = codes.shape
    v = e2m1_decode(codes).reshape(n, k // 16, 16) * sb.to(torch.float32).unsqueeze(-1)
    return (v * s2.to(torch.float32).reshape(())).reshape(n, k)


def nvfp4_quantize_ct(w):
    """compressed-tensors flavour: global scale gs = 2688/amax is a divisor.
    sb = E4M3(amax_blk/6 * gs) (zero -> 1.0); codes = E2M1(w / (sb/gs))."""
    n, k = w.shape
    amax = w.abs().amax()
    gs = (torch.tensor(6.0 * 448.0, dtype=torch.float32) / amax).to(torch.float32)
    wb = w.reshape(n, k // 16, 16)
    sbf = to_e4m3(wb.abs().amax(dim=-1) / 6.0 * gs).to(torch.float32)
    sbf = torch.where(sbf == 0, torch.ones_like(sbf), sbf)
    sb = sbf.to(torch.float8_e4m3fn)
    codes = e2m1_encode(wb / (sbf / gs).unsqueeze(-1)).reshape(n, k)
    return pack_nibbles(codes).contiguous(), sb.contiguous(), gs.reshape(1)


def nvfp4_dequantize_ct(packed, sb, gs):
    codes = unpack_nibbles(packed)
    n, k = codes.shape
    v = e2m1_decode(codes).reshape(n, k // 16, 16) * sb.to(torch.float32).unsqueeze(-1)
    return (v / gs.to(torch.float32).reshape(())).reshape(n, k)


def pow2_ceil(x):
    """Smallest power of two >= x (x > 0), exact."""
    m, e = math.frexp(float(x))
    return x if m == 0.5 else math.ldexp(1.0, e)


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------


def train_base_tokenizer():
    from tokenizers import decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BASE_VOCAB, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train([CORPUS], trainer)
    assert tok.get_vocab_size() == BASE_VOCAB, tok.get_vocab_size()
    return json.loads(tok.to_str())


def family_tokenizer_json(base, family):
    """Base byte-level BPE + the family's special tokens appended at the end of the vocab."""
    tj = json.loads(json.dumps(base))
    n = len(tj["model"]["vocab"])
    specials = SPECIALS[family]
    tj["added_tokens"] = [{"id": n + i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                           "normalized": False, "special": True} for i, s in enumerate(specials)]
    if family == "llama3":
        # Like Llama 3: encode() prepends <|begin_of_text|>.
        bos = specials[0]
        tj["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [n], "tokens": [bos]}},
        }
    ids = {s: n + i for i, s in enumerate(specials)}
    return tj, ids, n + len(specials)


def dump_json(path, obj, indent=2):
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=indent, ensure_ascii=False))
        f.write("\n")


# ----------------------------------------------------------------------------------------------
# Model specs: config + float32 weights in checkpoint layout/names
# ----------------------------------------------------------------------------------------------


def padded_vocab(ntok):
    return (ntok + VOCAB_PAD - 1) // VOCAB_PAD * VOCAB_PAD


def embed_like(seed, model, name, vocab, ntok, hidden, std):
    w = randn(seed, model + "|" + name, [vocab, hidden], std)
    w[ntok:] = 0.0  # padded, never-produced rows
    return w


def spec_gpt_oss(seed, ntok, ids):
    m = "gpt_oss_mxfp4"
    H, L, NH, NKV, D, E, TOPK, I = 64, 4, 4, 2, 16, 4, 2, 64
    V = padded_vocab(ntok)
    cfg = {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": ids["<|return|>"],
        "experts_per_token": TOPK,
        "head_dim": D,
        "hidden_act": "silu",
        "hidden_size": H,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": I,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)],
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": NH,
        "num_experts_per_tok": TOPK,
        "num_hidden_layers": L,
        "num_key_value_heads": NKV,
        "num_local_experts": E,
        "output_router_logits": False,
        "pad_token_id": ids["<|endoftext|>"],
        "quantization_config": {
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                       "model.embed_tokens", "lm_head"],
            "quant_method": "mxfp4",
        },
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 8,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.55.0.dev0",
        "use_cache": True,
        "vocab_size": V,
    }
    gen = {"bos_token_id": ids["<|startoftext|>"], "do_sample": True,
           "eos_token_id": [ids["<|return|>"], ids["<|endoftext|>"], ids["<|call|>"]],
           "pad_token_id": ids["<|endoftext|>"], "transformers_version": "4.55.0.dev0"}
    r = lambda name, shape, std, mean=0.0: randn(seed, m + "|" + name, shape, std, mean)  # noqa: E731
    w = {}
    w["model.embed_tokens.weight"] = embed_like(seed, m, "embed", V, ntok, H, 1.0)
    for l in range(L):
        p = "model.layers.%d." % l
        w[p + "input_layernorm.weight"] = r(p + "ln1", [H], 0.1, 1.0)
        # q/k std ~0.8 per element after the (unit-rms) norm: with YaRN's concentration 1.3466 applied
        # to cos and sin the scaled q.k logits have std ~1.2, so attention is far from uniform.
        w[p + "self_attn.q_proj.weight"] = r(p + "q", [NH * D, H], 0.8 / math.sqrt(H))
        w[p + "self_attn.q_proj.bias"] = r(p + "qb", [NH * D], 0.2)
        w[p + "self_attn.k_proj.weight"] = r(p + "k", [NKV * D, H], 0.8 / math.sqrt(H))
        w[p + "self_attn.k_proj.bias"] = r(p + "kb", [NKV * D], 0.2)
        w[p + "self_attn.v_proj.weight"] = r(p + "v", [NKV * D, H], 1.0 / math.sqrt(H))
        w[p + "self_attn.v_proj.bias"] = r(p + "vb", [NKV * D], 0.1)
        w[p + "self_attn.o_proj.weight"] = r(p + "o", [H, NH * D], 1.5 / math.sqrt(NH * D))
        w[p + "self_attn.o_proj.bias"] = r(p + "ob", [H], 0.1)
        # Sinks comparable to the attention logits (mean 1, std 1.5): they absorb a large, varying share.
        w[p + "self_attn.sinks"] = r(p + "sinks", [NH], 1.5, 1.0)
        w[p + "post_attention_layernorm.weight"] = r(p + "ln2", [H], 0.1, 1.0)
        # Router logits std ~3: clear top-2 choices (near-ties are also rejected, see candidate_ok).
        w[p + "mlp.router.weight"] = r(p + "router", [E, H], 3.0 / math.sqrt(H))
        w[p + "mlp.router.bias"] = r(p + "routerb", [E], 0.5)
        # FC1 pre-activations std ~4 (bias std 0.5): a sizeable fraction exceeds the +-7 swiglu clamp.
        w[p + "mlp.experts.gate_up_proj"] = r(p + "gate_up", [E, 2 * I, H], 4.0 / math.sqrt(H))
        w[p + "mlp.experts.gate_up_proj_bias"] = r(p + "gate_upb", [E, 2 * I], 0.5)
        # The clamped SwiGLU output is ~5-10 in magnitude; keep the expert output at rms ~1.
        w[p + "mlp.experts.down_proj"] = r(p + "down", [E, H, I], 0.15 / math.sqrt(I))
        w[p + "mlp.experts.down_proj_bias"] = r(p + "downb", [E, H], 0.1)
    w["model.norm.weight"] = r("norm", [H], 0.1, 1.0)
    # lm_head std LM_STD (0.5): logits std ~4, top-2 margins mostly well above 0.05 (median ~1).
    w["lm_head.weight"] = embed_like(seed, m, "lm_head", V, ntok, H, LM_STD)
    return cfg, gen, w


def _qwen_common_cfg(ids, H, L, NH, NKV, D, V, tie):
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "head_dim": D,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "max_position_embeddings": 40960,
        "max_window_layers": L,
        "num_attention_heads": NH,
        "num_hidden_layers": L,
        "num_key_value_heads": NKV,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": tie,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": V,
    }


def _qwen_gen(ids):
    return {"bos_token_id": ids["<|endoftext|>"], "do_sample": True,
            "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "pad_token_id": ids["<|endoftext|>"],
            "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}


def _attn_weights(r, p, H, NH, NKV, D, qk_norm):
    w = {}
    w[p + "input_layernorm.weight"] = r(p + "ln1", [H], 0.1, 1.0)
    qk_std = (1.0 if qk_norm else 1.2) / math.sqrt(H)
    w[p + "self_attn.q_proj.weight"] = r(p + "q", [NH * D, H], qk_std)
    w[p + "self_attn.k_proj.weight"] = r(p + "k", [NKV * D, H], qk_std)
    w[p + "self_attn.v_proj.weight"] = r(p + "v", [NKV * D, H], 1.0 / math.sqrt(H))
    w[p + "self_attn.o_proj.weight"] = r(p + "o", [H, NH * D], 1.5 / math.sqrt(NH * D))
    if qk_norm:
        # q/k are normalized per head to rms 1, times these weights (~1.3): scaled logits std ~1.7.
        w[p + "self_attn.q_norm.weight"] = r(p + "qn", [D], 0.2, 1.3)
        w[p + "self_attn.k_norm.weight"] = r(p + "kn", [D], 0.2, 1.3)
    w[p + "post_attention_layernorm.weight"] = r(p + "ln2", [H], 0.1, 1.0)
    return w


def spec_qwen3_moe(seed, ntok, ids):
    m = "qwen3_moe_nvfp4_modelopt"
    H, L, NH, NKV, D, E, TOPK, I = 64, 2, 4, 2, 32, 8, 2, 32
    V = padded_vocab(ntok)
    cfg = {"architectures": ["Qwen3MoeForCausalLM"]}
    cfg.update(_qwen_common_cfg(ids, H, L, NH, NKV, D, V, False))
    cfg.update({
        "decoder_sparse_step": 1,
        "intermediate_size": 128,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": I,
        "norm_topk_prob": True,
        "num_experts": E,
        "num_experts_per_tok": TOPK,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    })
    cfg = dict(sorted(cfg.items()))
    r = lambda name, shape, std, mean=0.0: randn(seed, m + "|" + name, shape, std, mean)  # noqa: E731
    w = {"model.embed_tokens.weight": embed_like(seed, m, "embed", V, ntok, H, 1.0)}
    for l in range(L):
        p = "model.layers.%d." % l
        w.update(_attn_weights(r, p, H, NH, NKV, D, True))
        w[p + "mlp.gate.weight"] = r(p + "router", [E, H], 3.0 / math.sqrt(H))
        for e in range(E):
            q = p + "mlp.experts.%d." % e
            w[q + "gate_proj.weight"] = r(q + "gate", [I, H], 1.5 / math.sqrt(H))
            w[q + "up_proj.weight"] = r(q + "up", [I, H], 1.5 / math.sqrt(H))
            w[q + "down_proj.weight"] = r(q + "down", [H, I], 1.0 / math.sqrt(I))
    w["model.norm.weight"] = r("norm", [H], 0.1, 1.0)
    w["lm_head.weight"] = embed_like(seed, m, "lm_head", V, ntok, H, LM_STD)
    return cfg, _qwen_gen(ids), w


def spec_qwen3_dense(seed, ntok, ids):
    m = "qwen3_nvfp4_ct"
    H, L, NH, NKV, D, I = 64, 2, 4, 2, 16, 128
    V = padded_vocab(ntok)
    cfg = {"architectures": ["Qwen3ForCausalLM"]}
    cfg.update(_qwen_common_cfg(ids, H, L, NH, NKV, D, V, True))
    cfg.update({"intermediate_size": I, "model_type": "qwen3"})
    cfg = dict(sorted(cfg.items()))
    r = lambda name, shape, std, mean=0.0: randn(seed, m + "|" + name, shape, std, mean)  # noqa: E731
    # Tied: the embedding is also the lm_head (std LM_STD, logits std ~4); the layers (outputs rms ~1)
    # dominate the residual stream.
    w = {"model.embed_tokens.weight": embed_like(seed, m, "embed", V, ntok, H, LM_STD)}
    for l in range(L):
        p = "model.layers.%d." % l
        w.update(_attn_weights(r, p, H, NH, NKV, D, True))
        w[p + "mlp.gate_proj.weight"] = r(p + "gate", [I, H], 1.5 / math.sqrt(H))
        w[p + "mlp.up_proj.weight"] = r(p + "up", [I, H], 1.5 / math.sqrt(H))
        w[p + "mlp.down_proj.weight"] = r(p + "down", [H, I], 1.0 / math.sqrt(I))
    w["model.norm.weight"] = r("norm", [H], 0.1, 1.0)
    return cfg, _qwen_gen(ids), w


def spec_llama(seed, ntok, ids):
    m = "llama_bf16"
    H, L, NH, NKV, I = 64, 2, 4, 2, 128
    D = H // NH  # 16. theta 5e5, d=16: wavelengths 2*pi*5e5^(i/8) = 6.3, 32, 168, 868 (kept),
    #               4487 (smoothed: between 8192/4 and 8192/1), 23197, 1.2e5, 6.2e5 (divided by 8).
    V = padded_vocab(ntok)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids["<|begin_of_text|>"],
        "eos_token_id": [ids["<|end_of_text|>"], ids["<|eot_id|>"]],
        "head_dim": D,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": I,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": NH,
        "num_hidden_layers": L,
        "num_key_value_heads": NKV,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.43.0.dev0",
        "use_cache": True,
        "vocab_size": V,
    }
    gen = {"bos_token_id": ids["<|begin_of_text|>"], "do_sample": True,
           "eos_token_id": [ids["<|end_of_text|>"], ids["<|eot_id|>"]], "temperature": 0.6, "top_p": 0.9,
           "transformers_version": "4.43.0.dev0"}
    r = lambda name, shape, std, mean=0.0: randn(seed, m + "|" + name, shape, std, mean)  # noqa: E731
    w = {"model.embed_tokens.weight": embed_like(seed, m, "embed", V, ntok, H, 1.0)}
    for l in range(L):
        p = "model.layers.%d." % l
        w.update(_attn_weights(r, p, H, NH, NKV, D, False))
        w[p + "mlp.gate_proj.weight"] = r(p + "gate", [I, H], 1.5 / math.sqrt(H))
        w[p + "mlp.up_proj.weight"] = r(p + "up", [I, H], 1.5 / math.sqrt(H))
        w[p + "mlp.down_proj.weight"] = r(p + "down", [H, I], 1.0 / math.sqrt(I))
    w["model.norm.weight"] = r("norm", [H], 0.1, 1.0)
    w["lm_head.weight"] = embed_like(seed, m, "lm_head", V, ntok, H, LM_STD)
    return cfg, gen, w


# ----------------------------------------------------------------------------------------------
# Quantize into stored tensors / dequantize stored tensors back to float32
# ----------------------------------------------------------------------------------------------

NVFP4_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "gate_proj", "up_proj", "down_proj")


def is_nvfp4_linear(name):
    return name.endswith(".weight") and any(name[: -len(".weight")].endswith(s) for s in NVFP4_LINEARS)


def store_gpt_oss(w):
    out = {}
    for name, t in w.items():
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            # The "random BF16 expert weights" are the BF16-rounded floats; quantize those.
            blocks, scales = mxfp4_quantize(bf16(t).to(torch.float32))
            out[name + "_blocks"] = blocks
            out[name + "_scales"] = scales
        else:
            out[name] = bf16(t)
    return out


def store_nvfp4(w, flavour):
    out = {}
    for name, t in w.items():
        if is_nvfp4_linear(name):
            base = name[: -len(".weight")]
            t32 = bf16(t).to(torch.float32)  # quantize the BF16 "original" weights
            if flavour == "modelopt":
                packed, sb, s2 = nvfp4_quantize_modelopt(t32)
                out[base + ".weight"] = packed
                out[base + ".weight_scale"] = sb
                out[base + ".weight_scale_2"] = s2
            else:
                packed, sb, gs = nvfp4_quantize_ct(t32)
                out[base + ".weight_packed"] = packed
                out[base + ".weight_scale"] = sb
                out[base + ".weight_global_scale"] = gs
        else:
            out[name] = bf16(t)
    return out


def dequantize_stored(st):
    """Stored tensors (any of the three formats) -> float32 tensors under the logical checkpoint names."""
    out = {}
    for name, t in st.items():
        if name.endswith("_blocks"):
            base = name[: -len("_blocks")]
            out[base] = mxfp4_dequantize(t, st[base + "_scales"])
        elif name.endswith("_scales") or name.endswith(".input_scale") or name.endswith(".input_global_scale") \
                or name.endswith(".weight_scale") or name.endswith(".weight_scale_2") \
                or name.endswith(".weight_global_scale"):
            continue
        elif name.endswith(".weight_packed"):
            base = name[: -len(".weight_packed")]
            out[base + ".weight"] = nvfp4_dequantize_ct(t, st[base + ".weight_scale"],
                                                        st[base + ".weight_global_scale"])
        elif name.endswith(".weight") and t.dtype == torch.uint8:
            base = name[: -len(".weight")]
            out[name] = nvfp4_dequantize_modelopt(t, st[base + ".weight_scale"], st[base + ".weight_scale_2"])
        else:
            out[name] = t.to(torch.float32)
    return out


# ----------------------------------------------------------------------------------------------
# HF model from dequantized weights
# ----------------------------------------------------------------------------------------------


def hf_state_dict(model_type, cfg, dq):
    """Map logical checkpoint names/layouts to the HF module's parameter names/layouts."""
    sd = {}
    if model_type == "gpt_oss":
        for name, t in dq.items():
            if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
                # checkpoint [E, out, in] -> GptOssExperts parameter [E, in, out] (it computes x @ W[e])
                sd[name] = t.transpose(1, 2).contiguous()
            else:
                sd[name] = t
    elif model_type == "qwen3_moe":
        E = cfg["num_experts"]
        for name, t in dq.items():
            if ".mlp.experts." in name:
                continue
            sd[name] = t
        for l in range(cfg["num_hidden_layers"]):
            p = "model.layers.%d.mlp.experts." % l
            # Qwen3MoeExperts: gate_up_proj [E, 2I, H] = concat(gate, up) rows; down_proj [E, H, I]
            sd[p + "gate_up_proj"] = torch.stack(
                [torch.cat([dq[p + "%d.gate_proj.weight" % e], dq[p + "%d.up_proj.weight" % e]], 0)
                 for e in range(E)])
            sd[p + "down_proj"] = torch.stack([dq[p + "%d.down_proj.weight" % e] for e in range(E)])
    else:
        sd = dict(dq)
    if cfg.get("tie_word_embeddings") and "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd


def build_hf_model(cfg_dict, sd, device):
    from transformers import AutoConfig, AutoModelForCausalLM
    c = {k: v for k, v in cfg_dict.items() if k != "quantization_config"}
    model_type = c.pop("model_type")
    config = AutoConfig.for_model(model_type, **c)
    kw = dict(attn_implementation="eager")
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, experts_implementation="eager", **kw)
    except (TypeError, ValueError):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kw)
    model = model.to(torch.float32)
    own = model.state_dict()
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    if missing or unexpected:
        raise RuntimeError("state dict mismatch: missing %s unexpected %s" % (missing, unexpected))
    for k, v in sd.items():
        if tuple(own[k].shape) != tuple(v.shape):
            raise RuntimeError("shape mismatch for %s: model %s vs ours %s" % (k, tuple(own[k].shape), tuple(v.shape)))
    res = model.load_state_dict(sd, strict=True)
    assert not res.missing_keys and not res.unexpected_keys, res
    if cfg_dict.get("tie_word_embeddings"):
        assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    model.eval()
    return model.to(device), config


# ----------------------------------------------------------------------------------------------
# Calibration (NVFP4 input scales), always on the CPU
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def calibrate_input_amax(model, cfg, tokens):
    """amax of the input of every quantized Linear over the fixed sequence.
    MoE experts: gate/up see the MoE block input; down sees silu(gate)*up of each expert, both taken
    over all tokens (a superset of the routed ones)."""
    amax = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and any(name.endswith(s) for s in NVFP4_LINEARS):
            def pre(mod, args, name=name):
                amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))
            hooks.append(mod.register_forward_pre_hook(pre))
        if cfg["model_type"] == "qwen3_moe" and name.endswith(".mlp") and hasattr(mod, "experts"):
            def pre_moe(mod, args, name=name):
                x = args[0].reshape(-1, args[0].shape[-1])
                ex = mod.experts
                I = ex.gate_up_proj.shape[1] // 2
                for e in range(ex.gate_up_proj.shape[0]):
                    gu = x @ ex.gate_up_proj[e].T
                    act = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
                    base = "%s.experts.%d." % (name, e)
                    amax[base + "gate_proj"] = float(x.abs().max())
                    amax[base + "up_proj"] = float(x.abs().max())
                    amax[base + "down_proj"] = float(act.abs().max())
            hooks.append(mod.register_forward_pre_hook(pre_moe))
    model(torch.tensor([tokens]))
    for h in hooks:
        h.remove()
    return amax


def add_input_scales(st, amax, flavour):
    for name in list(st):
        if flavour == "modelopt" and name.endswith(".weight_scale_2"):
            base = name[: -len(".weight_scale_2")]
            a = pow2_ceil(amax[base])
            st[base + ".input_scale"] = torch.tensor(a / 2688.0, dtype=torch.float32).reshape(())
        if flavour == "ct" and name.endswith(".weight_global_scale"):
            base = name[: -len(".weight_global_scale")]
            a = pow2_ceil(amax[base])
            st[base + ".input_global_scale"] = torch.tensor([2688.0 / a], dtype=torch.float32)


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------


def ordered(st):
    return {k: st[k].contiguous() for k in sorted(st)}


def write_safetensors(mdir, st, shards):
    if shards == 1:
        save_file(ordered(st), os.path.join(mdir, "model.safetensors"), metadata={"format": "pt"})
        return
    # gpt-oss converter naming: model-00000-of-00002.safetensors, ... (numbered from 0)
    def shard_of(name):
        if name.startswith("model.layers."):
            return 0 if int(name.split(".")[2]) < 2 else 1
        return 0 if name.startswith("model.embed_tokens") else 1
    weight_map = {}
    total = 0
    for s in range(shards):
        fname = "model-%05d-of-%05d.safetensors" % (s, shards)
        part = {k: v for k, v in st.items() if shard_of(k) == s}
        save_file(ordered(part), os.path.join(mdir, fname), metadata={"format": "pt"})
        for k, v in part.items():
            weight_map[k] = fname
            total += v.numel() * v.element_size()
    dump_json(os.path.join(mdir, "model.safetensors.index.json"),
              {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})


def read_safetensors(mdir):
    idx = os.path.join(mdir, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    st = {}
    for fn in files:
        st.update(load_file(os.path.join(mdir, fn)))
    return st


def tokenizer_config(family, ids):
    if family == "gpt_oss":
        return {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>",
                "clean_up_tokenization_spaces": False, "model_max_length": 131072,
                "tokenizer_class": "PreTrainedTokenizerFast"}
    if family == "qwen3":
        return {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                "clean_up_tokenization_spaces": False, "model_max_length": 131072, "split_special_tokens": False,
                "tokenizer_class": "PreTrainedTokenizerFast"}
    return {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "clean_up_tokenization_spaces": True,
            "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast"}


# ----------------------------------------------------------------------------------------------
# References
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def logits_of(model, ids, device):
    out = model(input_ids=torch.tensor([ids], device=device), use_cache=False)
    return out.logits[0].to("cpu", torch.float32)


@torch.no_grad()
def reference(model, tokens, device):
    logits = logits_of(model, tokens, device)  # [T, V]
    logp = torch.log_softmax(logits.double(), dim=-1)
    nll = [float(-logp[i, tokens[i + 1]]) for i in range(len(tokens) - 1)]
    top = torch.topk(logits[-1], 5)
    top5 = [[int(i), round(float(v), 6)] for v, i in zip(top.values, top.indices)]
    # Greedy continuation, full recompute every step (no KV cache).
    seq = list(tokens[:PROMPT_LEN])
    gids, margins = [], []
    for _ in range(GEN_LEN):
        lg = logits_of(model, seq, device)[-1]
        t2 = torch.topk(lg, 2)
        nxt = int(t2.indices[0])
        gids.append(nxt)
        margins.append(round(float(t2.values[0] - t2.values[1]), 6))
        seq.append(nxt)
    return logits, nll, top5, gids, margins


@torch.no_grad()
def hf_generate_check(model, prompt, n, device):
    try:
        out = model.generate(torch.tensor([prompt], device=device), max_new_tokens=n, do_sample=False,
                             min_new_tokens=n, pad_token_id=0, eos_token_id=None)
        return [int(x) for x in out[0, len(prompt):].tolist()]
    except Exception as e:  # noqa: BLE001
        print("  note: HF generate() failed: %r" % (e,))
        return None


def router_min_gap(model, seqs, device):
    """Smallest gap between the k-th and (k+1)-th router logit over all tokens and layers (a near-tie
    could flip an engine's expert choice)."""
    gaps = []
    hooks = []
    for name, mod in model.named_modules():
        if type(mod).__name__ in ("GptOssTopKRouter", "Qwen3MoeTopKRouter"):
            def post(mod, args, out):
                lg = out[0].float()
                k = mod.top_k
                s = torch.sort(lg, dim=-1, descending=True).values
                gaps.append(float((s[:, k - 1] - s[:, k]).min()))
            hooks.append(mod.register_forward_hook(post))
    with torch.no_grad():
        for tokens in seqs:
            model(input_ids=torch.tensor([tokens], device=device), use_cache=False)
    for h in hooks:
        h.remove()
    return min(gaps) if gaps else None


def mxfp4_cross_check(mdir, dq, cfg):
    """Load the written checkpoint with transformers' own MXFP4 path (dequantize=True, CPU) and compare
    its expert weights with ours."""
    try:
        from transformers import AutoModelForCausalLM, Mxfp4Config
        m = AutoModelForCausalLM.from_pretrained(mdir, quantization_config=Mxfp4Config(dequantize=True),
                                                 dtype=torch.float32)
    except Exception as e:  # noqa: BLE001
        msg = "transformers MXFP4 load failed: %r" % (e,)
        print("  note: " + msg)
        return {"ok": None, "note": msg}
    worst = 0.0
    for l in range(cfg["num_hidden_layers"]):
        ex = m.model.layers[l].mlp.experts
        p = "model.layers.%d.mlp.experts." % l
        for nm in ("gate_up_proj", "down_proj"):
            theirs = getattr(ex, nm).detach().to(torch.float32)
            ours = dq[p + nm]  # [E, out, in]
            if tuple(theirs.shape) == tuple(ours.transpose(1, 2).shape):
                ours = ours.transpose(1, 2)
            if tuple(theirs.shape) != tuple(ours.shape):
                msg = "shape mismatch %s: %s vs %s" % (nm, tuple(theirs.shape), tuple(ours.shape))
                print("  MXFP4 cross-check: " + msg)
                return {"ok": False, "note": msg}
            worst = max(worst, float((theirs - ours).abs().max()))
            for b in ("_bias",):
                tb = getattr(ex, nm + b).detach().to(torch.float32)
                worst = max(worst, float((tb - dq[p + nm + b]).abs().max()))
    note = "transformers Mxfp4Config(dequantize=True) expert weights vs ours: max abs diff %g" % worst
    print("  MXFP4 cross-check: " + note)
    return {"ok": worst == 0.0, "note": note, "model": m}


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------

MAX_VARIANTS = 64
MIN_ROUTER_GAP = 0.003  # smallest allowed gap between the k-th and (k+1)-th router logit
MIN_MARGIN = 0.05  # greedy steps before the first step with a top-2 margin below this ...
MIN_CLEAN_STEPS = 12  # ... must be at least this many


def greedy_cpu(model, prompt, n):
    seq = list(prompt)
    margins = []
    for _ in range(n):
        lg = logits_of(model, seq, "cpu")[-1]
        t2 = torch.topk(lg, 2)
        margins.append(float(t2.values[0] - t2.values[1]))
        seq.append(int(t2.indices[0]))
    return seq[len(prompt):], margins


def candidate_ok(model, tokens):
    """Quality checks on the CPU float32 model (so that the choice does not depend on the device):
    greedy margins not tiny for the first MIN_CLEAN_STEPS steps, and no near-tie in MoE routing on
    the reference sequence or the greedy continuation (an engine could pick another expert)."""
    gids, margins = greedy_cpu(model, tokens[:PROMPT_LEN], GEN_LEN)
    clean = next((i for i, m in enumerate(margins) if m < MIN_MARGIN), GEN_LEN)
    gap = router_min_gap(model, [tokens, tokens[:PROMPT_LEN] + gids[:-1]], "cpu")
    ok = clean >= MIN_CLEAN_STEPS and (gap is None or gap >= MIN_ROUTER_GAP)
    return ok, "steps before margin<%g: %d, min router gap: %s -> %s" % (
        MIN_MARGIN, clean, "-" if gap is None else "%.4g" % gap, "ok" if ok else "rejected")


@torch.no_grad()
def bf16_residual_sensitivity(model, tokens):
    """max |change of NLL| when the residual stream is rounded to BF16 after every layer: a rough
    measure of how much slack the 0.02 NLL tolerance leaves (informative only)."""
    def nll_of(lg):
        lp = torch.log_softmax(lg.double(), -1)
        return torch.stack([-lp[i, tokens[i + 1]] for i in range(len(tokens) - 1)])
    n0 = nll_of(logits_of(model, tokens, "cpu"))
    hooks = [l.register_forward_hook(
        lambda mod, a, o: (o[0].bfloat16().float(),) + tuple(o[1:]) if isinstance(o, tuple) else o.bfloat16().float())
        for l in model.model.layers]
    n1 = nll_of(logits_of(model, tokens, "cpu"))
    for h in hooks:
        h.remove()
    return float((n1 - n0).abs().max())


MODELS = [
    # dir name, family, spec fn, storage, shards
    ("gpt_oss_mxfp4", "gpt_oss", spec_gpt_oss, "mxfp4", 2),
    ("qwen3_moe_nvfp4_modelopt", "qwen3", spec_qwen3_moe, "modelopt", 1),
    ("qwen3_nvfp4_ct", "qwen3", spec_qwen3_dense, "ct", 1),
    ("llama_bf16", "llama3", spec_llama, "bf16", 1),
]


def passage_tokens(base_tok):
    with open(CORPUS, encoding="utf-8") as f:
        text = f.read()
    start = text.index(PASSAGE_ANCHOR) + 1
    passage = text[start:start + PASSAGE_CHARS]
    ids = base_tok.encode(passage).ids
    assert len(ids) >= SEQ_LEN, len(ids)
    return passage, start, ids[:SEQ_LEN]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(REPO, "tests", "data", "models"))
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-tokenizer", action="store_true",
                    help="re-train tools/reference/data/base_tokenizer.json from data/tinyshakespeare.txt and exit")
    ap.add_argument("--only", default=None, help="comma-separated model dir names (default: all)")
    args = ap.parse_args()

    if args.train_tokenizer:
        a = train_base_tokenizer()
        b = train_base_tokenizer()
        assert a == b, "BPE training is not deterministic"
        os.makedirs(os.path.dirname(BASE_TOKENIZER), exist_ok=True)
        dump_json(BASE_TOKENIZER, a)
        print("wrote", BASE_TOKENIZER)
        return

    if args.device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        device = args.device
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    dev_name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"

    with open(BASE_TOKENIZER, encoding="utf-8") as f:
        base_json = json.load(f)
    base_tok = Tokenizer.from_str(json.dumps(base_json))
    passage, start, tokens = passage_tokens(base_tok)

    os.makedirs(args.out, exist_ok=True)
    summary = []
    for mname, family, spec, storage, shards in MODELS:
        if args.only and mname not in args.only.split(","):
            continue
        print("== %s" % mname)
        tj, ids, ntok = family_tokenizer_json(base_json, family)
        mdir = os.path.join(args.out, mname)
        if os.path.isdir(mdir):
            shutil.rmtree(mdir)
        os.makedirs(mdir)

        # --- weights: draw variant 0, 1, ... until the CPU float32 model passes the quality checks
        for variant in range(MAX_VARIANTS):
            seed = str(args.seed) if variant == 0 else "%d.v%d" % (args.seed, variant)
            cfg, gen, w = spec(seed, ntok, ids)
            if storage == "mxfp4":
                st = store_gpt_oss(w)
            elif storage in ("modelopt", "ct"):
                st = store_nvfp4(w, storage)
            else:
                st = {k: bf16(v) for k, v in w.items()}
            cpu_model, _ = build_hf_model(cfg, hf_state_dict(cfg["model_type"], cfg, dequantize_stored(st)), "cpu")
            ok, why = candidate_ok(cpu_model, tokens)
            print("  variant %d: %s" % (variant, why))
            if ok:
                break
        else:
            raise RuntimeError("no variant passed the quality checks")
        if storage in ("modelopt", "ct"):
            # calibrate the static activation scales on the CPU with the dequantized weights
            add_input_scales(st, calibrate_input_amax(cpu_model, cfg, tokens), storage)
        bf16_sens = bf16_residual_sensitivity(cpu_model, tokens)
        del cpu_model

        # --- config + tokenizer files
        if storage == "ct":
            cfg["quantization_config"] = {
                "config_groups": {"group_0": {
                    "input_activations": {"dynamic": "local", "group_size": 16, "num_bits": 4,
                                          "strategy": "tensor_group", "symmetric": True, "type": "float"},
                    "targets": ["Linear"],
                    "weights": {"dynamic": False, "group_size": 16, "num_bits": 4, "strategy": "tensor_group",
                                "symmetric": True, "type": "float"}}},
                "format": "nvfp4-pack-quantized",
                "ignore": ["lm_head"],
                "quant_method": "compressed-tensors",
                "quantization_status": "compressed",
            }
        if storage == "modelopt":
            dump_json(os.path.join(mdir, "hf_quant_config.json"), {
                "producer": {"name": "modelopt", "version": "0.29.0"},
                "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                 "exclude_modules": ["lm_head", "model.layers.*.mlp.gate"]}})
        dump_json(os.path.join(mdir, "config.json"), cfg)
        dump_json(os.path.join(mdir, "generation_config.json"), gen)
        dump_json(os.path.join(mdir, "tokenizer.json"), tj)
        dump_json(os.path.join(mdir, "tokenizer_config.json"), tokenizer_config(family, ids))
        write_safetensors(mdir, st, shards)

        # --- read back, dequantize, check round trip
        st2 = read_safetensors(mdir)
        assert sorted(st2) == sorted(st)
        for k in st:
            assert st2[k].dtype == st[k].dtype and torch.equal(st2[k].view(torch.uint8) if st[k].dim() else st2[k],
                                                               st[k].view(torch.uint8) if st[k].dim() else st[k]), k
        dq = dequantize_stored(st2)
        # sanity: the dequantized weights are close to the originals
        for k, v in dq.items():
            ref = w[k]
            rel = float((v - ref).norm() / ref.norm().clamp_min(1e-30))
            quantized = k not in st or st[k].dtype == torch.uint8
            assert rel < (0.2 if quantized else 0.01), (k, rel)

        # tokenizer sanity: same ids as the base tokenizer for plain text, specials are single tokens
        ftok = Tokenizer.from_file(os.path.join(mdir, "tokenizer.json"))
        assert ftok.encode(passage, add_special_tokens=False).ids[:SEQ_LEN] == tokens
        for s, i in ids.items():
            assert ftok.encode(s, add_special_tokens=False).ids == [i], s
        assert ftok.get_vocab_size() == ntok <= cfg["vocab_size"]

        # --- reference
        model, hfcfg = build_hf_model(cfg, hf_state_dict(cfg["model_type"], cfg, dq), device)
        if cfg["model_type"] == "gpt_oss":
            rp = hfcfg.rope_parameters
            assert rp["rope_type"] == "yarn" and rp["factor"] == 32.0 and rp["truncate"] is False \
                and rp["original_max_position_embeddings"] == 4096 and rp["rope_theta"] == 150000, rp
            assert hfcfg.num_experts_per_tok == 2 and hfcfg.sliding_window == 8
            assert hfcfg.layer_types[0] == "sliding_attention"
        if cfg["model_type"] == "llama":
            assert hfcfg.rope_parameters["rope_type"] == "llama3", hfcfg.rope_parameters
        if cfg["model_type"] == "qwen3_moe":
            assert hfcfg.head_dim == 32 and hfcfg.norm_topk_prob
        logits, nll, top5, gids, margins = reference(model, tokens, device)
        gen_ids = hf_generate_check(model, tokens[:PROMPT_LEN], GEN_LEN, device)
        router_gap = router_min_gap(model, [tokens, tokens[:PROMPT_LEN] + gids[:-1]], device)

        extra = {}
        if cfg["model_type"] == "gpt_oss":
            xc = mxfp4_cross_check(mdir, dq, cfg)
            extra["mxfp4_cross_check"] = {"ok": xc["ok"], "note": xc["note"]}
            if xc.get("model") is not None:
                try:
                    # transformers dequantizes MXFP4 to BF16 parameters and may pick a BF16 grouped_mm
                    # experts kernel: make that model float32 + eager like ours before comparing logits.
                    xm = xc["model"].to(torch.float32).eval()
                    try:
                        xm.set_experts_implementation("eager")
                    except Exception:  # noqa: BLE001
                        pass
                    lg2 = logits_of(xm, tokens, "cpu")
                    d = float((lg2 - logits.cpu()).abs().max())
                    extra["mxfp4_cross_check"]["note"] += "; full logits via that model vs ours: max abs diff %.3g" % d
                    print("  MXFP4 path logits vs reference: max abs diff %.3g" % d)
                except Exception as e:  # noqa: BLE001
                    print("  note: forward through the transformers MXFP4 model failed: %r" % (e,))
                del xc["model"]

        ref = {
            "model": mname,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "tokenizers": tokenizers.__version__,
            "device": dev_name,
            "dtype": "float32",
            "hf_class": type(model).__name__,
            "passage": {"file": "data/tinyshakespeare.txt", "char_offset": start, "chars": PASSAGE_CHARS},
            "tokens": tokens,
            "nll": [round(x, 6) for x in nll],
            "nll_mean": round(sum(nll) / len(nll), 6),
            "greedy": {"prompt": tokens[:PROMPT_LEN], "ids": gids, "margins": margins},
            "last_logits_top5": top5,
            "weights_variant": variant,
            "nll_max_change_if_residual_rounded_to_bf16": round(bf16_sens, 4),
        }
        if gen_ids is not None:
            ref["greedy"]["hf_generate_kv_cache_ids_equal"] = gen_ids == gids
        if router_gap is not None:
            ref["min_router_topk_gap"] = round(router_gap, 6)
        ref.update(extra)
        with open(os.path.join(mdir, "reference.json"), "w", encoding="utf-8") as f:
            f.write("{\n" + ",\n".join(" %s: %s" % (json.dumps(k), json.dumps(v)) for k, v in ref.items()) + "\n}\n")
        del model

        srt = sorted(margins)
        first_small = next((i for i, mg in enumerate(margins) if mg < 0.05), None)
        size = sum(os.path.getsize(os.path.join(mdir, f)) for f in os.listdir(mdir))
        summary.append((mname, len(nll), sum(nll) / len(nll), min(nll), max(nll), srt[0], srt[len(srt) // 2],
                        first_small, gen_ids == gids if gen_ids is not None else None, router_gap, size))

    print()
    print("%-26s %4s %8s %8s %8s %9s %9s %7s %6s %9s %9s" % (
        "model", "nll#", "nll_mean", "nll_min", "nll_max", "marg_min", "marg_med", "1st<.05", "kv=ok", "rt_gap",
        "bytes"))
    for row in summary:
        print("%-26s %4d %8.4f %8.4f %8.4f %9.4f %9.4f %7s %6s %9s %9d" % (
            row[0], row[1], row[2], row[3], row[4], row[5], row[6], row[7], row[8],
            "-" if row[9] is None else "%.4f" % row[9], row[10]))
    print("transformers %s, torch %s, device %s" % (transformers.__version__, torch.__version__, dev_name))


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Trains nibble's bundled demo models on the tinyshakespeare corpus (data/tinyshakespeare.txt).

Usage (GPU machine: torch + transformers 5.x + tokenizers; a CPU works for a smoke test):
    python3 tools/train_demo/train.py --out /tmp/demo [--family gpt_oss,qwen3] [--seconds 170]
        [--max-steps N] [--device auto|cpu|cuda] [--seed 0]

Writes, per family, a standard HF checkpoint directory OUT/<family>-demo-bf16/ with config.json,
model.safetensors (BF16), generation_config.json, tokenizer.json, tokenizer_config.json and
train_log.json (steps, wall time, validation curve, held-out loss), plus OUT/heldout.txt (the last 10 %
of the corpus, the evaluation text of docs/quality.md).

Data split (by characters, cut at a line start):
  [0, 85 %)   training text
  [85, 90 %)  validation text: picks the checkpoint (best validation loss) and stops over-fitting
  [90, 100 %) held-out text: never seen by the tokenizer trainer, the optimiser or the checkpoint
              choice; only reported (and evaluated by `nibble eval`).
The byte-level BPE tokenizer (2000 tokens + the family's special tokens) is trained on the first 90 %.

Models (from config dicts, random init, trained from scratch for a bounded wall time, bf16 autocast,
AdamW, linear warm-up then cosine decay over the time budget):
  gpt_oss: d_model 256, 4 layers (sliding 128 / full alternating), 4 query heads x 64, 2 KV heads,
           attention sinks, 8 experts top-2, expert intermediate 256, YaRN RoPE as gpt-oss.
  qwen3:   d_model 256, 4 layers, 4 query heads x 64, 2 KV heads, QK-norm, d_ff 768, tied embeddings.
"""

import argparse
import json
import math
import os
import random
import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
CORPUS = os.path.join(REPO, "data", "tinyshakespeare.txt")

BASE_VOCAB = 2000
SEQ_LEN = 256
SPECIALS = {  # appended after the BPE vocabulary, as in tools/reference/make_goldens.py
    "gpt_oss": ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>",
                "<|start|>", "<|end|>", "<|message|>", "<|call|>"],
    "qwen3": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
              "</tool_call>"],
}


def split_corpus(text):
    """Character split points at line starts: train [0, a), validation [a, b), held-out [b, end)."""
    def at_line(frac):
        i = int(len(text) * frac)
        return text.index("\n", i) + 1
    a, b = at_line(0.85), at_line(0.90)
    return text[:a], text[a:b], text[b:]


def train_tokenizer(text):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BASE_VOCAB, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator([text], trainer)
    assert tok.get_vocab_size() == BASE_VOCAB, tok.get_vocab_size()
    return json.loads(tok.to_str())


def family_tokenizer(base, family):
    tj = json.loads(json.dumps(base))
    n = len(tj["model"]["vocab"])
    specials = SPECIALS[family]
    tj["added_tokens"] = [{"id": n + i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                           "normalized": False, "special": True} for i, s in enumerate(specials)]
    return tj, {s: n + i for i, s in enumerate(specials)}, n + len(specials)


def tokenizer_config(family, ids):
    if family == "gpt_oss":
        return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>",
                "eos_token": "<|return|>", "pad_token": "<|endoftext|>", "model_max_length": 4096}
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>", "model_max_length": 4096}


def padded(n, mult=64):
    return (n + mult - 1) // mult * mult


def config_gpt_oss(ids, ntok):
    L = 4
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "vocab_size": padded(ntok), "hidden_size": 256, "num_hidden_layers": L,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "intermediate_size": 256, "num_local_experts": 8, "num_experts_per_tok": 2, "experts_per_token": 2,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)],
        "sliding_window": 128, "attention_bias": True, "attention_dropout": 0.0,
        "hidden_act": "silu", "swiglu_limit": 7.0, "rms_norm_eps": 1e-5,
        "rope_theta": 150000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 4096, "truncate": False},
        "initial_context_length": 4096, "max_position_embeddings": 4096,
        "router_aux_loss_coef": 0.02, "output_router_logits": True,
        "tie_word_embeddings": False, "initializer_range": 0.02, "use_cache": True,
        "eos_token_id": ids["<|return|>"], "pad_token_id": ids["<|endoftext|>"],
        "bos_token_id": ids["<|startoftext|>"],
    }


def config_qwen3(ids, ntok):
    L = 4
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": padded(ntok), "hidden_size": 256, "num_hidden_layers": L,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 768,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 4096,
        "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
        "max_window_layers": L, "tie_word_embeddings": True, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }


def generation_config(family, ids):
    if family == "gpt_oss":
        return {"bos_token_id": ids["<|startoftext|>"],
                "eos_token_id": [ids["<|return|>"], ids["<|endoftext|>"], ids["<|call|>"]],
                "pad_token_id": ids["<|endoftext|>"], "do_sample": True}
    return {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
            "pad_token_id": ids["<|endoftext|>"], "do_sample": True, "temperature": 0.8}


def build_model(cfg, device):
    from transformers import AutoConfig, AutoModelForCausalLM
    c = dict(cfg)
    model_type = c.pop("model_type")
    config = AutoConfig.for_model(model_type, **c)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    return model.to(device)


@torch.no_grad()
def mean_loss(model, ids, device, batch=32):
    """Mean next-token NLL over non-overlapping SEQ_LEN windows (each window's first token predicts
    nothing from before it, as `nibble eval --seq-len SEQ_LEN` does)."""
    model.eval()
    n = len(ids) // SEQ_LEN * SEQ_LEN
    x = torch.tensor(ids[:n], dtype=torch.long).view(-1, SEQ_LEN)
    tot, cnt = 0.0, 0
    for i in range(0, x.shape[0], batch):
        xb = x[i:i + batch].to(device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=xb).logits.float()
        lp = torch.log_softmax(logits[:, :-1], dim=-1)
        nll = -lp.gather(-1, xb[:, 1:, None]).squeeze(-1)
        tot += nll.sum().item()
        cnt += nll.numel()
    model.train()
    return tot / cnt


def train_one(family, base_tok, texts, out_dir, args, device):
    from safetensors.torch import save_file
    train_text, val_text, held_text = texts
    tj, ids, ntok = family_tokenizer(base_tok, family)
    tok = Tokenizer.from_str(json.dumps(tj))
    enc = lambda t: tok.encode(t, add_special_tokens=False).ids  # noqa: E731
    train_ids, val_ids, held_ids = enc(train_text), enc(val_text), enc(held_text)
    cfg = config_gpt_oss(ids, ntok) if family == "gpt_oss" else config_qwen3(ids, ntok)
    torch.manual_seed(args.seed)
    model = build_model(cfg, device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[{family}] {n_params / 1e6:.2f} M parameters; tokens train {len(train_ids)} val {len(val_ids)} "
          f"held-out {len(held_ids)}", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    data = torch.tensor(train_ids, dtype=torch.long)
    rng = random.Random(args.seed)
    warmup = 100
    t0 = time.time()
    step, best, best_state, curve = 0, float("inf"), None, []
    while True:
        elapsed = time.time() - t0
        if elapsed >= args.seconds or (args.max_steps and step >= args.max_steps):
            break
        frac = min(1.0, elapsed / args.seconds)
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = [rng.randrange(0, len(data) - SEQ_LEN - 1) for _ in range(args.batch)]
        xb = torch.stack([data[s:s + SEQ_LEN] for s in starts]).to(device, non_blocking=True)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(input_ids=xb, labels=xb)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % args.eval_every == 0 or (args.max_steps and step == args.max_steps):
            v = mean_loss(model, val_ids, device)
            curve.append({"step": step, "seconds": round(time.time() - t0, 1), "train_loss": round(out.loss.item(), 4),
                          "val_loss": round(v, 4)})
            print(f"[{family}] step {step} {time.time() - t0:.0f}s train {out.loss.item():.3f} val {v:.3f} "
                  f"lr {lr:.2e}", flush=True)
            if v < best:
                best = v
                best_state = {k: t.detach().to("cpu", copy=True) for k, t in model.state_dict().items()}
    if best_state is not None:
        model.load_state_dict(best_state)
    model.config.output_router_logits = False
    held = mean_loss(model, held_ids, device)
    print(f"[{family}] best val {best:.4f}; held-out loss {held:.4f} (ppl {math.exp(held):.2f}) "
          f"after {step} steps", flush=True)

    os.makedirs(out_dir, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out_dir)
    # Our own config.json (the classic dialect, as written above) next to HF's save, and a single
    # model.safetensors with plain BF16 tensors; drop HF's own variants.
    sd = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    for f in os.listdir(out_dir):
        if f.endswith(".safetensors") or f.endswith(".index.json"):
            os.remove(os.path.join(out_dir, f))
    save_file(sd, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    final_cfg = dict(cfg, torch_dtype="bfloat16", output_router_logits=False) if family == "gpt_oss" \
        else dict(cfg, torch_dtype="bfloat16")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(final_cfg, f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(generation_config(family, ids), f, indent=2)
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tj, f, ensure_ascii=False)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config(family, ids), f, indent=2)
    with open(os.path.join(out_dir, "train_log.json"), "w") as f:
        json.dump({"family": family, "parameters": n_params, "steps": step, "seconds": args.seconds,
                   "batch": args.batch, "seq_len": SEQ_LEN, "lr": args.lr, "seed": args.seed,
                   "device": str(device), "torch": torch.__version__,
                   "tokens": {"train": len(train_ids), "val": len(val_ids), "heldout": len(held_ids)},
                   "best_val_loss": best, "heldout_loss": held, "curve": curve}, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--family", default="gpt_oss,qwen3")
    ap.add_argument("--seconds", type=float, default=170.0, help="wall-time budget per model")
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    with open(CORPUS, encoding="utf-8") as f:
        text = f.read()
    texts = split_corpus(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "heldout.txt"), "w", encoding="utf-8") as f:
        f.write(texts[2])
    base = train_tokenizer(texts[0] + texts[1])
    for family in args.family.split(","):
        train_one(family, base, texts, os.path.join(args.out, family.replace("_", "-") + "-demo-bf16"), args, device)


if __name__ == "__main__":
    main()

"""Check real_qkv's capture against what the model itself computed.

For every layer: softmax(q·kᵀ·scale)·v in float64 from the captured tensors (causal mask and GQA head
sharing as the model has them) against the attention output the model fed its output projection,
taken by a separate forward pre-hook (Llama's ``o_proj``) or forward hook (BERT's ``attention.self``).
Also: the model's final hidden states with the capture on equal those with stock ``sdpa`` attention.

    python experiments/fp4_accuracy/check_real_qkv.py [--model smollm2|minilm] [--max-tokens 512]
"""

from __future__ import annotations

import argparse
import time

import torch

import real_qkv


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """float64 softmax(q·kᵀ·scale)·v: q [B, H, N, D], k/v [B, Hkv, N, D] → [B, N, H·D], o_proj's input."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    o = s.softmax(-1) @ v
    return o.transpose(1, 2).flatten(2)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2", choices=sorted(real_qkv._MODELS))
    p.add_argument("--max-tokens", type=int, default=512)
    a = p.parse_args()

    info = real_qkv.model_info(a.model)
    _, net, _ = real_qkv._load(a.model)
    outputs, last = {}, {}

    def keep_input(name):
        return lambda mod, args: outputs.__setitem__(name, args[0].detach().double().clone())

    def keep_output(name):
        return lambda mod, args, out: outputs.__setitem__(name, out[0].detach().double().clone())

    def keep_last(mod, args, out):
        last["h"] = out[0].detach().clone()

    # The attention output before the output projection, taken independently of the capture.
    handles = [net.base_model.register_forward_hook(keep_last)]
    for name, mod in net.named_modules():
        if name.endswith("self_attn"):  # Llama: o_proj's input
            handles.append(mod.o_proj.register_forward_pre_hook(keep_input(name)))
        elif name.endswith("attention.self"):  # BERT: BertSelfAttention returns it before BertSelfOutput
            handles.append(mod.register_forward_hook(keep_output(name)))
    try:
        t0 = time.perf_counter()
        layers = real_qkv.capture_qkv(a.max_tokens, model=a.model)
        t1 = time.perf_counter()
        captured_last = last["h"]
        net.set_attn_implementation("sdpa")  # stock attention, same input
        try:
            stock = real_qkv.capture_qkv(a.max_tokens, model=a.model)
        finally:
            net.set_attn_implementation(real_qkv._IMPL)
    finally:
        for h in handles:
            h.remove()

    print(info)
    print(f"capture of {len(layers)} layers: {t1 - t0:.1f} s")
    worst = 0.0
    for name, q, k, v in layers:
        got = outputs[name]
        ref = reference(q, k, v, info["scale"], info["causal"])
        diff = (ref - got).abs().max().item()
        worst = max(worst, diff)
        print(f"{name:30s} max|ref64 - model| {diff:.3e}   (|model out| max {got.abs().max():.3f})")
    assert stock == [], "the stock run went through the capture"
    same = torch.equal(captured_last, last["h"])
    print(f"worst {worst:.3e}; final hidden states with capture == stock sdpa: {same}")
    assert same and worst < 1e-3, "capture does not match the model"


if __name__ == "__main__":
    main()

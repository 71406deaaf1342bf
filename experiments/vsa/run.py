"""A small video denoiser (DiT-like) trained with dense attention vs video sparse attention (VSA).

Data: synthetic videos of bouncing Gaussian blobs (deterministic, seeded), T frames of S×S pixels cut
into P×P patches: a (T, S/P, S/P) token grid, one token = one patch vector of P·P values. Task:
diffusion-style denoising — x_t = sqrt(a)·x0 + sqrt(1-a)·eps with a random noise level a per video;
the model gets x_t and the noise level and predicts eps (MSE loss).

Variants (only the attention function differs; same seed, same initial weights, same batches):

* ``dense``        — ``F.scaled_dot_product_attention`` (non-causal);
* ``vsa_<pct>``    — ``lowbit_attn.video_sparse_attention`` with ``topk`` = pct % of the tiles, a learned
  per-head, per-channel ``gate_coarse`` initialised to 0 and ``gate_fine=None`` (fine output taken as
  is). At step 0 a VSA model thus computes fine-stage attention only.

Usage::

    python experiments/vsa/run.py                      # CPU scale (see README for the wall time)
    python experiments/vsa/run.py --steps 20 --variants dense vsa_25   # quick check
    python experiments/vsa/plot.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import lowbit_attn
from lowbit_attn.vsa.tiles import tile_layout

HERE = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------------------------- data
def make_videos(gen: torch.Generator, n: int, frames: int, size: int, blobs: int) -> torch.Tensor:
    """``[n, frames, size, size]`` videos of ``blobs`` Gaussian blobs bouncing off the walls."""
    pos = torch.rand(n, blobs, 2, generator=gen) * (size - 1)
    vel = (torch.rand(n, blobs, 2, generator=gen) * 2 - 1) * size / 8          # up to size/8 px/frame
    sigma = 1.0 + torch.rand(n, blobs, 1, generator=gen) * size / 10
    amp = 0.5 + torch.rand(n, blobs, 1, generator=gen)
    amp = amp * torch.where(torch.rand(n, blobs, 1, generator=gen) < 0.5, -1.0, 1.0)
    yy, xx = torch.meshgrid(torch.arange(size, dtype=torch.float32),
                            torch.arange(size, dtype=torch.float32), indexing="ij")
    grid = torch.stack([yy, xx], -1).reshape(1, 1, size * size, 2)
    out = []
    for _ in range(frames):
        d2 = ((grid - pos.unsqueeze(2)) ** 2).sum(-1)                          # [n, blobs, S*S]
        out.append((amp * torch.exp(-d2 / (2 * sigma ** 2))).sum(1).reshape(n, size, size))
        pos = pos + vel
        lo, hi = pos < 0, pos > size - 1                                        # bounce
        pos = torch.where(lo, -pos, torch.where(hi, 2 * (size - 1) - pos, pos))
        vel = torch.where(lo | hi, -vel, vel)
    return torch.stack(out, 1)


def patchify(v: torch.Tensor, p: int) -> torch.Tensor:
    """``[n, T, S, S]`` → ``[n, T·(S/p)·(S/p), p·p]`` in row-major (T, H, W) token order."""
    n, t, s, _ = v.shape
    h = s // p
    return v.reshape(n, t, h, p, h, p).permute(0, 1, 2, 4, 3, 5).reshape(n, t * h * h, p * p)


def noisy_batch(gen: torch.Generator, x0: torch.Tensor):
    """Noise levels a ~ U(0.02, 0.98) (signal fraction), eps ~ N(0, 1); returns (x_t, a, eps)."""
    a = 0.02 + 0.96 * torch.rand(x0.shape[0], generator=gen)
    eps = torch.randn(x0.shape, generator=gen)
    s = a.view(-1, 1, 1)
    return s.sqrt() * x0 + (1 - s).sqrt() * eps, a, eps


def batch_for(step: int, cfg: dict, seed: int):
    """The training batch of ``step``: the same for every variant (generator seeded by step)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    v = make_videos(gen, cfg["batch"], cfg["frames"], cfg["size"], cfg["blobs"])
    return noisy_batch(gen, patchify(v, cfg["patch"]))


def val_set(cfg: dict, seed: int):
    gen = torch.Generator().manual_seed(10_000_000 + seed)                     # disjoint from training
    v = make_videos(gen, cfg["val_videos"], cfg["frames"], cfg["size"], cfg["blobs"])
    return noisy_batch(gen, patchify(v, cfg["patch"]))


# ---------------------------------------------------------------------------------------------- model
class Attention(nn.Module):
    def __init__(self, width: int, heads: int, variant: str, video_shape, tile):
        super().__init__()
        self.heads, self.hd = heads, width // heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.variant, self.video_shape, self.tile = variant, video_shape, tile
        if variant != "dense":
            self.topk = float(variant.split("_")[1]) / 100
            self.gate_coarse = nn.Parameter(torch.zeros(1, heads, 1, self.hd))  # per head, per channel

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        if self.variant == "dense":
            o = F.scaled_dot_product_attention(q, k, v)
        else:
            o = lowbit_attn.video_sparse_attention(
                q, k, v, video_shape=self.video_shape, tile=self.tile, topk=self.topk,
                gate_coarse=self.gate_coarse, gate_fine=None)
        return self.proj(o.transpose(1, 2).reshape(b, n, -1))


class Block(nn.Module):
    """Pre-norm transformer block with adaLN-style modulation by the noise-level embedding."""

    def __init__(self, width, heads, variant, video_shape, tile):
        super().__init__()
        self.n1 = nn.LayerNorm(width, elementwise_affine=False)
        self.n2 = nn.LayerNorm(width, elementwise_affine=False)
        self.attn = Attention(width, heads, variant, video_shape, tile)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.mod = nn.Linear(width, 4 * width)
        nn.init.zeros_(self.mod.weight), nn.init.zeros_(self.mod.bias)

    def forward(self, x, c):
        s1, g1, s2, g2 = self.mod(c).unsqueeze(1).chunk(4, -1)
        x = x + (1 + g1) * self.attn(self.n1(x) * (1 + s1))
        return x + (1 + g2) * self.mlp(self.n2(x) * (1 + s2))


class Denoiser(nn.Module):
    def __init__(self, cfg: dict, variant: str):
        super().__init__()
        w, t, h = cfg["width"], cfg["frames"], cfg["size"] // cfg["patch"]
        video_shape = (t, h, h)
        self.inp = nn.Linear(cfg["patch"] ** 2, w)
        self.pos_t = nn.Parameter(torch.randn(t, 1, 1, w) * 0.02)               # factorised 3D position
        self.pos_h = nn.Parameter(torch.randn(1, h, 1, w) * 0.02)
        self.pos_w = nn.Parameter(torch.randn(1, 1, h, w) * 0.02)
        self.noise = nn.Sequential(nn.Linear(1, w), nn.SiLU(), nn.Linear(w, w))
        self.blocks = nn.ModuleList(Block(w, cfg["heads"], variant, video_shape, tuple(cfg["tile"]))
                                    for _ in range(cfg["layers"]))
        self.norm = nn.LayerNorm(w)
        self.out = nn.Linear(w, cfg["patch"] ** 2)

    def forward(self, x, a):
        pos = (self.pos_t + self.pos_h + self.pos_w).reshape(1, -1, self.inp.out_features)
        h = self.inp(x) + pos
        c = self.noise(torch.log(a / (1 - a)).unsqueeze(-1))                   # log-SNR embedding
        for blk in self.blocks:
            h = blk(h, c)
        return self.out(self.norm(h))


# ------------------------------------------------------------------------------------------- training
def lr_at(step: int, cfg: dict) -> float:
    if step < cfg["warmup"]:
        return cfg["lr"] * (step + 1) / cfg["warmup"]
    t = (step - cfg["warmup"]) / max(1, cfg["steps"] - cfg["warmup"])
    return cfg["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def evaluate(model, val, chunk: int = 16) -> float:
    xt, a, eps = val
    tot = 0.0
    for i in range(0, xt.shape[0], chunk):
        tot += F.mse_loss(model(xt[i:i + chunk], a[i:i + chunk]), eps[i:i + chunk],
                          reduction="sum").item()
    return tot / eps.numel()


def train(variant: str, cfg: dict, seed: int, val) -> dict:
    torch.manual_seed(seed)
    model = Denoiser(cfg, variant)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    losses, val_curve, step_times = [], [], []
    t0 = time.time()
    for step in range(cfg["steps"]):
        if step % cfg["eval_every"] == 0:
            model.eval(), val_curve.append([step, evaluate(model, val)]), model.train()
        xt, a, eps = batch_for(step, cfg, seed)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        ts = time.perf_counter()
        loss = F.mse_loss(model(xt, a), eps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
        opt.step()
        step_times.append(time.perf_counter() - ts)
        losses.append(loss.item())
        if step % 25 == 0 or step == cfg["steps"] - 1:
            print(f"  {variant:8s} step {step:4d} loss {loss.item():.4f} "
                  f"({step_times[-1] * 1e3:.0f} ms/step)", flush=True)
    model.eval()
    final_val = evaluate(model, val)
    val_curve.append([cfg["steps"], final_val])
    gates = [blk.attn.gate_coarse.detach().abs().mean().item() for blk in model.blocks
             if hasattr(blk.attn, "gate_coarse")]
    st = sorted(step_times[5:])                                                # drop warm-up steps
    out = dict(variant=variant, train_loss=losses, val_curve=val_curve, final_val_loss=final_val,
               final_train_loss_avg20=sum(losses[-20:]) / len(losses[-20:]),
               step_ms_median=1e3 * st[len(st) // 2], step_ms_mean=1e3 * sum(st) / len(st),
               mean_abs_gate_coarse=gates, wall_s=time.time() - t0,
               params=sum(p.numel() for p in model.parameters()))
    if variant != "dense":
        nt = tile_layout((cfg["frames"],) + (cfg["size"] // cfg["patch"],) * 2, tuple(cfg["tile"])).n_tiles
        out["n_tiles"] = nt
        out["topk_tiles"] = lowbit_attn.vsa.resolve_topk(float(variant.split("_")[1]) / 100, nt)
    print(f"  {variant}: final val {final_val:.4f}, median {out['step_ms_median']:.0f} ms/step, "
          f"{out['wall_s']:.0f} s", flush=True)
    return out


def attention_flops(cfg: dict, variant: str) -> float:
    """Attention matmul FLOPs (QKᵀ and PV, forward) per layer per video; VSA: fine stage over the
    selected tiles plus the coarse stage over pooled tiles."""
    t, h = cfg["frames"], cfg["size"] // cfg["patch"]
    n, d = t * h * h, cfg["width"]                        # d summed over heads
    if variant == "dense":
        return 4 * n * n * d
    nt = tile_layout((t, h, h), tuple(cfg["tile"])).n_tiles
    kk = lowbit_attn.vsa.resolve_topk(float(variant.split("_")[1]) / 100, nt)
    return 4 * n * (kk * n // nt) * d + 4 * nt * nt * d


CPU = dict(frames=8, size=64, patch=4, blobs=3, tile=[4, 4, 4], width=64, heads=2, layers=2,
           batch=4, steps=250, lr=2e-3, warmup=20, weight_decay=0.01, clip=1.0, eval_every=25,
           val_videos=32)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["dense", "vsa_25", "vsa_12.5"])
    ap.add_argument("--steps", type=int, default=CPU["steps"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--size", type=int, default=CPU["size"], help="frame side in pixels (patch 4)")
    ap.add_argument("--tile", type=int, nargs=3, default=CPU["tile"])
    ap.add_argument("--batch", type=int, default=CPU["batch"])
    ap.add_argument("--out", default=str(HERE / "results" / "cpu.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = dict(CPU, steps=args.steps, size=args.size, tile=args.tile, batch=args.batch)
    t0 = time.time()
    val = val_set(cfg, args.seed)
    runs = {}
    for variant in args.variants:
        print(f"== {variant}", flush=True)
        runs[variant] = train(variant, cfg, args.seed, val)
        runs[variant]["attn_flops_per_layer_per_video"] = attention_flops(cfg, variant)
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=HERE).stdout.strip()
    except OSError:
        commit = None
    res = dict(config=cfg, seed=args.seed, threads=args.threads,
               tokens=cfg["frames"] * (cfg["size"] // cfg["patch"]) ** 2,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               device=f"cpu ({platform.processor() or platform.machine()}), torch {torch.__version__}, "
                      f"{args.threads} thread(s)",
               command="python " + " ".join(sys.argv), library_commit=commit,
               wall_s=time.time() - t0, runs=runs)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out} ({res['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()

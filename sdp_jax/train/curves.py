"""A run's training curves: validation loss against steps, tokens (images) and training FLOPs,
the FLOP-matched view of the SDP paper (Singh et al., Sec. 5), read from the run directory's
``metrics.jsonl`` and ``summary.json`` (written by :func:`sdp_jax.train.loop.train`), drawn into
``curves.png``. Every finished run writes its own; ``python -m sdp_jax.tools.plot`` draws several
runs side by side.
"""

from __future__ import annotations

import json
import os

# the evaluation loss key of each family (language models and tasks, vision) and its name
EVAL_KEYS = (("val_loss", "validation loss"), ("test_loss", "test loss"))
# the loss's unit by what a run counts (a task's loss is the user's own: no unit given)
UNITS = {"tokens": " (nats/token)", "images": " (nats)"}


def read_run(workdir: str) -> dict:
    """One run's curves: ``label`` (the directory's name), ``records`` (``metrics.jsonl``),
    ``items_per_step`` (tokens or images of every worker per step) and
    ``model_flops_per_step`` (training FLOPs of every worker per step; None when unknown),
    ``item`` (``tokens``, ``images`` or ``examples``; None in a summary from before it was
    recorded).

    Raises:
      ValueError: no ``metrics.jsonl`` in ``workdir`` (not a run directory), or no
        ``summary.json`` (the run has not ended or stopped once yet)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"{workdir!r} has no metrics.jsonl: give a run's --workdir.")
    summary_path = os.path.join(workdir, "summary.json")
    if not os.path.isfile(summary_path):
        raise ValueError(f"{workdir!r} has no summary.json yet (written when a run ends or "
                         "stops); plot it once it has.")
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue   # a line cut by a kill
    with open(summary_path) as f:
        summary = json.load(f)
    return {"label": os.path.basename(os.path.normpath(workdir)), "records": records,
            "items_per_step": summary.get("items_per_step"),
            "model_flops_per_step": summary.get("model_flops_per_step"),
            "item": summary.get("item")}


def loss_label(key: str, runs: list[dict]) -> str:
    """The evaluation loss's axis label: its name (``key``: ``val_loss`` or ``test_loss``)
    and, when every run counts the same items, their unit (nats/token for language models,
    nats for vision; none for a task's loss, which is the user's own)."""
    items = {r["item"] for r in runs}
    if items == {None}:   # summaries from before `item` was recorded: the family from the key
        items = {{"val_loss": "tokens", "test_loss": "images"}[key]}
    return dict(EVAL_KEYS)[key] + (UNITS.get(items.pop(), "") if len(items) == 1 else "")


def draw(runs: list[dict], path: str) -> str:
    """Write ``path`` (PNG): one panel per x axis (steps, tokens or images, and training FLOPs
    where every run knows its FLOPs per step), the evaluation loss of each run (markers) over
    its training loss (a thin line). Returns ``path``.

    Raises:
      ValueError: the runs evaluate different losses (language and vision runs mixed)."""
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

    found = {k for r in runs for k, _ in EVAL_KEYS if any(k in x for x in r["records"])}
    if len(found) > 1:
        raise ValueError(f"the runs evaluate different losses ({', '.join(sorted(found))}): "
                         "plot language and vision runs separately.")
    key = next((k for k, _ in EVAL_KEYS if k in found), EVAL_KEYS[0][0])
    y_label = loss_label(key, runs)
    axes = [("step", "optimizer steps")]
    if all(r["items_per_step"] for r in runs):
        axes.append(("items", f"{runs[0]['item'] or 'items'} (all workers)"))
    if all(r["model_flops_per_step"] for r in runs):
        axes.append(("flops", "training FLOPs (all workers)"))
    fig, panels = plt.subplots(1, len(axes), figsize=(4.6 * len(axes), 3.8), squeeze=False)
    for ax, (name, label) in zip(panels[0], axes):
        for i, run in enumerate(runs):
            scale = {"step": 1, "items": run["items_per_step"],
                     "flops": run["model_flops_per_step"]}[name]
            color = f"C{i}"
            train = [(r["step"] * scale, r["train_loss"]) for r in run["records"]
                     if "train_loss" in r]
            evals = [(r["step"] * scale, r[key]) for r in run["records"] if key in r]
            if train:
                ax.plot(*zip(*train), color=color, alpha=0.35, linewidth=1)
            if evals:
                ax.plot(*zip(*evals), "o-", color=color, markersize=3, label=run["label"])
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    panels[0][0].set_ylabel(f"{y_label}; line: training loss")
    panels[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def curves(workdirs: list[str], out: str | None = None) -> str:
    """:func:`draw` of the runs in ``workdirs`` into ``out/curves.png`` (default: the first
    run's directory). Returns the PNG's path. Raises ValueError as :func:`read_run` and
    :func:`draw` do."""
    runs = [read_run(w) for w in workdirs]
    out = out or workdirs[0]
    os.makedirs(out, exist_ok=True)
    return draw(runs, os.path.join(out, "curves.png"))

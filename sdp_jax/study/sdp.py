"""The SDP study: every variant against DDP at equal steps and at equal FLOPs, over coverages
and seeds, with gradient alignment and the spectral gap (the claims of Singh et al., arXiv
2507.09029, measured at CPU scale; docs/study_sdp.md gives the results).

    python -m sdp_jax.study sdp                                   # every arm -> runs/sdp_study
    python -m sdp_jax.study sdp --arms lm --coverages 0.5 --seeds 0      # one piece
    python -m sdp_jax.study sdp --arms gap --seeds 0,1,2
    python -m sdp_jax.study sdp --arms lm --lm_config configs/llama_tiny.py --variants ddp,b-sdp \\
        --coverages 0.5 --seeds 0 --out /tmp/sdp_tiny

Arms (``--arms``):

* ``lm``: the language model of ``--lm_config`` (default ``configs/llama_study.py``, the
  default corpus); ``digits``: the vision model of ``--vision_config`` (default
  ``configs/resnet18_study.py``, the handwritten digits). For every seed: DDP once (the
  config's ``steps``), then every SDP variant of ``--variants`` at every coverage of
  ``--coverages``, under each budget of ``--budgets``: ``step`` (DDP's steps) and, for the
  forward variants, ``flop`` (``ceil(steps / C)`` steps, the config's ``flop_matched``; a
  backward variant's step costs the full model's FLOPs, so its ``step`` run is its
  FLOP-matched one). A coverage a variant cannot
  realize on the model (e.g. B-SDP at C = 3/8 of a ResNet-18 whose stages keep a block each)
  is skipped with its reason in the table. Language-model runs measure the gradient alignment
  every ``--align_every`` steps (:meth:`sdp_jax.step.SDPStep.alignment_fn`).
* ``gap``: ``bb-sdp`` on the ``--lm_config`` model at ``--gap_coverage`` with the mask schemes
  ``cyclic``, ``random`` (mask seed = the run's seed) and ``grouped`` (disconnected: spectral
  gap 0, run with ``allow_disconnected``), at DDP's steps: loss against the mask graph's
  spectral gap. (Its cyclic run is the lm arm's ``bb-sdp`` step run when the configs agree:
  trained once, in the lm arm's folder.)

Each run is an ordinary training run in ``OUT/<arm>/seed<s>/<name>`` (a rerun resumes a
stopped run and reuses a finished run's summary without compiling; an interrupted study exits
with 128 + the signal number, as ``train.py``). Every run, planned or skipped, is validated
before the first one trains.

Writes to ``OUT``, from the runs of this invocation and the rows earlier invocations left in
``OUT/study_sdp.json`` (a run's new row replaces its old one, so pieces run one after another add
up; rows made from another config of an arm being run are refused before any training): ``study_sdp.json`` (one row per run, with its evaluation curve),
``study_sdp.md`` (the tables: means over the seeds with their range), and per arm
``<arm>_loss_vs_flops.png`` (validation loss against training FLOPs, one panel per coverage,
the FLOP-matched runs and DDP, mean over seeds with the range shaded), ``<arm>_pareto.png``
(final loss against peak memory per device, with the Pareto front), ``lm_alignment.png`` and
``gap.png``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import signal
import sys
from typing import NoReturn

from sdp_jax import mesh as mesh_lib
from sdp_jax.bench import measure as bench
from sdp_jax.train import cli, curves, loop
from sdp_jax.train import run as run_lib

PROG = "python -m sdp_jax.study sdp"
ARMS = ("lm", "digits", "gap")
VARIANTS = ("ddp", "b-sdp", "n-sdp", "bb-sdp", "nb-sdp")
BUDGETS = ("step", "flop")
FORWARD = ("b-sdp", "n-sdp")   # the variants whose steps cost C of DDP's block FLOPs
GAP_SCHEMES = ("cyclic", "random", "grouped")


def flag_values(argv: list[str]):
    """The study's flags: ``--lm_config`` / ``--vision_config`` (get_config() files, fields
    overridden as ``--lm_config.FIELD=VALUE``), ``--arms``, ``--variants``, ``--coverages``,
    ``--budgets``, ``--seeds``, ``--gap_coverage``, ``--align_every``, ``--out``."""
    from absl import flags  # pylint: disable=g-import-not-at-top

    fv = cli.flag_values(cli.config_file("llama_study.py"), argv, PROG, name="lm_config",
                         help_text="language-model run config of the lm and gap arms; "
                         "override a field as --lm_config.FIELD=VALUE")
    cli.flag_values(cli.config_file("resnet18_study.py"), argv, PROG, into=fv, name="vision_config",
                    help_text="vision run config of the digits arm; override a field as "
                    "--vision_config.FIELD=VALUE")
    flags.DEFINE_list("arms", list(ARMS), "arms to run: lm, digits, gap", flag_values=fv)
    flags.DEFINE_list("variants", list(VARIANTS), "variants of the lm and digits arms (ddp "
                      "is their baseline)", flag_values=fv)
    flags.DEFINE_list("coverages", ["0.5", "0.375", "0.75"], "coverages C of the SDP "
                      "variants", flag_values=fv)
    flags.DEFINE_list("budgets", list(BUDGETS), "step: DDP's steps; flop: ceil(steps / C) "
                      "steps (FLOP-matched)", flag_values=fv)
    flags.DEFINE_list("seeds", ["0", "1", "2"], "seeds (initialization and data order); every "
                      "run once per seed", flag_values=fv)
    flags.DEFINE_float("gap_coverage", 0.5, "coverage of the gap arm's bb-sdp runs",
                       flag_values=fv)
    flags.DEFINE_integer("align_every", 25, "steps between gradient-alignment measurements "
                         "of the language-model runs (0 = none)", flag_values=fv)
    flags.DEFINE_string("out", os.path.join("runs", "sdp_study"), "folder of the runs and the "
                        "results", flag_values=fv)
    return fv


def _name(variant: str, coverage: float, budget: str, scheme: str | None = None) -> str:
    if variant == "ddp":
        return "ddp"
    if scheme is not None:
        return f"{variant}_c{coverage:g}_{scheme}"
    return f"{variant}_c{coverage:g}_{budget}"


def plan(arms, variants, coverages, budgets, seeds, gap_coverage) -> list[dict]:
    """The study's runs, in order: ``{arm, variant, coverage, budget, scheme, seed, name}``
    (``scheme`` None: the config's). The ``flop`` budget is planned for the forward variants
    only: a backward-masking step runs the full model's forward and backward passes, so its
    ``step`` run is already FLOP-matched to DDP (the FLOPs column of the table shows it)."""
    runs = []
    for seed in seeds:
        for arm in arms:
            if arm == "gap":
                runs += [dict(arm=arm, variant="bb-sdp", coverage=gap_coverage, budget="step",
                              scheme=s, seed=seed, name=_name("bb-sdp", gap_coverage, "step", s))
                         for s in GAP_SCHEMES]
                continue
            if "ddp" in variants:
                runs.append(dict(arm=arm, variant="ddp", coverage=1.0, budget="step",
                                 scheme=None, seed=seed, name="ddp"))
            runs += [dict(arm=arm, variant=v, coverage=c, budget=b, scheme=None, seed=seed,
                          name=_name(v, c, b))
                     for c in coverages for v in variants if v != "ddp" for b in budgets
                     if b == "step" or v in FORWARD]
    return runs


def run_config(base, run: dict, align_every: int):
    """``base`` (an arm's config) set up for one run of :func:`plan`."""
    c = bench._variant_config(base, run["variant"], run["coverage"], base.workers)
    with c.unlocked():
        c.flop_matched = run["budget"] == "flop"
        c.seed = run["seed"]
        if run["scheme"] is not None:
            c.sdp.scheme = run["scheme"]
            if run["scheme"] == "random":
                c.sdp.mask_seed = run["seed"]
            c.sdp.allow_disconnected = run["scheme"] == "grouped"
        if run["arm"] != "digits":
            c.align_every = min(align_every, c.steps) if align_every else 0
    return c


def read_metrics(workdir: str, loss_key: str) -> tuple[list, dict]:
    """``(evaluation curve [(step, loss)], mean of each alignment over the run)`` from a run's
    ``metrics.jsonl`` (:func:`sdp_jax.train.curves.read_run`)."""
    records = curves.read_run(workdir)["records"]
    curve = [(r["step"], r[loss_key]) for r in records if r.get(loss_key) is not None]
    align = {k: [r[k] for r in records if r.get(k) is not None]
             for k in ("grad_alignment", "update_alignment")}
    return curve, {k: (sum(v) / len(v) if v else None) for k, v in align.items()}


def row_of(run: dict, summary: dict, workdir: str) -> dict:
    """One run's row: the plan's fields and the summary's figures (loss of the full model
    after the last step; ``flops``: the run's training FLOPs, all workers)."""
    vision = run["arm"] == "digits"
    loss_key = "test_loss" if vision else "val_loss"
    curve, align = read_metrics(workdir, loss_key)
    per_step = summary.get("model_flops_per_step")
    return {**run, "steps": summary["steps"], "loss": summary[f"final_{loss_key}"],
            "metric": summary.get("final_test_acc" if vision else "final_val_bpb"),
            "peak_bytes_per_device": summary.get("peak_bytes_per_device"),
            "flops_per_step": per_step,
            "flops": None if per_step is None else per_step * summary["steps"],
            "curve": [(s, None if per_step is None else per_step * s, v) for s, v in curve],
            "spectral_gap": summary.get("spectral_gap"), "wall_s": summary.get("wall_s"),
            **align}


def aggregate(rows: list[dict]) -> list[dict]:
    """One row per (arm, variant, coverage, budget, scheme) over the seeds: ``loss``, the
    alignments, ``metric``, ``spectral_gap`` and ``wall_s`` are means, ``losses`` the
    per-seed values, ``diverged_seeds`` the seeds whose run diverged; ``steps``, ``flops``,
    ``peak_bytes_per_device`` and ``curve`` are the first seed's (the same for every seed);
    skipped runs (``skipped``: the reason) are kept once."""
    out: dict[tuple, dict] = {}
    done: dict[tuple, list] = {}   # each key's finished runs
    for r in rows:
        key = (r["arm"], r["variant"], r["coverage"], r["budget"], r["scheme"])
        a = out.setdefault(key, {**r, "seeds": [], "losses": [], "metrics": [],
                                 "diverged_seeds": []})
        if r.get("diverged"):
            a["diverged_seeds"].append(r["seed"])
        if r.get("skipped") or r.get("diverged"):
            continue
        a["seeds"].append(r["seed"])
        a["losses"].append(r["loss"])
        a["metrics"].append(r["metric"])
        done.setdefault(key, []).append(r)
    for key, a in out.items():
        for k in ("loss", "metric", "grad_alignment", "update_alignment", "spectral_gap",
                  "wall_s"):
            vals = [r[k] for r in done.get(key, []) if r.get(k) is not None]
            a[k] = sum(vals) / len(vals) if vals else None
        a.pop("seed", None)
    return list(out.values())


def _range(a: dict) -> str:
    v = a["losses"]
    if a["loss"] is None:
        return "diverged" if a.get("diverged_seeds") else ""
    return f"{a['loss']:.4f}" + (f" [{min(v):.4f}, {max(v):.4f}]" if len(v) > 1 else "")


def format_tables(agg: list[dict]) -> str:
    """Markdown: for each of the lm / digits arms a table of every variant, coverage and
    budget against the DDP row of the same arm (loss difference, FLOPs and peak memory
    ratios), with the gradient alignments; for the gap arm, loss against spectral gap."""
    out = []
    for arm in ARMS:
        sel = [a for a in agg if a["arm"] == arm]
        if not sel:
            continue
        if arm == "gap":
            out += ["### gap: bb-sdp, loss against the mask graph's spectral gap", "",
                    "| scheme | C | spectral gap | steps | val loss (nats) [seed range] | "
                    "seeds |", "|---|---|---|---|---|---|"]
            for a in sorted(sel, key=lambda a: -(a["spectral_gap"] or 0)):
                gap = "" if a["spectral_gap"] is None else f"{a['spectral_gap']:.3f}"
                div = len(a.get("diverged_seeds") or [])
                out.append(f"| {a['scheme']} | {a['coverage']:g} | {gap} | "
                           f"{a.get('steps', '')} | {_range(a)} | {len(a['seeds'])}"
                           + (f" ({div} diverged)" if div else "") + " |")
            out.append("")
            continue
        vision = arm == "digits"
        ddp = next((a for a in sel if a["variant"] == "ddp" and a["loss"] is not None), None)
        metric = "test acc" if vision else "bits/byte"
        out += [f"### {arm}: every variant against DDP", "",
                f"| variant | C | budget | steps | {'test' if vision else 'val'} loss (nats) "
                f"[seed range] | vs DDP | {metric} | FLOPs vs DDP | peak/device vs DDP | "
                "grad alignment | update alignment | seeds |", "|" + "---|" * 12]
        order = {v: i for i, v in enumerate(VARIANTS)}
        for a in sorted(sel, key=lambda a: (-a["coverage"] if a["variant"] != "ddp" else -2,
                                            order.get(a["variant"], 9), a["budget"])):
            lead = (f"| {a['variant']} | {a['coverage']:g} | "
                    f"{'-' if a['variant'] == 'ddp' else a['budget']} |")
            if a.get("skipped"):
                out.append(f"{lead} - | skipped: {a['skipped']} |" + " |" * 7)
                continue

            def ratio(k, a=a):
                if ddp is None or not a.get(k) or not ddp.get(k):
                    return ""
                return f"{a[k] / ddp[k]:.3f}"
            vs = (f"{a['loss'] - ddp['loss']:+.4f}" if ddp is not None and a is not ddp
                  else "")
            m = "" if a["metric"] is None else f"{a['metric']:.4f}"
            al = [("" if a.get(k) is None else f"{a[k]:.3f}")
                  for k in ("grad_alignment", "update_alignment")]
            flops = "1.000" if a is ddp else ratio("flops")
            peak = "1.000" if a is ddp else ratio("peak_bytes_per_device")
            div = a.get("diverged_seeds") or []
            seeds = f"{len(a['seeds'])}" + (f" ({len(div)} diverged)" if div else "")
            if not a["seeds"]:
                out.append(f"{lead} - | diverged |" + " |" * 6 + f" {seeds} |")
                continue
            out.append(f"{lead} {a['steps']} | {_range(a)} | {vs} | {m} | {flops} | {peak} | "
                       f"{al[0]} | {al[1]} | {seeds} |")
        out.append("")
    return "\n".join(out)


_COLORS = {"ddp": "k", "b-sdp": "tab:blue", "n-sdp": "tab:orange", "bb-sdp": "tab:green",
           "nb-sdp": "tab:red"}


def _plt():
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
    return plt


def plot_loss_vs_flops(rows: list[dict], arm: str, path: str) -> bool:
    """One panel per coverage: each variant's FLOP-matched evaluation curve against training
    FLOPs (mean over seeds, the seeds' range shaded; the forward variants' ``flop`` runs, the
    backward variants' ``step`` runs) and DDP's. False (nothing written) when the arm has no
    FLOP counts or no forward ``flop`` run."""
    import numpy as np  # pylint: disable=g-import-not-at-top
    sel = [r for r in rows if r["arm"] == arm and r.get("flops")]
    covs = sorted({r["coverage"] for r in sel if r["budget"] == "flop" and r["variant"] != "ddp"},
                  reverse=True)
    if not covs:
        return False
    plt = _plt()
    fig, axes = plt.subplots(1, len(covs), figsize=(4.6 * len(covs), 3.8), squeeze=False)
    for ax, cov in zip(axes[0], covs):
        groups: dict[str, list] = {}
        for r in sel:
            if r["variant"] == "ddp" or (r["coverage"] == cov and (
                    r["budget"] == "flop" or r["variant"] not in FORWARD)):
                groups.setdefault(r["variant"], []).append(r["curve"])
        for v in sorted(groups, key=VARIANTS.index):   # the evaluations every seed has
            curves = groups[v]
            steps = sorted(set.intersection(*[{p[0] for p in c} for c in curves]))
            if not steps:
                continue
            x = np.array([dict((p[0], p[1]) for p in curves[0])[t] for t in steps])
            ys = np.array([[dict((p[0], p[2]) for p in c)[t] for t in steps] for c in curves])
            ax.plot(x, ys.mean(0), "-o", ms=3, color=_COLORS.get(v), label=v)
            if len(curves) > 1:
                ax.fill_between(x, ys.min(0), ys.max(0), color=_COLORS.get(v), alpha=0.2)
        ax.set_title(f"C = {cov:g}, FLOP-matched", fontsize=10)
        ax.set_xlabel("training FLOPs (all workers)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel(("test" if arm == "digits" else "validation") + " loss (nats)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_pareto(agg: list[dict], arm: str, path: str) -> bool:
    """Final loss (mean, seed range as a bar) against peak memory per device, every run of
    the arm (both budgets), with the Pareto front (the runs no other run matches or beats
    on both axes)."""
    pts = [a for a in agg if a["arm"] == arm and a.get("loss") is not None
           and a.get("peak_bytes_per_device")]
    if not pts:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    marks = {"step": "o", "flop": "^"}
    for a in pts:
        x, c = a["peak_bytes_per_device"] / 2**20, _COLORS.get(a["variant"])
        ax.scatter([x], [a["loss"]], color=c, marker=marks.get(a["budget"], "o"), zorder=3)
        if len(a["losses"]) > 1:
            ax.vlines(x, min(a["losses"]), max(a["losses"]), color=c, alpha=0.6)
        label = a["variant"] + ("" if a["variant"] == "ddp" else
                                f" {a['coverage']:g} {a['budget']}")
        ax.annotate(label, (x, a["loss"]), textcoords="offset points", xytext=(4, 3),
                    fontsize=7)
    front = sorted((a for a in pts if not any(
        o["peak_bytes_per_device"] <= a["peak_bytes_per_device"] and o["loss"] <= a["loss"]
        and (o["peak_bytes_per_device"], o["loss"]) != (a["peak_bytes_per_device"], a["loss"])
        for o in pts)), key=lambda a: a["peak_bytes_per_device"])
    if len(front) > 1:
        ax.plot([a["peak_bytes_per_device"] / 2**20 for a in front],
                [a["loss"] for a in front], "--", color="grey", label="Pareto front")
        ax.legend(fontsize=8)
    ax.set_xlabel("peak memory per device (MiB, compiled train step)")
    ax.set_ylabel("final " + ("test" if arm == "digits" else "validation") + " loss (nats)")
    ax.set_title(f"{arm}: loss against memory (o: step-matched, ^: FLOP-matched)", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_alignment(agg: list[dict], path: str) -> bool:
    """Bars of the mean gradient and update alignment of the lm arm's step-matched runs, per
    variant and coverage."""
    pts = [a for a in agg if a["arm"] == "lm" and a["budget"] == "step"
           and a.get("grad_alignment") is not None]
    if not pts:
        return False
    plt = _plt()
    pts.sort(key=lambda a: (-a["coverage"], VARIANTS.index(a["variant"])))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.8 * len(pts)), 4.0))
    xs = range(len(pts))
    ax.bar([x - 0.2 for x in xs], [a["grad_alignment"] for a in pts], 0.4,
           label="worker gradient vs full model's (held components)")
    ax.bar([x + 0.2 for x in xs], [a["update_alignment"] or 0 for a in pts], 0.4,
           label="averaged update vs DDP's")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([a["variant"] + ("" if a["variant"] == "ddp" else f"\nC={a['coverage']:g}")
                        for a in pts], fontsize=8)
    ax.set_ylabel("cosine similarity (mean over the run)")
    ax.set_ylim(min(0.0, min(a["update_alignment"] or 0 for a in pts)), 1.05)
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_gap(rows: list[dict], path: str) -> bool:
    """Final validation loss of every gap-arm run against its mask graph's spectral gap."""
    pts = [r for r in rows if r["arm"] == "gap" and r.get("loss") is not None]
    if not pts:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.6, 4.0))
    for s, mk in zip(GAP_SCHEMES, ("o", "s", "^")):
        sel = [r for r in pts if r["scheme"] == s]
        ax.scatter([r["spectral_gap"] for r in sel], [r["loss"] for r in sel], marker=mk,
                   label=s, zorder=3)
    ax.set_xlabel("spectral gap of the mask graph")
    ax.set_ylabel("final validation loss (nats)")
    ax.set_title(f"bb-sdp, C = {pts[0]['coverage']:g}: one point per run", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _floats(err, flag: str, values: list[str], low: float, high: float) -> list[float]:
    try:
        out = [float(x) for x in values if x]
    except ValueError:
        err(f"--{flag}={','.join(values)!r} must be numbers like 0.5,0.375")
    if not out or len(set(out)) != len(out) or any(not low < x < high for x in out):
        err(f"--{flag}={','.join(values)!r}: give distinct values in ({low:g}, {high:g}), "
            "e.g. 0.5,0.375")
    return out


def _choices(err, flag: str, values: list[str], allowed: tuple) -> list[str]:
    out = [x for x in values if x]
    bad = [x for x in out if x not in allowed]
    if bad or not out or len(set(out)) != len(out):
        err(f"--{flag}={','.join(values)!r}: choose distinct values from {', '.join(allowed)}")
    return out


def _one_line(e: Exception, flag: str) -> str:
    """An error of a run's validation or training as one line naming the study's flags."""
    msg = "; ".join(" ".join(line.split()) for line in str(e).splitlines() if line.strip())
    msg = (msg.replace("--config.align_every", "--align_every")
           .replace("config.align_every", "--align_every").replace("--config.seed", "--seeds")
           .replace("--config.", f"--{flag}.").replace("--workdir ", "run folder "))
    return re.sub(r"(?<![-\w])config\.", f"--{flag}.", msg)


ROW_KEYS = {"arm": str, "seed": int, "name": str, "variant": str, "coverage": float,
            "budget": str}


def read_rows(out: str, bases: dict, arms: list, replaced: set) -> list[dict]:
    """The rows of ``OUT/study_sdp.json`` (none if there is none), checked before any
    training.

    Raises:
      ValueError: the file is not a study's rows, or rows of an arm of this invocation that it
        will not replace were made from another config (``bases``: each arm's config)."""
    path = os.path.join(out, "study_sdp.json")
    if not os.path.lexists(path):
        return []
    try:
        with open(path) as f:
            rows = json.load(f)
        ok = isinstance(rows, list) and all(
            isinstance(r, dict) and all(isinstance(r.get(k), t) or (t is float and isinstance(
                r.get(k), int)) for k, t in ROW_KEYS.items())
            and (r.get("loss") is None or isinstance(r["loss"], (int, float))) for r in rows)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path!r} cannot be read ({type(e).__name__}): move it away or use "
                         "another --out (the runs' own folders are not touched)") from None
    if not ok:
        raise ValueError(f"{path!r} does not hold a study's rows (a list of runs with "
                         f"{', '.join(ROW_KEYS)}): move it away or use another --out")
    for r in rows:
        if (r["arm"] in arms and (r["arm"], r["seed"], r["name"]) not in replaced
                and r.get("config") != _fingerprint(bases[r["arm"]])):
            raise ValueError(f"{path!r} holds the {r['arm']} arm's run {r['name']} (seed "
                             f"{r['seed']}) made from another config; rerun it with the flags "
                             "that made it, include it in this run's --seeds / --variants / "
                             "--coverages, or use another --out")
    return rows


def _fingerprint(config) -> str:
    """What a row records of its arm's config (before the run's own settings)."""
    return hashlib.sha256(config.to_json(sort_keys=True).encode()).hexdigest()[:16]


# The flag of each arm's config.
CONFIG_FLAG = {"lm": "lm_config", "gap": "lm_config", "digits": "vision_config"}


def _err(msg: str) -> NoReturn:
    """Exit with status 2 and ``PROG: error: msg`` on stderr (:func:`sdp_jax.train.cli.error`)."""
    cli.error(PROG, msg)


def main(argv=None, check_only: bool = False) -> list[dict]:
    """The SDP study's command line (``argv`` without the program name). Returns one row per
    run of this invocation. A bad flag or config, or a run folder written by other settings,
    exits with status 2 and a one-line error before any compile or training; ``check_only``
    stops after that validation (the documentation check, ``tests/test_docs.py``). A run that
    diverges (a non-finite loss) is recorded as such and the study goes on."""
    argv = [PROG] + (sys.argv[2:] if argv is None else list(argv))
    fv = cli.command_flags(flag_values, argv, PROG, __doc__, "--arms=lm,gap")
    arms, variants, budgets, coverages, seeds = _settings(fv)
    bases = {"lm": fv.lm_config, "gap": fv.lm_config, "digits": fv.vision_config}
    _check_bases(fv, bases, arms)
    mesh_lib.simulate_cpu_devices(max(bases[a].num_cpu_devices for a in arms))
    _check_arms(bases, arms, seeds[0], fv.align_every)
    runs = plan(arms, variants, coverages, budgets, seeds, fv.gap_coverage)
    configs = _validate_runs(fv, runs, bases)
    _check_plan(fv, runs, arms, variants, budgets)
    bench.out_folder(PROG, fv.out)
    try:
        read_rows(fv.out, bases, arms, {(r["arm"], r["seed"], r["name"]) for r in runs
                                        if not r.get("skipped")})
    except ValueError as e:
        _err(str(e))
    if check_only:
        return []
    return _train_runs(fv.out, runs, configs, bases, seeds[0])


def _settings(fv) -> tuple[list, list, list, list, list]:
    """``(arms, variants, budgets, coverages, seeds)`` of the flags; a bad value (also of
    ``--gap_coverage`` and ``--align_every``) exits with status 2 and a one-line error."""
    arms = _choices(_err, "arms", fv.arms, ARMS)
    variants = _choices(_err, "variants", fv.variants, VARIANTS)
    budgets = _choices(_err, "budgets", fv.budgets, BUDGETS)
    coverages = _floats(_err, "coverages", fv.coverages, 0.0, 1.0)
    if len({_name("b-sdp", c, "step") for c in coverages}) != len(coverages):
        _err(f"--coverages={','.join(fv.coverages)!r}: give coverages that differ in their "
             "first six digits")
    seeds = cli.seeds(PROG, fv.seeds)
    if not 0 < fv.gap_coverage < 1:
        _err(f"--gap_coverage={fv.gap_coverage}: give a coverage in (0, 1), e.g. 0.5")
    if fv.align_every < 0:
        _err(f"--align_every={fv.align_every}: give 0 (off) or a number of steps, e.g. 25")
    return arms, variants, budgets, coverages, seeds


def _check_bases(fv, bases: dict, arms: list[str]) -> None:
    """Exit (status 2, one line) unless each arm's config is of the arm's kind (vision for
    digits, a language model otherwise) and trains to its end (no ``stop_at_step``)."""
    for arm in arms:
        flag = CONFIG_FLAG[arm]
        if bench._is_vision(bases[arm]) != (arm == "digits"):
            kind = "vision" if arm == "digits" else "language-model"
            _err(f"--{flag} {fv[flag].config_filename!r} is not a {kind} config (the "
                 f"{arm} arm); give one from configs/ of that kind")
        if bases[arm].stop_at_step:
            _err(f"--{flag}.stop_at_step={bases[arm].stop_at_step}: the study trains every "
                 "run to its end; stop it with Ctrl-C (a rerun resumes) and drop the flag")


def _check_arms(bases: dict, arms: list[str], seed: int, align_every: int) -> None:
    """Validate each arm's config as its DDP run, so that its own errors are not reported as
    a coverage's; exits with status 2 and a one-line error."""
    import jax  # pylint: disable=g-import-not-at-top

    for arm in arms:
        try:
            run_lib.resolve(run_config(bases[arm], dict(
                arm=arm, variant="ddp", coverage=1.0, budget="step", scheme=None,
                seed=seed), align_every), jax.device_count())
        except ValueError as e:
            _err(f"--{CONFIG_FLAG[arm]}: {_one_line(e, CONFIG_FLAG[arm])}")


def _folder(out: str, run: dict) -> str:
    """A run's folder: ``OUT/<arm>/seed<s>/<name>``."""
    return os.path.join(out, run["arm"], f"seed{run['seed']}", run["name"])


def _validate_runs(fv, runs: list[dict], bases: dict) -> dict:
    """Validate every run of ``runs`` before any compile or training: a run whose coverage
    its variant cannot realize gets ``skipped`` (the reason); any other error exits with
    status 2 and a one-line error. Returns ``{id(run): (config, run folder)}`` of the runs
    to train (the gap arm's cyclic run shares the lm arm's bb-sdp folder when it is the same
    run)."""
    import jax  # pylint: disable=g-import-not-at-top

    configs = {}
    for run in runs:
        flag = CONFIG_FLAG[run["arm"]]
        c = run_config(bases[run["arm"]], run, fv.align_every)
        where = _folder(fv.out, run)
        if run["scheme"] == "cyclic":   # the lm arm's bb-sdp step run, if it is the same run
            twin = dict(run, arm="lm", scheme=None, name=_name("bb-sdp", run["coverage"],
                                                              "step"))
            if run_config(bases["lm"], twin, fv.align_every).to_dict() == c.to_dict():
                where = _folder(fv.out, twin)
        try:
            resolved = run_lib.resolve(c, jax.device_count())
        except ValueError as e:
            why = _one_line(e, flag)
            if run["arm"] == "gap":
                _err(f"--gap_coverage={fv.gap_coverage:g}: {why.split(';')[0]}; choose a "
                     "coverage every mask of the gap arm realizes, e.g. --gap_coverage=0.5")
            if run["variant"] == "ddp" or f"coverage C={run['coverage']:g}" not in why:
                _err(f"{run['arm']} arm, {run['name']}, seed {run['seed']}: {why}")
            run["skipped"] = why.split(";")[0].replace("|", "/")   # not realizable here
            continue
        try:
            loop.check_workdir(c, where, resolved)
        except ValueError as e:
            _err(f"{run['arm']} arm, {run['name']}, seed {run['seed']}: "
                 f"{_one_line(e, flag)} (the run folder is {where}: use another "
                 "--out, or the flags that wrote it)")
        configs[id(run)] = (c, where)
    return configs


def _check_plan(fv, runs: list[dict], arms, variants, budgets) -> None:
    """Exit (status 2, one line) when an lm or digits arm has SDP runs but none realizable,
    or when the flags plan no run at all."""
    for arm in arms:
        sdp_runs = [r for r in runs if r["arm"] == arm and r["variant"] != "ddp"]
        if arm != "gap" and sdp_runs and all(r.get("skipped") for r in sdp_runs):
            _err(f"the {arm} arm: no variant of --variants is realizable at --coverages="
                 f"{','.join(fv.coverages)} ({sdp_runs[0]['skipped']})")
    if not runs:
        _err(f"nothing to run: --variants={','.join(variants)} with --budgets="
             f"{','.join(budgets)} plans no run (the flop budget is the forward variants' "
             "only); add --budgets=step or a forward variant")


def _train_runs(out: str, runs: list[dict], configs: dict, bases: dict,
                first_seed: int) -> list[dict]:
    """Train the validated runs in order (a skipped run is logged once, at ``first_seed``,
    and kept as a row) and :func:`write` their rows to ``out``. A diverged run is recorded
    and the study goes on; a run stopped before its end (or by a signal) writes the rows so
    far and exits: 128 + the signal number, else 1. Returns the rows."""
    cli.exit_on_signals()   # outside the training loops: one line, no traceback
    todo = [r for r in runs if not r.get("skipped")]
    for r in runs:
        if r.get("skipped") and r["seed"] == first_seed:
            loop.log(f"study: skipping {r['arm']} {r['name']}: {r['skipped']}")
    rows = []
    for run in runs:
        stamp = {"config": _fingerprint(bases[run["arm"]])}
        if run.get("skipped"):
            rows.append(dict(run, **stamp))
            continue
        c, where = configs[id(run)]
        loop.log(f"study: run {todo.index(run) + 1}/{len(todo)}: {run['arm']} {run['name']}, "
                 f"seed {run['seed']} -> {where}")
        try:
            s = loop.train(c, where)
        except FloatingPointError as e:   # this run diverged; the others still tell
            loop.log(f"study: {run['arm']} {run['name']}, seed {run['seed']} diverged: {e}")
            rows.append(dict(run, diverged=" ".join(str(e).split()), **stamp))
            continue
        except (ValueError, ImportError) as e:
            _err(f"{run['arm']} arm, {run['name']}, seed {run['seed']}: "
                 f"{_one_line(e, CONFIG_FLAG[run['arm']])}")
        if s.get("completed"):
            rows.append(dict(row_of(run, s, where), **stamp))
        sig = s.get("signal")
        if not s.get("completed") or sig:
            if rows:   # what is finished is in the tables already
                write(rows, out)
            print(f"study stopped {'after' if s.get('completed') else 'during'} {run['arm']} "
                  f"{run['name']} (seed {run['seed']}); rerun the same command to resume.",
                  file=sys.stderr)
            sys.exit(128 + int(getattr(signal, sig)) if sig else 1)
    write(rows, out)
    return rows


def write(rows: list[dict], out: str) -> list[str]:
    """``study_sdp.json``, ``study_sdp.md`` and the PNGs of ``rows`` into ``out``; returns the
    paths written."""
    path = os.path.join(out, "study_sdp.json")
    if os.path.exists(path):   # earlier pieces' rows, replaced by this invocation's
        with open(path) as f:
            old = json.load(f)
        mine = {(r["arm"], r["seed"], r["name"]) for r in rows}
        rows = [r for r in old if (r["arm"], r["seed"], r["name"]) not in mine] + rows
    agg = aggregate(rows)
    table = format_tables(agg)
    print(table)
    written = [os.path.join(out, "study_sdp.json"), os.path.join(out, "study_sdp.md")]
    loop.write_atomically(written[0], json.dumps(rows, indent=1))
    total = sum(r.get("wall_s") or 0 for r in rows)
    loop.write_atomically(written[1], table + f"\nTraining wall time of these runs: "
                          f"{total / 60:.1f} min ({math.ceil(total / 3600 * 10) / 10:g} h).\n")
    arms = {r["arm"] for r in rows}
    for arm in ("lm", "digits"):
        if arm in arms:
            p = os.path.join(out, f"{arm}_loss_vs_flops.png")
            if plot_loss_vs_flops(rows, arm, p):
                written.append(p)
            p = os.path.join(out, f"{arm}_pareto.png")
            if plot_pareto(agg, arm, p):
                written.append(p)
    p = os.path.join(out, "lm_alignment.png")
    if plot_alignment(agg, p):
        written.append(p)
    p = os.path.join(out, "gap.png")
    if plot_gap(rows, p):
        written.append(p)
    loop.log("wrote " + ", ".join(written))
    return written

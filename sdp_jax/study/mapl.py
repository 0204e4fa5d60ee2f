"""The MAPL study: validation loss against bytes per token crossing the pipeline-stage boundaries
(``python -m sdp_jax.study`` or ``python -m sdp_jax.study mapl``); ``python -m sdp_jax.study
sdp`` is the SDP study of every variant against DDP (sdp_jax/study/sdp.py).

    python -m sdp_jax.study                       # configs/llama_mapl.py -> runs/mapl_study
    python -m sdp_jax.study --seeds 0,1 --out /tmp/mapl       # every run with two seeds
    python -m sdp_jax.study --config.steps=100 --config.optim.warmup_steps=10 --out /tmp/mapl
    python -m sdp_jax.study --bytes_only --ratios 4,8,16      # compiled-program bytes only
    python -m sdp_jax.study --bytes_only --schedules gpipe,1f1b --methods none,mapl --ratios 8

The config is loaded as ``train.py`` loads it (:mod:`sdp_jax.train.cli`; e.g.
``--config.pipeline.rvq_levels=2`` adds residual vector quantization to the compressed payloads).

Every run trains the same model on the same data with the same token budget (the config's steps,
global batch and sequence length); only the boundary method (``pipeline.method``) and ratio
differ: ``none`` once, then ``fixed``, ``unconstrained`` and ``mapl`` at each ratio (MAPL, Janson,
Oyallon, Belilovsky, arXiv 2606.05484: the 4x / 8x comparison and the loss-vs-bytes Pareto front).
Each run is an ordinary training run in ``OUT/runs/seed<s>/<method>_<ratio>x`` (a rerun resumes it or
reuses its summary; an interrupted study exits with 128 + the signal number, as ``train.py``).
Bytes per token are read from the compiled train step
(:func:`sdp_jax.pipeline.boundary_bytes`: forward payload, token ids and backward gradients of one
boundary, for one worker, divided by that worker's tokens per step; they include the GPipe bubble
ticks, ``(M + P - 1) / M`` of the useful transfers under GPipe, ``(M + 2 (P - 1)) / M`` under
1F1B). The peak bytes per device are the compiled train step's (argument + temporaries + output
- aliased, :func:`sdp_jax.costs.memory_stats`). ``--schedules`` runs (or with
``--bytes_only`` measures) every method under each pipeline schedule (``gpipe``, ``1f1b``;
default: the config's ``pipeline.schedule``); a 1F1B run's folder ends in ``_1f1b``.

Writes ``OUT/study.json`` (one row per run), ``OUT/study.md`` (the table: means over the seeds,
and each seed's loss) and ``OUT/study.png`` (the plot); ``--bytes_only`` writes ``OUT/bytes.json``
and ``OUT/bytes.md``. ``OUT`` defaults to ``runs/mapl_study``.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
from typing import NoReturn

from sdp_jax import mesh as mesh_lib
from sdp_jax.bench import measure as bench
from sdp_jax.costs import program as costs
from sdp_jax.train import cli, families, loop
from sdp_jax.train import run as run_lib

# = sdp_jax.pipeline.METHODS / SCHEDULES (tests/test_pipeline.py), not imported so that --help
# stays fast
METHODS = ("none", "fixed", "unconstrained", "mapl")
SCHEDULES = ("gpipe", "1f1b")


def _runs(methods, ratios):
    out = []
    if "none" in methods:
        out.append(("none", 1))
    for r in ratios:
        out += [(m, r) for m in methods if m != "none"]
    return out


def _run_dir(out: str, method: str, ratio: int, seed: int, schedule: str = "gpipe") -> str:
    tail = "" if schedule == "gpipe" else f"_{schedule}"
    return os.path.join(out, "runs", f"seed{seed}",
                        f"{method}_{1 if method == 'none' else ratio}x{tail}")


def _with(config, method: str, ratio: int, seed: int, schedule: str):
    c = config.copy_and_resolve_references()
    with c.unlocked():
        c.pipeline.schedule = schedule
        c.pipeline.method = method
        c.pipeline.ratio = ratio if method != "none" else c.pipeline.ratio
        c.pipeline.rvq_levels = c.pipeline.rvq_levels if method != "none" else 0
        c.seed = seed
    return c


def measure_bytes(config) -> dict:
    """Compile the config's pipelined train step (no training) and read its boundary bytes
    (:func:`sdp_jax.train.families.boundary_bytes`) and, as ``peak_bytes_per_device``, its compiled peak
    (:func:`sdp_jax.costs.memory_stats`, bytes)."""
    import jax  # pylint: disable=g-import-not-at-top


    run = run_lib.resolve(config, jax.device_count())
    builder = loop.make_step(run, loop.make_mesh(run))
    compiled = builder.compiled_train_step(run.family.batch_shapes(run))
    return {**families.boundary_bytes(run, compiled),
            "peak_bytes_per_device": costs.memory_stats(compiled)["peak_bytes_per_device"]}


def aggregate(rows: list[dict]) -> list[dict]:
    """One row per (method, ratio, schedule) over the seeds: ``val_loss`` / ``val_bpb`` are
    means, ``val_losses`` the per-seed values (in ``seeds`` order), ``ortho_err`` the largest."""
    out: dict[tuple, dict] = {}
    for r in rows:
        key = (r["method"], r["ratio"], r.get("schedule", "gpipe"))
        if key not in out:
            out[key] = {**r, "seeds": [], "val_losses": [], "val_bpbs": [], "ortho_errs": []}
        a = out[key]
        a["seeds"].append(r.get("seed"))
        for src, dst in (("val_loss", "val_losses"), ("val_bpb", "val_bpbs"),
                         ("ortho_err", "ortho_errs")):
            if r.get(src) is not None:
                a[dst].append(r[src])
    for a in out.values():
        a.pop("seed", None)
        for src, dst in (("val_loss", "val_losses"), ("val_bpb", "val_bpbs")):
            a[src] = sum(a[dst]) / len(a[dst]) if a[dst] else None
        a["ortho_err"] = max(a["ortho_errs"]) if a["ortho_errs"] else None
    return list(out.values())


def format_table(rows: list[dict]) -> str:
    """Markdown table of :func:`aggregate` rows (loss columns blank for bytes-only rows; with
    several seeds the loss column gives the mean and each seed's value). ``vs none`` compares
    with the ``none`` row of the same schedule; ``vs gpipe`` compares a row's peak with the
    GPipe row of the same method and ratio."""
    def sched(r):
        return r.get("schedule", "gpipe")
    header = ("| method | ratio | r | schedule | boundary bytes/token | vs none | "
              "peak MiB/device | vs gpipe | val loss (nats) | val bits/byte | loss vs none | "
              "max abs(A'A - I) |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = next((o for o in rows if o["method"] == "none" and sched(o) == sched(r)), None)
        gp = next((o for o in rows if (o["method"], o["ratio"], sched(o)) == (
            r["method"], r["ratio"], "gpipe")), None)
        peak = r.get("peak_bytes_per_device")
        peak_s = "" if peak is None else f"{peak / 2**20:.1f}"
        vs_gp = (f"{peak / gp['peak_bytes_per_device']:.3f}x"
                 if peak and gp and gp.get("peak_bytes_per_device") else "")
        vs = f"{r['bytes_per_token'] / base['bytes_per_token']:.3f}x" if base else ""
        loss = r.get("val_loss")
        dl = (f"{100 * (loss / base['val_loss'] - 1):+.2f}%"
              if loss is not None and base and base.get("val_loss") else "")
        ortho, bpb = r.get("ortho_err"), r.get("val_bpb")
        loss_s = "" if loss is None else f"{loss:.4f}"
        if loss is not None and len(r.get("val_losses", [])) > 1:
            loss_s += " (" + ", ".join(f"{v:.4f}" for v in r["val_losses"]) + ")"
        bpb_s = "" if bpb is None else f"{bpb:.4f}"
        ortho_s = "" if ortho is None else f"{ortho:.1e}"
        ratio_s = "-" if r["method"] == "none" else f"{r['ratio']}x"
        name = r["method"] + (f" + RVQ {r['rvq_levels']}" if r.get("rvq_levels") else "")
        lines.append(
            f"| {name} | {ratio_s} | {r['r']} | {sched(r)} | {r['bytes_per_token']:.1f} | {vs} | "
            f"{peak_s} | {vs_gp} | {loss_s} | {bpb_s} | {dl} | {ortho_s} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    """Validation loss (the mean over seeds, a bar over the seeds' range) against boundary bytes
    per token, one marker per method, and the Pareto front (points no other point beats on both
    axes), for :func:`aggregate` rows; written as a PNG to ``path``."""
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

    pts = [r for r in rows if r.get("val_loss") is not None]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    style = {"none": ("k", "s"), "fixed": ("tab:blue", "o"), "unconstrained": ("tab:orange", "^"),
             "mapl": ("tab:green", "D")}
    for m in METHODS:
        sel = [r for r in pts if r["method"] == m]
        if sel:
            c, mk = style[m]
            ax.scatter([r["bytes_per_token"] for r in sel], [r["val_loss"] for r in sel],
                       color=c, marker=mk, label=m, zorder=3)
            for r in sel:  # the seeds' range
                vals = r.get("val_losses") or [r["val_loss"]]
                if len(vals) > 1:
                    ax.vlines(r["bytes_per_token"], min(vals), max(vals), color=c, alpha=0.6)
            for r in sel:
                label = ((f"{r['ratio']}x" if m != "none" else "")
                         + (f" {r['schedule']}" if r.get("schedule", "gpipe") != "gpipe" else ""))
                if label:
                    ax.annotate(label.strip(), (r["bytes_per_token"], r["val_loss"]),
                                textcoords="offset points", xytext=(5, 3), fontsize=8)
    front = sorted((r for r in pts if not any(
        o["bytes_per_token"] <= r["bytes_per_token"] and o["val_loss"] <= r["val_loss"]
        and (o["bytes_per_token"], o["val_loss"]) != (r["bytes_per_token"], r["val_loss"])
        for o in pts)), key=lambda r: r["bytes_per_token"])
    if len(front) > 1:
        ax.plot([r["bytes_per_token"] for r in front], [r["val_loss"] for r in front], "--",
                color="grey", zorder=2, label="Pareto front")
    ax.set_xscale("log")
    ax.set_xlabel("bytes per token crossing a stage boundary (forward + backward)")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


PROG = "python -m sdp_jax.study"
RENAMED = {"bytes-only": "--bytes_only",
           "steps": "--config.steps=N --config.optim.warmup_steps=N/10",
           "rvq-levels": "--config.pipeline.rvq_levels=N",
           "rvq-codebook": "--config.pipeline.rvq_codebook=K"}


def flag_values(argv: list[str] | None = None):
    """The study's flags: ``--config`` (default ``configs/llama_mapl.py``; fields overridden
    as ``--config.FIELD=VALUE``, :mod:`sdp_jax.train.cli`), ``--out``, ``--methods``, ``--ratios``,
    ``--seeds``, ``--schedules``, ``--bytes_only``."""
    from absl import flags  # pylint: disable=g-import-not-at-top

    fv = cli.flag_values(cli.config_file("llama_mapl.py"), argv, PROG)
    flags.DEFINE_string("out", os.path.join("runs", "mapl_study"),
                        "folder of the runs and of study.md / study.json / study.png "
                        "(bytes.md / bytes.json with --bytes_only)", flag_values=fv)
    flags.DEFINE_list("methods", list(METHODS), "boundary methods", flag_values=fv)
    flags.DEFINE_list("ratios", ["4", "8"], "compression ratios d / r", flag_values=fv)
    flags.DEFINE_list("seeds", None, "seeds (initialization and data order), every run once "
                      "per seed; default: the config's seed", flag_values=fv)
    flags.DEFINE_list("schedules", None, "pipeline schedules (gpipe, 1f1b), every method under "
                      "each; default: the config's pipeline.schedule", flag_values=fv)
    flags.DEFINE_boolean("bytes_only", False, "compile and measure boundary bytes; train "
                         "nothing", flag_values=fv)
    return fv


def _err(msg: str) -> NoReturn:
    """Exit with status 2 and ``PROG: error: msg`` on stderr (:func:`sdp_jax.train.cli.error`)."""
    cli.error(PROG, msg)


def main(argv=None, check_only: bool = False) -> list[dict]:
    """The MAPL study's command line (``argv`` without the program name and the subcommand;
    default ``sys.argv[1:]``; ``python -m sdp_jax.study`` dispatches to it). Returns one row
    per run; a bad flag or config exits with status 2 and a one-line error before any compile
    or training. ``check_only``: stop after the
    validation (the documentation check, ``tests/test_docs.py``)."""
    args = sys.argv[1:] if argv is None else list(argv)
    fv = cli.command_flags(flag_values, [PROG] + args, PROG, __doc__, "--ratios=4,8",
                           RENAMED)
    methods, ratios, seeds, schedules = _settings(fv)
    mesh_lib.simulate_cpu_devices(fv.config.num_cpu_devices)   # before JAX starts
    configs = _validate_runs(fv, methods, ratios, seeds, schedules)
    bench.out_folder(PROG, fv.out)  # validated: now the folder, before any compile
    if check_only:
        return []
    rows = _measure_and_train(configs, fv.out, fv.bytes_only)
    _write(rows, fv.out, fv.bytes_only, configs, len(seeds))
    return rows


def _settings(fv) -> tuple[list, list, list, list]:
    """``(methods, ratios, seeds, schedules)`` of the flags (seeds: default the config's seed;
    schedules: default the config's ``pipeline.schedule``, validated with the config later);
    a bad value exits with status 2 and a one-line error."""
    config = fv.config
    methods = [m for m in fv.methods if m]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        _err(f"--methods={','.join(fv.methods)!r}: choose one or more of {', '.join(METHODS)}")
    try:
        ratios = [int(r) for r in fv.ratios if r]
    except ValueError:
        _err(f"--ratios={','.join(fv.ratios)!r} must be integers like 4,8,16")
    seeds = cli.seeds(PROG, fv.seeds) if fv.seeds is not None else [config.seed]
    # (without --schedules the config's own schedule, which resolve() validates below)
    schedules = ([x for x in fv.schedules if x] if fv.schedules is not None
                 else [config.pipeline.schedule])
    if fv.schedules is not None:
        if config.pipeline.schedule not in SCHEDULES:   # replaced, but a mistake all the same
            _err(f"--config.pipeline.schedule={config.pipeline.schedule!r}: choose "
                 f"{' or '.join(SCHEDULES)} (or leave it to --schedules)")
        bad = [x for x in schedules if x not in SCHEDULES]
        if bad or not schedules or len(set(schedules)) != len(schedules):
            _err(f"--schedules={','.join(fv.schedules)!r}"
                 + (f": unknown {', '.join(map(repr, bad))}" if bad else "")
                 + f"; give distinct schedules from {', '.join(SCHEDULES)}, e.g. gpipe,1f1b")
    return methods, ratios, seeds, schedules


def _validate_runs(fv, methods, ratios, seeds, schedules) -> dict:
    """Every run's config (``{(method, ratio, seed, schedule): config}``, in run order; with
    ``--bytes_only`` the first seed's only), validated on the devices present (the config's
    ``num_cpu_devices`` on a CPU) and (when training) its run folder, before any compile or training; an
    error exits with status 2 and a one-line error naming the run."""
    import jax  # pylint: disable=g-import-not-at-top

    configs = {}
    for seed in seeds[:1] if fv.bytes_only else seeds:
        for (m, r), sc in itertools.product(_runs(methods, ratios), schedules):
            # all validated before any compile or training
            c = _with(fv.config, m, r, seed, sc)
            where = _run_dir(fv.out, m, r, seed, sc)
            run = (f"{m}" + (f" at {r}x" if m != "none" else "") + f", seed {seed}"
                   + (f", {sc}" if len(schedules) > 1 else ""))
            try:
                resolved = run_lib.resolve(c, jax.device_count())
            except ValueError as e:
                _err(f"{run}: {e}".replace("--config.pipeline.ratio", "--ratios"))
            try:
                if not fv.bytes_only:
                    loop.check_workdir(c, where, resolved)
            except ValueError as e:
                _err(f"{run}: {e} (The study's run folder is {where}: use another --out, or "
                     "the flags that wrote it.)")
            configs[m, r, seed, sc] = c
    return configs


def _measure_and_train(configs: dict, out: str, bytes_only: bool) -> list[dict]:
    """One row per run of ``configs``: its settings, boundary bytes (:func:`measure_bytes`,
    compiled once per method, ratio and schedule) and, unless ``bytes_only``, the trained
    run's final ``val_loss``, ``val_bpb``, ``ortho_err`` and ``wall_s``. A run stopped before
    its end exits: 128 + the signal number, else 1."""
    rows, measured = [], {}
    for (m, r, seed, sc), c in configs.items():
        d = c.model.d_model
        row = {"method": m, "ratio": r if m != "none" else 1, "seed": c.seed, "schedule": sc,
               "rvq_levels": c.pipeline.rvq_levels,
               "r": d // r if m != "none" else d, "d_model": d,
               "stages": c.pipeline.stages, "microbatches": c.pipeline.microbatches,
               "workers": c.workers, "steps": c.steps,
               "tokens": c.steps * c.workers * c.batch_per_worker * c.seq_len}
        if (m, r, sc) not in measured:  # the same program for every seed
            loop.log(f"study: compiling {m}" + (f" at {r}x" if m != "none" else "")
                     + f" ({sc}) for its boundary bytes")
            measured[m, r, sc] = measure_bytes(c)
        b = measured[m, r, sc]
        row["bytes_per_token"] = b["per_token"]
        row["bytes_per_step"] = b["per_boundary"]
        row["peak_bytes_per_device"] = b["peak_bytes_per_device"]
        if not bytes_only:
            loop.log(f"study: training {m}" + (f" at {r}x" if m != "none" else "")
                     + f", seed {seed}")
            s = loop.train(c, _run_dir(out, m, r, seed, sc))
            if not s.get("completed"):
                print(f"study stopped during {m} {r}x ({sc}); rerun the same command to resume.",
                      file=sys.stderr)
                sig = s.get("interrupted_by")
                sys.exit(128 + int(getattr(signal, sig)) if sig else 1)
            row.update(val_loss=s["final_val_loss"], val_bpb=s["final_val_bpb"],
                       ortho_err=s.get("final_ortho_err"), wall_s=s["wall_s"])
        rows.append(row)
    return rows


def _write(rows: list[dict], out: str, bytes_only: bool, configs: dict, n_seeds: int) -> None:
    """Print the table of ``rows`` and write ``study.json`` / ``study.md`` and ``study.png``
    (``bytes.json`` / ``bytes.md`` with ``bytes_only``) to ``out``; the plot's title names
    the model of the first run of ``configs`` and ``n_seeds``."""
    table = format_table(aggregate(rows))
    print(table)
    name = "bytes" if bytes_only else "study"  # bytes-only never replaces a study's table
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(rows, f, indent=2)  # one row per run
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(table + "\n")
    loop.log(f"wrote {os.path.join(out, name)}.md and .json"
             + ("" if bytes_only else " and study.png"))
    if not bytes_only:
        c0 = next(iter(configs.values()))
        plot(aggregate(rows), os.path.join(out, "study.png"),
             f"LLaMA d={c0.model.d_model}, {c0.model.n_layers} blocks, {c0.pipeline.stages} "
             f"stages, {rows[0]['tokens'] / 1e6:.2f}M tokens per run, "
             f"{n_seeds} seed{'s' if n_seeds > 1 else ''}")

"""Per-device memory, communication, FLOPs and step time of compiled train steps.

    python -m sdp_jax.bench --config configs/llama_1b.py --variants ddp,b-sdp \\
        --config.workers=8 --config.sdp.coverage=0.6875 --config.dtype=bf16 \\
        --config.fsdp=True --config.remat=full --json out.json
    python -m sdp_jax.bench --config configs/llama_tiny.py --variants ddp,b-sdp \\
        --config.sdp.coverage=0.5 --measure_time
    python -m sdp_jax.bench --paper --out runs/paper
    python -m sdp_jax.bench --config configs/resnet18_cifar.py --variants ddp,n-sdp \\
        --config.sdp.coverage=0.5

The config is loaded as ``train.py`` loads it (:mod:`sdp_jax.train.cli`: ``--config`` file, any field
overridden as ``--config.FIELD=VALUE``) and validated by the same code before any compile; the
SDP variants of ``--variants`` run at ``config.sdp.coverage`` (DDP at C = 1) on
``config.workers`` devices (0: 8).

For each variant the train step is lowered for abstract inputs (``jax.ShapeDtypeStruct`` with
shardings: no parameter is materialized) on a mesh of ``W`` devices (simulated CPU
devices when no accelerator is present) and compiled:

* memory: ``compiled.memory_analysis()``: argument, output, alias and temporary bytes per device;
  peak = argument + temp + output - alias (the state is donated, so its output aliases its input);
* communication: every collective of the compiled per-device program with its loop trip counts
  (:mod:`sdp_jax.costs.comm`), in bus bytes (nccl-tests convention: all-reduce ``2 (n-1)/n`` of its
  buffer, all-gather / reduce-scatter / all-to-all ``(n-1)/n`` of the full buffer);
* FLOPs: ``compiled.cost_analysis()`` of a second compile with the block scan unrolled;
* ``--measure_time``: a few real steps on random tokens, median wall time per step, all variants
  side by side in one process.
* ``--reference``: a row for plain ``jax.jit`` DDP of the same model, loss and optimizer
  (:mod:`sdp_jax.bench.jit_reference`; not the averaging ``--config.sdp.method=reference``) and every
  row's ratios to it; with ``b-sdp`` among the variants also one for plain jit of the model cut
  to the ``k`` blocks a B-SDP worker runs (what B-SDP's step cannot beat: the embedding, head
  and loss are not pruned), and B-SDP's step time against it.

``--fit --budget_gib=40,24``: for each variant x ``--fit_remat`` x ``--fit_fsdp`` (default: the
config's remat and FSDP), the train step compiled at every realizable coverage, largest first
(:func:`sdp_jax.train.fit.scan`, the measurement ``--config.sdp.coverage=auto`` picks by), as a
table of peaks per device, and the largest ``C`` that fits each budget (GiB per device)::

    python -m sdp_jax.bench --fit --budget_gib=40,24 --config configs/llama_1b.py \\
        --variants b-sdp,n-sdp --fit_remat none,full --fit_fsdp false,true

``--paper`` reproduces the memory and communication comparison of Singh et al. (arXiv
2507.09029, Sec. 5, 1B model on 8 GPUs): DDP, FSDP + AC, B-SDP C = 0.6875 and B-SDP + FSDP + AC
at ``llama_1b``, bf16, 8 workers; it writes ``paper_table.md``, ``paper_chart.png`` and
``paper_rows.json`` to ``--out``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from typing import NoReturn

from sdp_jax import mesh as mesh_lib
from sdp_jax.bench import jit_reference as reference
from sdp_jax.costs import comm
from sdp_jax.costs import program as costs
from sdp_jax.models import llama
from sdp_jax.models.llama import LlamaConfig
from sdp_jax.options import MeshShape, StepOptions
from sdp_jax.spec import sdp_spec as spec_lib
from sdp_jax.spec.sdp_spec import BLOCK
from sdp_jax.train import cli, families, fit
from sdp_jax.train import optimizer as optim_lib
from sdp_jax.train import run as run_lib
from sdp_jax.train.run import resolve

# Singh et al., arXiv 2507.09029, Sec. 5 (LLaMA 1B, 8 GPUs): per-device peak memory (GB) and bytes
# communicated per step (MB), as printed in the paper; None where the paper gives no figure.
PAPER = {
    "DDP": {"memory_gb": 70.9, "comm_mb": 3143.0},
    "FSDP + AC": {"memory_gb": 11.0, "comm_mb": None},
    # the paper states B-SDP's memory at 1B only as a saving: 28% less than DDP
    "B-SDP C=0.6875": {"memory_gb": None, "memory_vs_ddp": 0.72, "comm_mb": 2253.0},
    "B-SDP + FSDP + AC": {"memory_gb": 9.7, "comm_mb": None},
}
PAPER_SETTINGS = (  # label, variant, fsdp, remat
    ("DDP", "ddp", False, "none"),
    ("FSDP + AC", "ddp", True, "full"),
    ("B-SDP C=0.6875", "b-sdp", False, "none"),
    ("B-SDP + FSDP + AC", "b-sdp", True, "full"),
)


def _plan(config, variant, workers, coverage):
    """(the variant's spec at ``coverage``, whether its masks are uniform)."""

    model, sdp = LlamaConfig.from_config(config.model), config.sdp
    apart = bool(sdp.get("allow_disconnected", False))   # (as the run's config allows)
    try:
        return llama.make_plan(variant, model, workers, coverage, sdp.scheme, sdp.mask_seed,
                               allow_disconnected=apart), True
    except ValueError:  # e.g. W*C = 5.5 at 1B: near-uniform masks, as in the paper
        return llama.make_plan(variant, model, workers, coverage, sdp.scheme, sdp.mask_seed,
                               allow_nonuniform=True, allow_disconnected=apart), False


def lm_step(config, variant, workers, coverage, mesh, *, fsdp, remat, dtype, unroll=False,
            emulate_workers=False):
    """``(the LLaMA train step of config's model, optimizer and averaging method for one
    variant, whether its masks are uniform)`` (:func:`sdp_jax.train.families.language_model_step`;
    ``unroll``: the block scan unrolled, for the FLOP count; ``emulate_workers``: the workers
    on one device, ``mesh`` from ``sdp_jax.mesh.make_mesh(W, emulated=True)``)."""
    model = LlamaConfig.from_config(config.model)
    optim = optim_lib.OptimConfig.from_config(config.optim)
    plan, uniform = _plan(config, variant, workers, coverage)
    b = families.language_model_step(model, plan, optim, mesh,
                                     step_options(config, fsdp=fsdp, remat=remat, dtype=dtype,
                                                  unroll=unroll, emulate_workers=emulate_workers))
    return b, uniform


def step_options(config, **changes) -> StepOptions:
    """The step options of ``config`` (:meth:`sdp_jax.options.StepOptions.from_config`, the
    schedule over ``config.steps``) with the bench's ``changes``; a bench row averages
    gradients every step."""
    options = StepOptions.from_config(config, total_steps=config.steps)
    return dataclasses.replace(options, average="gradients", sync_every=1, **changes)


def setting_name(variant: str, fsdp: bool, remat: str) -> str:
    """Row label, e.g. ``b-sdp+fsdp+ac`` (``ac``: full remat, ``ac-dots``: save matmuls)."""
    return variant + ("+fsdp" if fsdp else "") + {"none": "", "full": "+ac", "dots": "+ac-dots"}[
        remat]


def measure(config, variant: str, workers: int, coverage: float, mesh, *, fsdp: bool = False,
            remat: str = "none", dtype: str = "float32", flops: bool = True) -> dict:
    """Compile one variant's train step and read its per-device memory, communication, FLOPs.

    Returns:
      row dict: ``variant``, ``setting``, ``fsdp``, ``remat``, ``dtype``, ``attention``,
      ``regime``,
      ``coverage``, ``workers``, ``held_per_worker``, ``argument_bytes``, ``output_bytes``,
      ``alias_bytes``, ``temp_bytes``, ``peak_bytes_per_device`` (bytes),
      ``comm_bytes_per_device`` (bus bytes per step, loop trip counts included),
      ``comm_by_op`` (bytes per collective kind), ``comm_by_axis`` (the same bytes by the mesh
      axes each collective spans, e.g. ``{"data": ...}``: the bytes on each kind of link,
      :func:`sdp_jax.costs.comm.comm_bytes_per_device`), ``comm_in_backward_loop`` (the part of
      ``comm_bytes_per_device`` issued inside the backward pass's block loop, which can overlap
      with its compute; the rest runs after it), ``flops_per_device`` (FLOPs per step, XLA's
      count on the unrolled program; None with ``flops=False``), ``model_flops_per_device``
      (ddp and b-sdp: ``6N + 12 L T d`` per token times the worker's tokens),
      ``params_per_device``, ``compile_s``.
    """

    t0 = time.time()
    builder, uniform = lm_step(config, variant, workers, coverage, mesh, fsdp=fsdp, remat=remat,
                                dtype=dtype)
    figures = _figures(config, builder, workers, flops, lambda: lm_step(
        config, variant, workers, coverage, mesh, fsdp=fsdp, remat=remat, dtype=dtype,
        unroll=True)[0])
    plan = builder.spec
    tokens = config.batch_per_worker * config.seq_len
    return {"variant": variant, "setting": setting_name(variant, fsdp, remat), "fsdp": fsdp,
            "remat": remat, "dtype": dtype, "attention": config.model.attention,
            "grad_accum": config.get("grad_accum", 1),
            "regime": plan.regime, "coverage": plan.coverage,
            "workers": workers,
            "held_per_worker": fit.held(plan),
            "uniform": uniform, **figures,
            "model_flops_per_device": (
                llama.model_flops_per_token(LlamaConfig.from_config(config.model), config.seq_len,
                                         plan.kinds["block"].k) * tokens
                if variant in ("ddp", "b-sdp") else None),
            "params_per_device": builder.per_device_param_count(),
            "compile_s": round(time.time() - t0, 1)}


def _figures(config, builder, workers: int, flops: bool, unrolled) -> dict:
    """Memory, communication and (``flops``) FLOP fields of a row, from ``builder``'s train
    step compiled for the config's global batch; ``unrolled()`` builds the same step with the
    block scan unrolled, compiled for the FLOP count (XLA's cost analysis counts a loop body
    once)."""

    import jax
    import numpy as np

    batch_shape = jax.ShapeDtypeStruct((workers * config.batch_per_worker, config.seq_len + 1),
                                       np.int32)
    compiled = builder.compiled_train_step(batch_shape)
    traffic = comm.comm_bytes_per_device(compiled.as_text(), builder.mesh.devices.size,
                                         dict(builder.mesh.shape))
    return {**costs.memory_stats(compiled), "comm_bytes_per_device": traffic["total"],
            "comm_by_op": {k: v for k, v in traffic["by_op"].items() if v},
            "comm_by_axis": traffic["by_axis"],
            "comm_in_backward_loop": traffic["in_backward_loop"],
            "flops_per_device": _count_flops(unrolled, batch_shape) if flops else None}


def _count_flops(unrolled, batch_shape) -> float:
    """FLOPs per device of one step (XLA's count on the program ``unrolled()`` builds). Where
    a worker's unheld blocks skip their weight gradients (``bb-sdp`` with activation
    checkpointing, :func:`sdp_jax.step.runner.held_weight_grads`), XLA counts each block's
    conditional as its costliest branch; the step is then counted twice, every block taking
    the held branch (``F_h``) and every block the other (``F_u``), and a worker holding ``k``
    of ``L`` blocks does ``F_u + (k / L) (F_h - F_u)`` (the blocks are alike and each branch's
    cost is the same in every block)."""

    def count(b, branch):
        return costs.flops_per_device(b.compiled_train_step(batch_shape, count_branch=branch))
    b = unrolled()
    if not b.skips_unheld():   # no conditional blocks (the plain-jit reference has none)
        return costs.flops_per_device(b.compiled_train_step(batch_shape))
    held, unheld = count(b, True), count(unrolled(), False)
    return unheld + b.spec.kinds[BLOCK].k / b.spec.n_blocks * (held - unheld)


def reference_step(config, mesh, remat: str, dtype: str, unroll: bool = False,
                   blocks: int | None = None):
    """The plain-jit DDP step (:class:`sdp_jax.bench.jit_reference.JitDDP`) of config's model
    and optimizer, or of the model cut to ``blocks`` blocks."""

    model = LlamaConfig.from_config(config.model)
    if blocks is not None:
        model = dataclasses.replace(model, n_layers=blocks)
    return reference.JitDDP(model, optim_lib.OptimConfig.from_config(config.optim), mesh,
                            step_options(config, remat=remat, dtype=dtype, unroll=unroll))


def measure_reference(config, workers: int, mesh, *, remat: str = "none",
                      dtype: str = "float32", flops: bool = True,
                      blocks: int | None = None) -> dict:
    """:func:`measure` for the plain ``jax.jit`` DDP reference (:mod:`sdp_jax.bench.jit_reference`):
    the same row fields, ``variant`` ``jit-ddp``, ``regime`` ``jit``. ``blocks``: the same
    model cut to that many blocks (the plain-jit model of the subnetwork a B-SDP worker runs;
    setting ``jit-ddp k/L``, field ``blocks``); None: all of them."""

    t0 = time.time()
    builder = reference_step(config, mesh, remat, dtype, blocks=blocks)
    figures = _figures(config, builder, workers, flops,
                       lambda: reference_step(config, mesh, remat, dtype, unroll=True,
                                          blocks=blocks))
    model = builder.cfg
    setting = setting_name(reference.LABEL, False, remat)
    if blocks is not None:
        setting += f" {blocks}/{config.model.n_layers}"
    return {"variant": reference.LABEL, "setting": setting, "blocks": blocks,
            "fsdp": False, "remat": remat, "dtype": dtype, "attention": config.model.attention,
            "regime": "jit", "coverage": 1.0,
            "workers": workers, "held_per_worker": "all", "uniform": True, **figures,
            "model_flops_per_device": llama.model_flops_per_token(model, config.seq_len)
            * config.batch_per_worker * config.seq_len,
            "params_per_device": builder.per_device_param_count(),
            "compile_s": round(time.time() - t0, 1)}


def measure_vision(config, variant: str, workers: int, coverage: float, mesh, *,
                   dtype: str = "float32", flops: bool = True, remat: str = "none",
                   fsdp: bool = False) -> dict:
    """:func:`measure` for a vision config (ResNet-18, WRN-18, Swin-T): one compile of the
    train step at ``config.batch_per_worker`` images per worker; the same row fields (FSDP
    gathers the whole model at the start of the step, see :class:`sdp_jax.step.SDPStep`;
    ``remat``: ``none`` or ``full``; without checkpointing the blocks are unrolled, so one
    compile gives FLOPs too; with it a second compile with the block scans unrolled does).
    Near-uniform masks are used when ``W * C`` is not whole for some stage (``uniform``
    False)."""

    def variant_run(nonuniform: bool):
        c = _variant_config(config, variant, coverage, workers, nonuniform)
        with c.unlocked():
            c.dtype, c.remat, c.fsdp = dtype, remat, fsdp
        return resolve(c, workers * MeshShape.from_config(c).devices)

    t0 = time.time()
    try:
        run = variant_run(False)
        uniform = True
    except ValueError:
        run = variant_run(True)
        uniform = False
    builder = run.family.step(run, mesh)   # the run's own step (the vision family's)
    compiled = builder.compiled_train_step(run.family.batch_shapes(run))
    counted = compiled
    if flops and remat == "full":   # checkpointed blocks run under scans: count them unrolled
        counted = run.family.step(run, mesh, unroll=True).compiled_train_step(
            run.family.batch_shapes(run))
    traffic = comm.comm_bytes_per_device(compiled.as_text(), workers, dict(mesh.shape))
    kinds = run.plan.summary()["kinds"]
    held = ", ".join(f"{v['per_worker']}/{v['components']} {k}" for k, v in kinds.items()
                     if variant != "ddp")
    if variant in ("n-sdp", "nb-sdp"):  # one entry per kind: held / count in every stage
        per: dict = {}
        for k, v in kinds.items():
            per.setdefault(k.split(".", 1)[1], []).append(f"{v['per_worker']}/{v['components']}")
        held = "; ".join(f"{kind} {' '.join(x)}" for kind, x in per.items())
    return {"variant": variant, "setting": setting_name(variant, fsdp, remat), "fsdp": fsdp,
            "remat": remat,
            "dtype": dtype, "regime": run.plan.regime, "coverage": run.plan.coverage,
            "workers": workers, "held_per_worker": held or "all", "uniform": uniform,
            **costs.memory_stats(compiled), "comm_bytes_per_device": traffic["total"],
            "comm_by_op": {k: v for k, v in traffic["by_op"].items() if v},
            "comm_by_axis": traffic["by_axis"],
            "comm_in_backward_loop": traffic["in_backward_loop"],
            "flops_per_device": costs.flops_per_device(counted) if flops else None,
            "model_flops_per_device": None,
            "params_per_device": builder.per_device_param_count(),
            "compile_s": round(time.time() - t0, 1)}


def time_steps(config, runs: list[dict], workers: int, mesh, *, fsdp=False, remat="none",
               dtype="float32", steps: int = 10, warmup: int = 2) -> list[list[float]]:
    """Wall seconds of real train steps on random tokens for several variants, interleaved
    (:func:`time_interleaved`).

    Args:
      runs: dicts with ``variant`` (``jit-ddp``: the plain-jit reference) and ``coverage``.
      steps: timed steps per variant, after ``warmup`` untimed ones (which include the compile).
    Returns:
      per run, the list of step times in seconds."""
    jobs = []
    for run in runs:
        if run["variant"] == reference.LABEL:
            builder = reference_step(config, mesh, remat, dtype, blocks=run.get("blocks"))
        else:
            builder, _ = lm_step(config, run["variant"], workers, run["coverage"], mesh,
                                  fsdp=fsdp, remat=remat, dtype=dtype)
        jobs.append(timing_job(builder, random_tokens(config, workers, builder)))
    return time_interleaved(jobs, steps, warmup)


def random_tokens(config, workers: int, builder, seed: int = 0):
    """A global batch of random tokens, int32 ``[W b, T + 1]`` (``config``'s vocabulary,
    ``batch_per_worker`` and ``seq_len``), placed as ``builder``'s batches are."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, config.model.vocab_size,
                          (workers * config.batch_per_worker, config.seq_len + 1))
    return jax.device_put(jnp.asarray(tokens, jnp.int32), builder.batch_sharding())


def timing_job(builder, batch, step=None) -> list:
    """One program of :func:`time_interleaved`: its train step (``builder.train_step_fn()``,
    or ``step``, e.g. the step compiled ahead of time), a fresh state (seed 0) and the batch
    it steps on."""
    return [step or builder.train_step_fn(), builder.init_state(seed=0), batch, []]


def time_interleaved(jobs: list, steps: int, warmup: int) -> list[list[float]]:
    """Wall seconds of ``steps`` train steps of each job (:func:`timing_job`), after
    ``warmup`` untimed ones (which include the compile), interleaved: one step of each in
    turn, so that load from other processes hits all of them alike; each round starts with the
    next job, so that none always runs first. Each step is waited for before the next is
    dispatched (one step in flight, see docs/design.md on the CPU backend).

    Returns:
      per job, the list of its step times in seconds."""
    import jax

    for i in range(warmup + steps):   # round i starts at job i mod n: no job always first
        for job in jobs[i % len(jobs):] + jobs[:i % len(jobs)]:
            step, state, batch, times = job
            t0 = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            job[1] = state
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    return [job[3] for job in jobs]


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _flops(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale or unit == "MFLOP":
            return f"{n / scale:.3f} {unit}"
    return str(n)


def _baseline(rows: list[dict], r: dict) -> dict | None:
    """The DDP row a row is compared with: DDP with the same FSDP / remat setting if present,
    else the first DDP row."""
    same = [b for b in rows if b["variant"] == "ddp" and b["fsdp"] == r["fsdp"]
            and b["remat"] == r["remat"]]
    anyd = [b for b in rows if b["variant"] == "ddp"]
    return (same or anyd or [None])[0]


def _ratio(a, b) -> str:
    return f"{a / b:.3f}" if (a is not None and b) else "-"


def format_table(rows: list[dict]) -> str:
    """Markdown table of bench rows with ratios to the matching DDP row (if present);
    ``in bwd loop``: the share of the row's bus bytes issued inside the backward loop."""
    timed = any("step_time_s" in r for r in rows)
    head = ("| setting | C | W | held per worker | argument | temp | peak/device | peak / DDP | "
            "comm/device | comm / DDP | in bwd loop | FLOPs/device | FLOPs / DDP |"
            + (" step time | time / DDP |" if timed else ""))
    lines = [head, "|" + "---|" * (13 + 2 * timed)]
    for r in rows:
        b = _baseline(rows, r) or {}
        line = (f"| {r['setting']} | {r['coverage']:.4g} | {r['workers']} | "
                f"{r['held_per_worker']} | {_bytes(r['argument_bytes'])} | "
                f"{_bytes(r['temp_bytes'])} | {_bytes(r['peak_bytes_per_device'])} | "
                f"{_ratio(r['peak_bytes_per_device'], b.get('peak_bytes_per_device'))} | "
                f"{_bytes(r['comm_bytes_per_device'])} | "
                f"{_ratio(r['comm_bytes_per_device'], b.get('comm_bytes_per_device'))} | "
                f"{_ratio(r.get('comm_in_backward_loop'), r['comm_bytes_per_device'])} | "
                f"{_flops(r['flops_per_device'])} | "
                f"{_ratio(r['flops_per_device'], b.get('flops_per_device'))} |")
        if timed:
            line += (f" {r['step_time_s'] * 1e3:.1f} ms | "
                     f"{_ratio(r['step_time_s'], b.get('step_time_s'))} |")
        lines.append(line)
    return "\n".join(lines)


def axis_lines(rows: list[dict]) -> list[str]:
    """One line per row on a mesh with axes besides ``data`` (workers of several devices):
    its collective bytes per device per step by the mesh axes each group spans
    (``comm_by_axis``, :func:`sdp_jax.costs.comm.comm_bytes_per_device`), in MiB."""
    out = []
    for r in rows:
        axes = r.get("comm_by_axis") or {}
        if set(axes) - {"data"}:
            shown = ", ".join(f"{a} {v / 2**20:.2f}" for a, v in axes.items())
            out.append(f"comm by mesh axis, {r['setting']}: {shown} MiB per device per step")
    return out


def paired_ratio(times: list[float], base: list[float]) -> float:
    """Median over rounds of ``times[i] / base[i]``: step ``i`` of two variants timed in the
    same round of :func:`time_steps`, so that load which changes between rounds cancels in each
    ratio (a paired comparison; it can differ from the ratio of the medians).

    Raises:
      ValueError: the lists differ in length or are empty."""
    if len(times) != len(base) or not times:
        raise ValueError(f"paired_ratio: {len(times)} and {len(base)} step times; pass the "
                         "step_times_s of two rows timed together.")
    return statistics.median(a / b for a, b in zip(times, base))


def reference_lines(rows: list[dict]) -> list[str]:
    """One line per row against the plain-jit DDP row (``jit-ddp``), if present: ratios of
    peak memory, bytes communicated, FLOPs and (timed) step time, each ours / jit; the step
    time as :func:`paired_ratio` (and the ratio of the medians beside it)."""
    ref = next((r for r in rows if r["variant"] == reference.LABEL and r.get("blocks") is None),
               None)
    if ref is None:
        return []
    sub = next((r for r in rows if r["variant"] == reference.LABEL and r.get("blocks")), None)
    out = []
    for r in rows:
        if r is ref:
            continue
        parts = [f"peak {_ratio(r['peak_bytes_per_device'], ref['peak_bytes_per_device'])}",
                 f"comm {_ratio(r['comm_bytes_per_device'], ref['comm_bytes_per_device'])}",
                 f"FLOPs {_ratio(r['flops_per_device'], ref['flops_per_device'])}"]
        if "step_time_s" in r and "step_time_s" in ref:
            parts.append(f"step time {paired_ratio(r['step_times_s'], ref['step_times_s']):.3f} "
                         f"(median over {len(r['step_times_s'])} rounds of the ratio within a "
                         f"round; ratio of the medians "
                         f"{_ratio(r['step_time_s'], ref['step_time_s'])})")
        out.append(f"{r['setting']} / {ref['setting']}: " + ", ".join(parts))
        if sub is not None and r["variant"] == "b-sdp" and "step_time_s" in sub \
                and "step_time_s" in r:
            out.append(f"{r['setting']} / {sub['setting']} (plain jit of a worker's blocks): "
                       f"step time {paired_ratio(r['step_times_s'], sub['step_times_s']):.3f}")
    return out


def paper_table(rows: list[dict]) -> str:
    """Markdown: our ``--paper`` rows next to the paper's figures, with ratios to DDP."""
    ours = {r["label"]: r for r in rows}
    ddp = ours["DDP"]
    lines = ["| setting | peak memory / device | vs DDP | paper | paper vs DDP | "
             "comm / device / step | vs DDP | paper | paper vs DDP |", "|" + "---|" * 9]
    for label, *_ in PAPER_SETTINGS:
        r, p, pd = ours[label], PAPER[label], PAPER["DDP"]
        mem, com = r["peak_bytes_per_device"], r["comm_bytes_per_device"]

        def paper(v, unit, base, ratio=None):
            if v is None:
                return "-", (f"{ratio:.2f}" if ratio else "-")
            return f"{v:,.1f} {unit}", f"{v / base:.3f}"
        pm, pmr = paper(p["memory_gb"], "GB", pd["memory_gb"], p.get("memory_vs_ddp"))
        pc, pcr = paper(p["comm_mb"], "MB", pd["comm_mb"])
        lines.append(f"| {label} | {mem / 2**30:.2f} GiB | {mem / ddp['peak_bytes_per_device']:.3f}"
                     f" | {pm} | {pmr} | {com / 2**20:,.0f} MiB | "
                     f"{com / ddp['comm_bytes_per_device']:.3f} | {pc} | {pcr} |")
    fa, fb = ours["FSDP + AC"], ours["B-SDP + FSDP + AC"]
    lines.append("")
    lines.append(f"B-SDP + FSDP + AC vs FSDP + AC: peak memory "
                 f"{fb['peak_bytes_per_device'] / fa['peak_bytes_per_device']:.3f} (paper "
                 f"{PAPER['B-SDP + FSDP + AC']['memory_gb'] / PAPER['FSDP + AC']['memory_gb']:.3f}"
                 "),"
                 f" communication "
                 f"{fb['comm_bytes_per_device'] / fa['comm_bytes_per_device']:.3f}.")
    return "\n".join(lines)


def paper_chart(rows: list[dict], path: str, title: str = "LLaMA 1B") -> None:
    """Bar chart PNG: peak memory and communication per device, ours (ratio to our DDP) next to
    the paper's (ratio to its DDP). Needs matplotlib (``pip install -e '.[bench]'``).

    Raises:
      ImportError: matplotlib is missing (with the install command).
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("--paper draws its chart with matplotlib: pip install -e '.[bench]'"
                          ) from e
    ours = {r["label"]: r for r in rows}
    labels = [s[0] for s in PAPER_SETTINGS]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, pkey, panel in (
            (axes[0], "peak_bytes_per_device", "memory_gb", "peak memory per device"),
            (axes[1], "comm_bytes_per_device", "comm_mb", "bytes communicated per device, step")):
        base = ours["DDP"][key]
        mine = [ours[lab][key] / base for lab in labels]
        paper = [(PAPER[lab][pkey] / PAPER["DDP"][pkey]) if PAPER[lab][pkey]
                 else PAPER[lab].get("memory_vs_ddp" if pkey == "memory_gb" else "", 0.0)
                 for lab in labels]
        x = range(len(labels))
        ax.bar([i - 0.2 for i in x], mine, 0.4, label="sdp_jax (compiled, CPU)")
        ax.bar([i + 0.2 for i in x], paper, 0.4, label="paper (Singh et al., 8 GPUs)")
        for i, (m, p) in enumerate(zip(mine, paper)):
            ax.text(i - 0.2, m, f"{m:.2f}", ha="center", va="bottom", fontsize=8)
            ax.text(i + 0.2, p, f"{p:.2f}" if p else "n/a", ha="center", va="bottom",
                    fontsize=8)
        ax.set_xticks(list(x), labels, rotation=15, fontsize=8)
        ax.set_ylabel("ratio to DDP")
        ax.set_title(panel)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{title}: SDP composed with FSDP and activation checkpointing")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def paper_check(config, workers: int = 8) -> None:
    """Raise ValueError, before any compile, unless the paper's B-SDP C = 0.6875 is realizable
    for the config's language model on ``workers`` workers."""

    if _is_vision(config) or config.get("pipeline", {}).get("stages", 1) > 1:
        raise ValueError("--paper compares unpipelined LLaMA runs (configs/llama_1b.py); give "
                         "a language-model config without pipeline stages.")
    try:
        llama.make_plan("b-sdp", LlamaConfig.from_config(config.model), workers, 0.6875,
                     config.sdp.scheme, config.sdp.mask_seed, allow_nonuniform=True)
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"--paper runs B-SDP at the paper's C = 0.6875, which needs 0.6875 x "
                         f"n_layers whole (llama_1b: 16 blocks): {e}") from None


def run_paper(config, config_path: str, out_dir: str, workers: int = 8) -> list[dict]:
    """The ``--paper`` comparison: four compiled settings of ``config`` (``llama_1b``, loaded
    from ``config_path``), bf16, coverage 0.6875; writes table, chart and rows to ``out_dir``.
    Returns the rows.

    Raises:
      ValueError: C = 0.6875 is not realizable for the config's model."""
    import jax

    paper_check(config, workers)
    mesh = _mesh(workers)
    rows = []
    for label, variant, fsdp, remat in PAPER_SETTINGS:
        cov = 1.0 if variant == "ddp" else 0.6875
        row = measure(config, variant, workers, cov, mesh, fsdp=fsdp, remat=remat,
                      dtype="bfloat16", flops=False)
        row["label"] = label
        _add_row(rows, row, label)
    table = paper_table(rows)
    shown = os.path.relpath(config_path) if not os.path.relpath(config_path).startswith("..") \
        else config_path
    header = (f"{shown}, {workers} x {jax.devices()[0].platform}, bf16 compute, batch "
              f"{config.batch_per_worker} x {config.seq_len} tokens per worker; memory in GiB "
              "(2^30 bytes), communication in MiB of bus bytes per device per step.")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "paper_table.md"), "w") as f:
        f.write(header + "\n\n" + table + "\n")
    with open(os.path.join(out_dir, "paper_rows.json"), "w") as f:
        json.dump(rows, f, indent=2)
    name = os.path.splitext(os.path.basename(config_path))[0]
    paper_chart(rows, os.path.join(out_dir, "paper_chart.png"),
                f"{name}, {workers} workers, bf16")
    print(header)
    print(table)
    print(f"wrote {out_dir}/paper_table.md, paper_chart.png, paper_rows.json")
    return rows


PAPER_FILES = ("paper_table.md", "paper_chart.png", "paper_rows.json")


def out_folder(prog: str, path: str, files: tuple = (), overwrite: bool = True) -> None:
    """Create the ``--out`` folder now, or exit with a one-line error (status 2) naming why it
    cannot be; without ``overwrite``, also when it already holds one of ``files`` (the
    repository's own figures in ``docs/bench`` are not rewritten by accident)."""
    there = [f for f in files if os.path.exists(os.path.join(path, f))]
    if there and not overwrite:
        cli.error(prog, f"--out {path!r} already holds {', '.join(there)}; give another --out "
                  "(e.g. runs/paper), or add --overwrite to replace them")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        cli.error(prog, f"--out {path!r}: cannot create the folder ({e.strerror or e})")
    if not os.access(path, os.W_OK):
        cli.error(prog, f"--out {path!r}: the folder is not writable")


def _write_rows(path: str | None, rows: list[dict]) -> None:
    """``--json``: the rows as a JSON list (nothing without a path)."""
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=2)
        print(f"wrote {path}")


def _inner(config) -> str:
    """``"(2 fsdp x 2 tensor) "``: a worker's devices when it spans several (else ``""``)."""
    shape = MeshShape.from_config(config)
    return "" if shape.devices == 1 else f"({shape.fsdp} fsdp x {shape.tensor} tensor) "


def _mesh(workers: int, shape: MeshShape = MeshShape()):
    """The bench's mesh: ``W`` workers of ``F x T`` devices (``config.mesh``)."""
    mesh_lib.simulate_cpu_devices(workers * shape.devices)
    return mesh_lib.make_mesh(workers, fsdp=shape.fsdp, tensor=shape.tensor)


PROG = "python -m sdp_jax.bench"
# Options of the argparse command line before it took configs as train.py does.
RENAMED = {"workers": "--config.workers=N", "coverage": "--config.sdp.coverage=C",
           "batch-per-worker": "--config.batch_per_worker=B", "seq-len": "--config.seq_len=T",
           "fsdp": "--config.fsdp=True", "remat": "--config.remat=full",
           "dtype": "--config.dtype=bfloat16", "method": "--config.sdp.method=M",
           "stage-blocks": '--config.sdp.stage_blocks="(1,1,1,1)"', "no-flops": "--noflops",
           "no-fsdp": "--config.fsdp=False",
           "measure-time": "--measure_time", "time-steps": "--time_steps"}


def flag_values(argv: list[str] | None = None):
    """The bench's flags: ``--config`` (default ``configs/llama_1b.py``; fields overridden as
    ``--config.FIELD=VALUE``, :mod:`sdp_jax.train.cli`), ``--variants``, ``--flops``,
    ``--measure_time``, ``--time_steps``, ``--paper``, ``--out``, ``--json``."""
    from absl import flags
    fv = cli.flag_values(cli.config_file("llama_1b.py"), argv, PROG)
    flags.DEFINE_list("variants", ["ddp", "b-sdp"],
                      "comma-separated: ddp,b-sdp,n-sdp,bb-sdp,nb-sdp (the SDP variants at "
                      "config.sdp.coverage, ddp at C = 1)", flag_values=fv)
    flags.DEFINE_boolean("flops", True, "count FLOPs on a second compile with the block loop "
                         "unrolled (--noflops skips it)", flag_values=fv)
    flags.DEFINE_boolean("measure_time", False, "also run real steps and report the median "
                         "step time (language models)", flag_values=fv)
    flags.DEFINE_integer("time_steps", 50, "timed steps per variant", flag_values=fv)
    flags.DEFINE_boolean("reference", False, "add a row for plain jax.jit DDP of the same model, "
                         "loss and optimizer (sdp_jax/bench/jit_reference.py), and each row's ratios to "
                         "it (language models, without FSDP); with b-sdp also plain jit of the "
                         "k blocks a B-SDP worker runs", flag_values=fv)
    flags.DEFINE_boolean("paper", False, "the paper's 1B comparison (DDP, FSDP+AC, B-SDP, "
                         "B-SDP+FSDP+AC)", flag_values=fv)
    flags.DEFINE_string("out", os.path.join("runs", "paper"), "output folder of --paper",
                        flag_values=fv)
    flags.DEFINE_boolean("fit", False, "compile each variant at every realizable coverage and "
                         "print the peaks per device and the largest C that fits --budget_gib",
                         flag_values=fv)
    flags.DEFINE_list("budget_gib", [], "--fit: budgets in GiB per device, e.g. 40,24",
                      flag_values=fv)
    flags.DEFINE_list("fit_remat", [], "--fit: remat modes, e.g. none,full (default: "
                      "config.remat)", flag_values=fv)
    flags.DEFINE_list("fit_fsdp", [], "--fit: FSDP settings, e.g. false,true (default: "
                      "config.fsdp)", flag_values=fv)
    flags.DEFINE_string("json", None, "write the rows to this JSON file", flag_values=fv)
    flags.DEFINE_boolean("overwrite", False, "replace the files --out or --json name if they "
                         "exist (refused otherwise)", flag_values=fv)
    return fv


def _err(msg: str) -> NoReturn:
    """Exit with status 2 and ``PROG: error: msg`` on stderr (:func:`sdp_jax.train.cli.error`)."""
    cli.error(PROG, msg)


def main(argv=None, check_only: bool = False) -> list[dict]:
    """The bench's command line (``argv`` without the program name; default
    ``sys.argv[1:]``). Returns the rows; a bad flag or config exits with status 2 and a
    one-line error before any compile. ``check_only``: stop after the validation (no compile;
    the documentation check of every shown command, ``tests/test_docs.py``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    fv = cli.command_flags(flag_values, [PROG] + argv, PROG, __doc__,
                           "--variants=ddp,b-sdp", RENAMED)
    config, config_path = fv.config, fv["config"].config_filename
    _check_outputs(fv)
    if fv.paper:
        return _main_paper(fv, argv, check_only)
    settings, budgets = _check_fit(fv, config)
    variants = _check_variants(fv, config, config_path)
    workers, mesh = _validate(config, variants, check_only, settings)
    if check_only:
        return []
    if fv.fit:
        return _main_fit(fv, config, config_path, variants, workers, settings, budgets)
    if _is_vision(config):
        return _main_vision(fv, config, config_path, variants, workers, mesh)
    return _main_lm(fv, config, config_path, variants, workers, mesh)


def _check_outputs(fv) -> None:
    """Exit (status 2, one line) on a bad ``--time_steps`` or a ``--json`` path that cannot be
    written (a folder, a missing or read-only folder, an existing file without
    ``--overwrite``)."""
    if fv.time_steps < 1:
        _err(f"--time_steps={fv.time_steps} must be >= 1")
    if not fv.json:
        return
    folder = os.path.dirname(os.path.abspath(fv.json))
    if os.path.isdir(fv.json):
        _err(f"--json {fv.json!r} is a folder; give a file name, e.g. {fv.json}/rows.json")
    if not os.path.isdir(folder):
        _err(f"--json {fv.json!r}: its folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        _err(f"--json {fv.json!r}: its folder {folder} is not writable")
    if os.path.exists(fv.json) and not fv.overwrite:
        _err(f"--json {fv.json!r} exists; give another file name, or add --overwrite to "
             "replace it")


def _main_paper(fv, argv: list[str], check_only: bool) -> list[dict]:
    """``main`` with ``--paper``: refuse the flags it fixes, check the config, the ``--out``
    folder and matplotlib, then (unless ``check_only``) :func:`run_paper`."""
    fixed = [f"--{k}" for k in ("variants", "measure_time", "json", "flops", "time_steps",
                                "reference") if fv[k].present]
    fixed += [a.split("=", 1)[0] for a in argv if a.startswith("--config.")]
    if fixed:
        _err(f"--paper fixes its own settings (DDP, FSDP + AC, B-SDP C=0.6875, B-SDP + "
             f"FSDP + AC, bf16); drop {', '.join(fixed)}")
    try:
        paper_check(fv.config)
    except ValueError as e:
        _err(str(e))
    out_folder(PROG, fv.out, PAPER_FILES, fv.overwrite)  # before minutes of compiling
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        _err("--paper draws a chart with matplotlib: pip install -e '.[bench]'")
    if check_only:
        return []
    try:
        return run_paper(fv.config, fv["config"].config_filename, fv.out)
    except ValueError as e:
        _err(str(e))


def _check_variants(fv, config, config_path: str) -> list[str]:
    """The variants of ``--variants``, checked against each other and against the config
    (no pipeline stages; ``stage_blocks`` needs a block variant; ``--measure_time`` and
    ``--reference`` need an unsharded language model); exits with status 2 otherwise."""
    if config.get("pipeline", {}).get("stages", 1) > 1:
        _err(f"{config_path} is a pipelined config (pipeline.stages={config.pipeline.stages}); "
             f"its boundary bytes are measured by python -m sdp_jax.study --config "
             f"{config_path} --bytes_only")
    variants = [v.strip() for v in fv.variants if v.strip()]
    if len(set(variants)) != len(variants):
        _err(f"--variants {','.join(fv.variants)!r} names a variant twice")
    bad = [v for v in variants if v not in spec_lib.VARIANTS]
    if bad or not variants:
        _err(f"unknown variants {bad or fv.variants!r}; choose from {','.join(spec_lib.VARIANTS)}")
    if tuple(config.sdp.get("stage_blocks", ()) or ()) and not any(
            v in ("b-sdp", "bb-sdp") for v in variants):
        _err(f"config.sdp.stage_blocks={tuple(config.sdp.stage_blocks)} applies to the block "
             f"variants b-sdp and bb-sdp; none is in --variants {','.join(variants)}")
    if fv.measure_time and _is_vision(config):
        _err("--measure_time: not available for vision models (timed steps are built for the "
             "language models only)")
    if fv.reference and _is_vision(config):
        _err("--reference: the plain-jit reference is built for the language models only; drop "
             "--reference")
    if fv.reference and config.fsdp:
        _err("--reference is plain-jit DDP with replicated parameters, without FSDP; drop "
             "--config.fsdp=True (or --reference)")
    return variants


def _validate(config, variants: list[str], check_only: bool, settings: list | None = None):
    """Set the config's ``workers`` (0: 8) and ``model.max_seq_len`` (at least ``seq_len``),
    validate every variant (with ``settings``, ``--fit``'s ``(remat, fsdp)`` pairs: each, at
    C = 1) as training would and return ``(workers, mesh)`` (mesh None with
    ``check_only``, which leaves the caller's JAX devices as they are); exits with status 2 on
    a ValueError."""
    workers = config.get("workers", 0) or 8
    if config.get("emulate_workers"):
        _err("config.emulate_workers=True (from the config file or a flag): the bench reads "
             "per-device figures of W devices (simulated on a CPU); add "
             "--config.emulate_workers=False (python -m sdp_jax.bench.device measures emulated "
             "workers on one device)")
    with config.unlocked():
        config.workers = workers
        if "seq_len" in config:   # the bench may measure longer sequences than the model's
            config.model.max_seq_len = max(config.model.get("max_seq_len", 0), config.seq_len)
    try:
        shape = MeshShape.from_config(config)
        devices = max(workers, 1) * shape.devices
        if not check_only:   # (a check leaves the caller's JAX devices as they are)
            mesh_lib.simulate_cpu_devices(devices)   # before the validation starts a backend
        run_lib.canonical_dtype(config)
        for v in variants:   # one validation place for every field, before any compile
            if settings is None:
                _resolve(config, v, devices)
            for remat, fsdp in settings or ():
                run_lib.resolve(_fit_config(config, v, remat, fsdp), devices)
        return workers, None if check_only else _mesh(workers, shape)
    except ValueError as e:
        _err(str(e))


def _add_row(rows: list[dict], row: dict, name: str) -> None:
    """Append ``row`` to ``rows`` and print that ``name`` is compiled, in how long."""
    rows.append(row)
    print(f"  compiled {name} in {row['compile_s']}s", flush=True)


def _main_lm(fv, config, config_path, variants, workers, mesh) -> list[dict]:
    """``main`` for language-model configs: the rows of :func:`_lm_rows`, printed as a table
    with the reference ratios and notes, and written to ``--json``."""
    import jax

    model = LlamaConfig.from_config(config.model)
    print(f"{config_path}: {model.n_layers} blocks, batch {config.batch_per_worker} x "
          f"{config.seq_len} tokens per worker, {workers} x {_inner(config)}"
          f"{jax.devices()[0].platform}, "
          f"{config.dtype}" + (", FSDP" if config.fsdp else "") + f", remat {config.remat}, "
          f"averaging {config.sdp.method}, attention {model.attention}"
          + step_options(config, remat="none", fsdp=False, dtype="float32").describe(
              workers, config.batch_per_worker), flush=True)
    rows = _lm_rows(fv, config, variants, workers, mesh)
    print(format_table(rows))
    for line in axis_lines(rows):
        print(line)
    for line in reference_lines(rows):
        print(line)
    for r in rows:
        if not r["uniform"]:
            print(f"note: {r['variant']}: W*C is not whole for some component kind, so its masks "
                  "are near-uniform (multiplicities differ by one), as in the paper's 1B setting.")
    if jax.devices()[0].platform == "cpu" and config.dtype == "bfloat16":
        print("note: XLA:CPU computes bf16 matmuls and collectives in float32 (converting back "
              "and forth), so bf16 memory and bytes here are upper bounds of what a GPU or TPU "
              "would use, and can exceed the float32 figures.")
    _write_rows(fv.json, rows)
    return rows


def _lm_rows(fv, config, variants, workers, mesh) -> list[dict]:
    """The language-model rows: ``--reference``'s plain-jit rows first, then each variant's
    (:func:`measure`), with ``step_times_s`` / ``step_time_s`` (seconds) under
    ``--measure_time``."""
    kw = {"fsdp": config.fsdp, "remat": config.remat, "dtype": config.dtype}
    ref = {"remat": config.remat, "dtype": config.dtype, "flops": fv.flops}
    rows = []
    if fv.reference:
        row = measure_reference(config, workers, mesh, **ref)
        _add_row(rows, row, row["setting"])
        if "b-sdp" in variants:   # the floor of B-SDP's step: plain jit of k of the L blocks
            k = _plan(config, "b-sdp", workers, config.sdp.coverage)[0].kinds["block"].k
            row = measure_reference(config, workers, mesh, blocks=k, **ref)
            _add_row(rows, row, row["setting"])
    for v in variants:
        cov = 1.0 if v == "ddp" else config.sdp.coverage
        _add_row(rows, measure(config, v, workers, cov, mesh, flops=fv.flops, **kw), v)
    if fv.measure_time:
        print(f"  timing {fv.time_steps} steps of each variant, interleaved", flush=True)
        for row, t in zip(rows, time_steps(config, rows, workers, mesh, steps=fv.time_steps,
                                           **kw)):
            row["step_times_s"] = t
            row["step_time_s"] = statistics.median(t)
    return rows


def _variant_config(config, variant: str, coverage: float, workers: int,
                    allow_nonuniform: bool = False):
    """A copy of ``config`` for one bench row: ``sdp.variant``, ``sdp.coverage``, ``workers``
    and ``sdp.allow_nonuniform`` set; ``sdp.stage_blocks`` kept for block variants only."""
    c = config.copy_and_resolve_references()
    with c.unlocked():
        c.sdp.variant, c.workers = variant, workers
        fit.set_coverage(c, coverage)   # (the field may hold 'auto')
        if allow_nonuniform:
            c.sdp.allow_nonuniform = True
        if variant not in ("b-sdp", "bb-sdp") and "stage_blocks" in c.sdp:
            c.sdp.stage_blocks = ()
    return c


def _resolve(config, variant: str, devices: int):
    """The train-time validation of ``config`` with ``variant`` (at C = 1 for ddp) on
    ``devices`` devices, near-uniform masks allowed (the paper's 1B setting needs them)."""
    c = _variant_config(config, variant, 1.0 if variant == "ddp" else config.sdp.coverage,
                        config.workers, True)
    return run_lib.resolve(c, devices)


def _is_vision(config) -> bool:
    return isinstance(families.family_of(config), families.VisionFamily)


def _main_vision(fv, config, config_path, variants, workers, mesh):
    """``main`` for vision configs: memory, communication and FLOPs of each variant."""
    import jax

    remat, dtype, fsdp = config.remat, config.dtype, config.fsdp
    print(f"{config_path}: {config.model.name}, {config.batch_per_worker} images of "
          f"{config.model.image_size}x{config.model.image_size} per worker, {workers} x "
          f"{jax.devices()[0].platform}, {dtype}" + (", FSDP" if fsdp else "")
          + f", remat {remat}, averaging {config.sdp.method}", flush=True)
    rows = []
    for v in variants:
        _add_row(rows, measure_vision(config, v, workers,
                                       1.0 if v == "ddp" else config.sdp.coverage, mesh,
                                       dtype=dtype, flops=fv.flops, remat=remat, fsdp=fsdp), v)
    print(format_table(rows))
    for r in rows:
        if not r["uniform"]:
            print(f"note: {r['variant']}: W*C is not whole for some stage, so its masks are "
                  "near-uniform (multiplicities differ by one).")
    _write_rows(fv.json, rows)
    return rows



# ---------------------------------------------------------------------------- --fit
def _check_fit(fv, config) -> tuple[list | None, list[float]]:
    """``--fit``'s ``(remat, fsdp)`` settings (``--fit_remat`` x ``--fit_fsdp``, default the
    config's) and budgets (bytes per device); ``(None, [])`` without ``--fit``. Exits with
    status 2 on a bad value, or a ``--fit`` flag without ``--fit``, or ``--fit`` with
    ``--measure_time`` or ``--reference``."""
    own = [f"--{k}" for k in ("budget_gib", "fit_remat", "fit_fsdp") if fv[k].present]
    if not fv.fit:
        if own:
            _err(f"{', '.join(own)} applies with --fit only; add --fit (or, for one setting, "
                 "use --config.remat / --config.fsdp)")
        return None, []
    other = [f"--{k}" for k in ("measure_time", "reference") if fv[k].value]
    if other:
        _err(f"--fit compiles candidates only; drop {', '.join(other)}")
    try:
        budgets = [float(b) for b in fv.budget_gib]
    except ValueError:
        _err(f"--budget_gib={','.join(fv.budget_gib)}: give numbers of GiB per device, "
             "e.g. --budget_gib=40,24")
    if not budgets or min(budgets) <= 0:
        _err("--fit needs budgets of GiB per device > 0, e.g. --budget_gib=40,24")
    bools = {"true": True, "false": False}
    bad = [f for f in fv.fit_fsdp if f.lower() not in bools]
    if bad:
        _err(f"--fit_fsdp={','.join(fv.fit_fsdp)}: give true and/or false, e.g. "
             "--fit_fsdp=false,true")
    remats = fv.fit_remat or [config.remat]
    fsdps = [bools[f.lower()] for f in fv.fit_fsdp] or [bool(config.fsdp)]
    return [(r, f) for r in remats for f in fsdps], [b * fit.GIB for b in budgets]


def _fit_config(config, variant: str, remat: str, fsdp: bool, coverage=1.0):
    """A copy of ``config`` for one ``--fit`` setting (``variant``, ``remat``, ``fsdp``) at
    ``coverage``."""
    c = _variant_config(config, variant, 1.0, config.workers)
    fit.set_coverage(c, coverage)
    with c.unlocked():
        c.remat, c.fsdp = remat, fsdp
    return c


def _main_fit(fv, config, config_path, variants, workers, settings, budgets) -> list[dict]:
    """``main`` with ``--fit``: each variant x setting compiled at every realizable coverage
    (:func:`sdp_jax.train.fit.scan`, logged as compiled), then :func:`fit_table`; the rows
    (``variant``, ``remat``, ``fsdp``, ``coverage``, ``held_per_worker``,
    ``peak_bytes_per_device``, ``compile_s``) to ``--json``."""
    import jax

    print(f"{config_path}: batch {config.batch_per_worker} per worker, {workers} x "
          f"{jax.devices()[0].platform}, {config.dtype}; budgets "
          f"{', '.join(f'{b / fit.GIB:g}' for b in budgets)} GiB per device", flush=True)
    rows = []
    for v in variants:
        for remat, fsdp in settings:
            print(f"{setting_name(v, fsdp, remat)}:", flush=True)
            for cand in fit.scan(_fit_config(config, v, remat, fsdp),
                                 workers * MeshShape.from_config(config).devices,
                                 tuple(budgets)):
                rows.append({"variant": v, "remat": remat, "fsdp": fsdp,
                             "coverage": cand.coverage, "held_per_worker": cand.held,
                             "peak_bytes_per_device": cand.peak_bytes,
                             "compile_s": cand.compile_s})
    print(fit_table(rows, budgets))
    _write_rows(fv.json, rows)
    return rows


def fit_table(rows: list[dict], budgets: list[float]) -> str:
    """``--fit``'s two markdown tables: every compiled row (variant, remat, FSDP, C, held per
    worker, peak per device in GiB, whether it fits each budget), and per (variant, remat,
    FSDP) the largest C that fits each budget (``budgets``: bytes per device)."""
    gib = [f"{b / fit.GIB:g} GiB" for b in budgets]
    lines = ["| variant | remat | FSDP | C | held per worker | peak / device | "
             + " | ".join(f"fits {g}" for g in gib) + " |",
             "|---" * (6 + len(budgets)) + "|"]
    best: dict[tuple, list] = {}
    for r in rows:
        key = (r["variant"], r["remat"], "yes" if r["fsdp"] else "no")
        fits = [r["peak_bytes_per_device"] <= b for b in budgets]
        lines.append(f"| {' | '.join(key)} | {r['coverage']:g} | {r['held_per_worker']} | "
                     f"{_bytes(r['peak_bytes_per_device'])} | "
                     + " | ".join("yes" if f else "no" for f in fits) + " |")
        got = best.setdefault(key, [None] * len(budgets))
        best[key] = [g if g is not None or not f else r["coverage"] for g, f in zip(got, fits)]
    lines += ["", "largest C that fits:", "",
              "| variant | remat | FSDP | " + " | ".join(gib) + " |",
              "|---" * (3 + len(budgets)) + "|"]
    lines += [f"| {' | '.join(key)} | " + " | ".join("none" if c is None else f"{c:g}"
                                                   for c in cs) + " |"
              for key, cs in best.items()]
    return "\n".join(lines)

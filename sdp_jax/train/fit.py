"""A coverage that fits: ``config.sdp.coverage='auto'`` picks the largest realizable coverage
``C`` whose compiled train step fits a per-device memory budget, on the backend the run is on.

Each candidate is the run itself at one coverage (its variant, remat, FSDP, dtype, batch and
model), resolved by :func:`sdp_jax.train.run.resolve` and its train step lowered and compiled
for abstract inputs (``jax.ShapeDtypeStruct``: nothing is allocated); its peak per device is
``compiled.memory_analysis()``'s argument + temp + output - alias bytes
(:func:`sdp_jax.costs.memory_stats`). :func:`compiled_peak` is that one measurement, read by
``train.py`` (:func:`resolve`) and by ``python -m sdp_jax.bench --fit`` (:func:`scan`).

The candidates are the coverages ``k / G`` (``G``: the variant's blocks, or its smallest
neuron kind) for which the family's masks can be built (``family.plan``: the one rule that
decides what is realizable, e.g. ``W * C`` whole unless ``sdp.allow_nonuniform``).

The budget is ``config.sdp.memory_budget_gib`` GiB per device; 0 takes an accelerator's
memory (``memory_stats()['bytes_limit']``) times :data:`SAFETY`, and is refused on a CPU.

Every run, whatever its coverage, is checked by the same rule (:func:`fits`) before its first
step (:func:`check_peak`): its compiled peak against ``memory_budget_gib`` when given, an
accelerator's ``bytes_limit``, and on a CPU the host's memory shared by the process's devices.

A resumed ``auto`` run does not pick again: it takes the coverage its latest checkpoint
recorded (the config a checkpoint records holds the chosen number, never ``auto``), so the
budget or another compiler cannot change ``C`` in the middle of a run.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable

import jax

from sdp_jax.costs import program as costs
from sdp_jax.spec import masks as masks_lib
from sdp_jax.step.inner import InnerLayout
from sdp_jax.train import checkpoint as ckpt_lib
from sdp_jax.train import run as run_lib

AUTO = "auto"
GIB = 2**30
SAFETY = 0.9   # the part of an accelerator's memory a budget of 0 takes (the rest: the runtime's)
BUDGET_FLAG = "--config.sdp.memory_budget_gib"
KIND_NAMES = {"block": "blocks", "mlp": "neurons", "heads": "kv-groups"}   # (in the tables)
MEMINFO = "/proc/meminfo"
CGROUP = "/sys/fs/cgroup"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One compiled coverage: ``coverage`` C, ``held`` (e.g. ``12/16 blocks``),
    ``peak_bytes`` (compiled peak per device, bytes), ``compile_s`` (seconds)."""

    coverage: float
    held: str
    peak_bytes: int
    compile_s: float

    def fits(self, budget_bytes: float) -> bool:
        """Whether the peak fits ``budget_bytes`` (bytes per device; :func:`fits`)."""
        return fits(self.peak_bytes, budget_bytes)


def fits(peak_bytes: int, budget_bytes: float) -> bool:
    """Whether a compiled train step that peaks at ``peak_bytes`` per device fits
    ``budget_bytes`` per device: the one rule of ``coverage='auto'`` (:meth:`Candidate.fits`)
    and of every run's check before its first step (:func:`check_peak`)."""
    return peak_bytes <= budget_bytes


def is_auto(config) -> bool:
    """Whether ``config.sdp.coverage`` is ``'auto'``."""
    return config.sdp.coverage == AUTO


def set_coverage(config, coverage) -> None:
    """Set ``config.sdp.coverage`` (in place) to a number or ``'auto'``, whatever the field
    holds now."""
    with config.ignore_type():
        config.sdp.coverage = coverage


def with_coverage(config, coverage):
    """A copy of ``config`` at ``coverage``."""
    c = config.copy_and_resolve_references()
    set_coverage(c, coverage)
    return c


def compiled_peak(run: run_lib.RunSpec, mesh) -> dict:
    """The per-device bytes of ``run``'s train step compiled for abstract inputs (no array is
    allocated): :func:`sdp_jax.costs.memory_stats` (``peak_bytes_per_device`` and its parts)."""
    builder = run.family.step(run, mesh)
    return costs.memory_stats(builder.compiled_train_step(run.family.batch_shapes(run)))


def budget_bytes(config) -> int:
    """The per-device budget of ``coverage='auto'`` in bytes: ``sdp.memory_budget_gib`` GiB, or
    (0) the first device's ``bytes_limit`` times :data:`SAFETY`.

    Raises:
      ValueError: a budget of 0 on a CPU, or on a device that reports no memory limit."""
    gib = config.sdp.memory_budget_gib
    if gib:
        return round(gib * GIB)
    device = jax.devices()[0]
    if device.platform == "cpu":
        raise ValueError(f"config.sdp.coverage='auto' on a CPU needs a per-device budget: add "
                         f"{BUDGET_FLAG}=GIB (e.g. {BUDGET_FLAG}=40).")
    limit = (device.memory_stats() or {}).get("bytes_limit")
    if not limit:
        raise ValueError(f"config.sdp.coverage='auto': the {device.device_kind} reports no "
                         f"memory limit; add {BUDGET_FLAG}=GIB.")
    return int(limit * SAFETY)


def host_memory_bytes() -> int | None:
    """The most memory this host can give a process, in bytes: its RAM (``MemTotal`` of
    ``/proc/meminfo``, at most the limits of its cgroups, :func:`_cgroup_limit_files`) plus
    its swap (``SwapTotal``); None where ``/proc/meminfo``
    cannot be read (not Linux). An upper bound: what needs more cannot run here, whatever else
    runs beside it."""
    try:
        with open(MEMINFO) as f:
            info = {k: int(v.split()[0]) * 1024 for k, v in
                    (line.split(":", 1) for line in f if ":" in line) if v.split()}
    except (OSError, ValueError):
        return None
    ram = info.get("MemTotal")
    if not ram:
        return None
    for path in _cgroup_limit_files():
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():   # ("max": no limit)
            ram = min(ram, int(text))
    return ram + info.get("SwapTotal", 0)


def _cgroup_limit_files(own: str = "/proc/self/cgroup") -> list[str]:
    """The memory-limit files that may bound this process: the root cgroup's and those of
    the cgroups ``own`` names (a scheduler's, e.g. SLURM's or systemd's, seen without a
    cgroup namespace): v2 ``memory.max``, v1 ``memory/.../memory.limit_in_bytes``."""
    v2, v1 = {""}, {""}
    try:
        with open(own) as f:
            for line in f:   # "0::/path" (v2) or "4:memory:/path" (v1)
                _, controllers, path = line.strip().split(":", 2)
                if not controllers:
                    v2.add(path.strip("/"))
                elif "memory" in controllers.split(","):
                    v1.add(path.strip("/"))
    except (OSError, ValueError):
        pass
    return ([os.path.join(CGROUP, p, "memory.max") for p in sorted(v2)]
            + [os.path.join(CGROUP, "memory", p, "memory.limit_in_bytes") for p in sorted(v1)])


def limits(config, devices: list) -> list[tuple[int, str]]:
    """What a run's compiled train step must fit, as ``(bytes per device, what sets it)``:
    ``sdp.memory_budget_gib`` when > 0; on an accelerator its memory (``bytes_limit`` of
    ``memory_stats()``); on a CPU this host's memory (:func:`host_memory_bytes`) over
    ``devices``, the run's devices of this process (they all live in it)."""
    out, gib, first = [], config.sdp.memory_budget_gib, devices[0]
    if gib:
        out.append((round(gib * GIB), f"{BUDGET_FLAG}={gib:g}"))
    if first.platform == "cpu":
        host, n = host_memory_bytes(), len(devices)
        if host:
            out.append((host // n, f"this host's memory ({costs.fmt_bytes(host)} of RAM and "
                                   "swap" + (f" for the {n} devices of the run in this process, "
                                             f"{costs.fmt_bytes(host // n)} each" if n > 1
                                             else "") + ")"))
        return out
    try:
        limit = (first.memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 (a backend without memory statistics)
        limit = None
    if limit:
        out.append((int(limit), f"the {first.device_kind}'s memory "
                                f"({costs.fmt_bytes(limit)}, bytes_limit)"))
    return out


def remedies(config, coverage: bool = True) -> str:
    """The settings, not yet in effect, that lower a train step's peak per device, as the
    flags to give: a smaller coverage (``coverage``; an SDP variant for ddp), ``remat=full``,
    ``fsdp``, more ``grad_accum`` microbatches, fewer emulated workers."""
    s, out = config.sdp, []
    if coverage and s.variant == "ddp":
        out.append(f"an SDP variant (--config.sdp.variant=b-sdp --config.sdp.coverage=auto "
                   f"{BUDGET_FLAG}=GIB)")
    elif coverage and not is_auto(config):
        out.append(f"a coverage below {s.coverage:g} (--config.sdp.coverage=auto "
                   f"{BUDGET_FLAG}=GIB picks the largest that fits)")
    if config.remat != "full":
        out.append("--config.remat=full")
    if not config.fsdp:
        out.append("--config.fsdp=True")
    b, k = config.batch_per_worker, config.grad_accum
    more = next((m for m in range(k + 1, b + 1) if b % m == 0), None)
    if more:
        out.append(f"--config.grad_accum={more}")
    if config.emulate_workers:
        out.append(f"fewer emulated workers (--config.workers below {config.workers})")
    return ", ".join(out) or "a smaller model or batch"


def check_peak(peak_bytes: int, config, devices: list) -> None:
    """Refuse, before the first step, a run whose compiled train step (``peak_bytes`` per
    device, :func:`sdp_jax.costs.memory_stats`) does not fit (:func:`fits`) one of its
    :func:`limits` (``devices``: the run's devices of this process).

    Raises:
      ValueError: one line with the peak, the limit and the settings that lower the peak
        (:func:`remedies`)."""
    for limit, what in limits(config, devices):
        if not fits(peak_bytes, limit):
            raise ValueError(f"the compiled train step peaks at {costs.fmt_bytes(peak_bytes)} "
                             f"per device, over {what}: it cannot run; lower its memory with "
                             f"{remedies(config)}.")


def allocation_failure(error: Exception, config) -> str:
    """The one line for an allocation that failed anyway (XLA's ``RESOURCE_EXHAUSTED``,
    ``error``): XLA's own first line and the settings that lower the memory
    (:func:`remedies`)."""
    first = (str(error).strip().splitlines() or [""])[0].replace("RESOURCE_EXHAUSTED: ", "")
    return (f"out of memory on the device ({first[:200]}); lower the run's memory with "
            f"{remedies(config)} (checkpoints already written are kept).")


def coverages(config, device_count: int, task=None) -> tuple[run_lib.RunSpec, list[float]]:
    """``(the run resolved at C = 1, its variant's realizable coverages, largest first)``:
    every field but the coverage is validated here, before any compile (ddp: ``[1.0]``).

    Raises:
      ValueError: any invalid field (:func:`sdp_jax.train.run.resolve`)."""
    run = run_lib.resolve(with_coverage(config, 1.0), device_count, task)
    plan = run.plan
    if plan.variant == "ddp":
        return run, [1.0]
    blocks = [st.n for kind, st in plan.stacks.items() if kind in plan.kinds]
    g = sum(blocks) if blocks else min(t.masks.shape[-1] for t in plan.kinds.values())
    out = []
    for c in masks_lib.valid_coverages(run.workers, g, allow_nonuniform=True):
        try:
            plan = run.family.plan(with_coverage(config, c), run.model, run.workers, run.pipe)
            InnerLayout(plan, run.mesh_shape.fsdp, run.mesh_shape.tensor).check()
        except ValueError:   # not realizable for this variant (the masks' own rule), or a held
            continue         # count that mesh.tensor does not divide
        out.append(c)
    return run, sorted(out, reverse=True)


def held(plan) -> str:
    """What a worker holds under ``plan``, per kind: ``11/16 blocks``, ``4096/8192 neurons,
    8/16 kv-groups``."""
    return ", ".join(f"{t.k}/{t.masks.shape[-1]} {KIND_NAMES.get(kind, kind)}"
                     for kind, t in plan.kinds.items())


def _gib(n: float) -> str:
    """Bytes as GiB, to 6 significant digits (a budget given in GiB, as given)."""
    return f"{n / GIB:.6g}"


def describe(cand: Candidate, budgets: tuple = ()) -> str:
    """One progress line: ``C=0.75 (12/16 blocks): peak 3.1 GiB per device (compiled in
    2.0s), fits 4 GiB`` (one verdict per budget, bytes)."""
    verdicts = "".join(f", {'fits' if cand.fits(b) else 'over'} {_gib(b)} GiB"
                       for b in budgets)
    return (f"  C={cand.coverage:g} ({cand.held}): peak {costs.fmt_bytes(cand.peak_bytes)} per "
            f"device (compiled in {cand.compile_s}s){verdicts}")


def scan(config, device_count: int, budgets: tuple = (), task=None,
         log: Callable[[str], None] = print, first_fit: bool = False) -> list[Candidate]:
    """Compile ``config``'s run at each realizable coverage, largest first
    (:func:`coverages`, :func:`compiled_peak`), logging each as it is compiled
    (:func:`describe`); ``first_fit``: stop at the first that fits ``budgets[0]`` (bytes per
    device), the largest that fits.

    Raises:
      ValueError: an invalid field, before any compile."""
    run, cands = coverages(config, device_count, task)
    mesh, out = run_lib.make_mesh(run), []
    for c in cands:
        r = run_lib.resolve(with_coverage(config, c), device_count, task)
        t0 = time.time()
        peak = compiled_peak(r, mesh)["peak_bytes_per_device"]
        out.append(Candidate(c, held(r.plan), peak, round(time.time() - t0, 1)))
        log(describe(out[-1], budgets))
        if first_fit and out[-1].fits(budgets[0]):
            break
    return out


def check_start(config, device_count: int, task=None):
    """What a run without a checkpoint starts from (``config.init_from``), checked before
    any compile, also before ``coverage='auto'`` compiles its candidates (the run at C = 1
    then: the files do not depend on the coverage): the family's
    :meth:`~sdp_jax.train.task.Family.check_start`, whose record it returns.

    Raises:
      ValueError: an invalid field (:func:`sdp_jax.train.run.resolve`), or a fault of the
        files, in one line naming the file."""
    run = run_lib.resolve(with_coverage(config, 1.0) if is_auto(config) else config,
                          device_count, task)
    return run.family.check_start(run)


def recorded_coverage(workdir: str | None) -> tuple[int, float] | None:
    """``(step, C)`` of the latest checkpoint in ``workdir/checkpoints``, or None (none)."""
    path = os.path.join(workdir or "", "checkpoints")
    if not workdir or not os.path.isdir(path):
        return None
    manager = ckpt_lib.CheckpointManager(path)
    try:
        step = manager.latest_step()
        if step is None:
            return None
        return step, manager.read_meta(step)["config"]["sdp"]["coverage"]
    finally:
        manager.close()


def check(config, device_count: int, task=None) -> tuple[list[float], int]:
    """``coverage='auto'`` checked without compiling: ``(the realizable coverages, largest
    first, the budget in bytes per device)``.

    Raises:
      ValueError: an invalid field, or no budget on a CPU (:func:`budget_bytes`)."""
    _, cands = coverages(config, device_count, task)
    return cands, budget_bytes(config)


def resolve(config, device_count: int, task=None, workdir: str | None = None,
            log: Callable[[str], None] = print) -> run_lib.RunSpec:
    """:func:`sdp_jax.train.run.resolve`, with ``coverage='auto'`` first replaced in
    ``config`` (in place, so ``config.json`` and the checkpoints record the number) by the
    coverage the latest checkpoint of ``workdir`` recorded, or else (and always with
    ``config.elastic``: a run moved to another slice fits anew) by the largest that fits the
    budget (:func:`scan`, largest first, stopping at the first that fits).

    Raises:
      ValueError: an invalid field or no budget on a CPU (before any compile), or, in one
        line, no coverage fits (naming the smallest candidate's peak and the fixes)."""
    if not is_auto(config):
        return run_lib.resolve(config, device_count, task)
    recorded = None if config.get("elastic", False) is True else recorded_coverage(workdir)
    if recorded is not None:
        log(f"coverage auto: C={recorded[1]:g}, as the checkpoint of step {recorded[0]} in "
            f"{workdir} recorded (picked when the run started; not picked again)")
        set_coverage(config, recorded[1])
        return run_lib.resolve(config, device_count, task)
    cands, budget = check(config, device_count, task)
    log(f"coverage auto: compiling {config.sdp.variant} at its {len(cands)} realizable "
        f"coverages, largest first, until one fits {_gib(budget)} GiB per device")
    compiled = scan(config, device_count, (budget,), task, log, first_fit=True)
    if not compiled[-1].fits(budget):
        last = compiled[-1]
        raise ValueError(
            f"config.sdp.coverage='auto': no coverage of {config.sdp.variant} fits "
            f"{_gib(budget)} GiB per device (the smallest, C={last.coverage:g}, peaks at "
            f"{costs.fmt_bytes(last.peak_bytes)}); raise {BUDGET_FLAG}, or lower the "
            f"step's memory with {remedies(config, coverage=False)}.")
    set_coverage(config, compiled[-1].coverage)
    log(f"coverage auto: C={compiled[-1].coverage:g} ({compiled[-1].held}), the largest that "
        f"fits {_gib(budget)} GiB per device")
    return run_lib.resolve(config, device_count, task)


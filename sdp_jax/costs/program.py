"""Costs of a compiled program: per-device bytes, FLOPs, the device's peak FLOP/s, byte format.

Read from ``jax.jit(...).lower(...).compile()``: ``memory_analysis()`` for bytes and
``cost_analysis()`` for FLOPs (docs/design.md, "Reading the compiled program"). The collective
bytes of a program are :mod:`sdp_jax.costs.comm`'s.
"""

from __future__ import annotations


def memory_stats(compiled) -> dict[str, int]:
    """Per-device bytes of a compiled program from ``compiled.memory_analysis()``.

    peak ~ argument + temp + output - alias (donated state aliases its output).
    Returns dict with ``argument_bytes``, ``output_bytes``, ``alias_bytes``, ``temp_bytes``,
    ``peak_bytes_per_device`` (all bytes, ints).
    """
    ma = compiled.memory_analysis()
    arg = int(ma.argument_size_in_bytes)
    out = int(ma.output_size_in_bytes)
    alias = int(ma.alias_size_in_bytes)
    temp = int(ma.temp_size_in_bytes)
    return {"argument_bytes": arg, "output_bytes": out, "alias_bytes": alias, "temp_bytes": temp,
            "peak_bytes_per_device": arg + temp + out - alias}


def flops_per_device(compiled) -> float:
    """FLOPs of one per-device step from ``compiled.cost_analysis()`` (0.0 if unavailable).

    XLA counts a loop body once, whatever its trip count: compile with ``unroll=True`` (see
    :class:`sdp_jax.step.SDPStep`) for a count that includes every block."""
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    return float((ca or {}).get("flops", 0.0))


# Dense bf16 peak FLOP/s per chip by ``device_kind`` (vendors' data sheets; SXM parts for
# NVIDIA), the denominator of MFU; the first matching entry wins.
PEAK_FLOPS = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("TPU v6", 918e12),
              ("TPU v5 lite", 197e12), ("TPU v5e", 197e12), ("TPU v5", 459e12),
              ("TPU v4", 275e12))


def peak_flops(device_kind: str, given: float = 0.0) -> float | None:
    """A device's peak FLOP/s for MFU: ``given`` if positive (``config.peak_flops``), else
    :data:`PEAK_FLOPS`'s entry for ``device_kind`` (e.g. ``"NVIDIA H100 80GB HBM3"``), else
    None (a CPU: no MFU)."""
    if given > 0:
        return float(given)
    return next((f for name, f in PEAK_FLOPS if name in device_kind), None)


def fmt_bytes(n: float) -> str:
    """Bytes as ``12.3 MiB`` (binary units, one decimal)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return str(n)

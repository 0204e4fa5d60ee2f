"""The analysers of compiled programs: bytes, FLOPs and collective bytes of what XLA compiled.

The public face of the wing; ``from sdp_jax import costs`` then ``costs.memory_stats``,
``costs.flops_per_device``, ``costs.comm_bytes_per_device``. Its members, independent of each
other:

* :mod:`sdp_jax.costs.program`: memory (argument, output, alias, temp bytes) and FLOPs of one
  compiled program, a device's peak FLOP/s;
* :mod:`sdp_jax.costs.comm`: the bytes each device sends per step, per collective and per mesh
  axis, read from the compiled HLO text.
"""

from sdp_jax.costs.comm import (COLLECTIVE_OPS, collective_ops, comm_bytes_per_device,
                                group_axes, shape_bytes)
from sdp_jax.costs.program import PEAK_FLOPS, flops_per_device, fmt_bytes, memory_stats, peak_flops

__all__ = ["COLLECTIVE_OPS", "shape_bytes", "collective_ops", "comm_bytes_per_device", "group_axes",
           "memory_stats", "flops_per_device", "PEAK_FLOPS", "peak_flops", "fmt_bytes"]

"""``python -m sdp_jax.bench FLAGS``: per-device memory, FLOPs, collective bytes and step times
of the SDP variants (:mod:`sdp_jax.bench.measure`, whose docstring lists the flags)."""

import sys

from sdp_jax.bench.measure import main

if __name__ == "__main__":
    sys.exit(0 if main() else 1)

"""Simulated CPU devices for multi-device tests; must run before JAX initialises its backend."""

import os
import sys

N_DEVICES = 8
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={N_DEVICES}").strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", N_DEVICES)
jax.config.update("jax_platforms", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

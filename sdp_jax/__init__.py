"""sdp_jax: Subnetwork Data Parallelism (Singh et al., arXiv 2507.09029) in JAX and Flax NNX.

The package is in layers; a module imports only the layers below its own (pyproject.toml's
import-linter contracts, checked by ``tests/test_layers.py``). From the bottom:

* **The core** (modules at the top of the package; what your own model imports):
  ``masks`` (host-side mask matrices, numpy only), ``spec`` (a model's declared component rules
  -> masks, mask pytrees and tables), ``layout`` (full, compact and shard forms of the
  parameters and the host tables the collectives read), ``sync`` (holder-only averaging and
  holder-correct clipping inside ``jax.shard_map``), ``step`` (``SDPStep``: the one SDP step of
  any model from a spec, a loss and an optax optimizer; a facade over ``state`` (the state's
  layout), ``runner`` (the model call and block runner), ``sources`` (one parameter source per
  regime), ``update`` (averaging and the optimizer step), ``evaluation`` and ``alignment``),
  ``pipeline`` (GPipe and 1F1B with
  compressed stage boundaries), ``stiefel`` (the Stiefel-manifold optax transform of MAPL),
  ``mesh`` (the axis names ``data`` / ``stage``, simulated CPU devices, the run's mesh),
  ``costs`` (bytes and FLOPs of a compiled program), ``comm`` (its collective bytes),
  ``fields`` (config sections -> dataclasses).
* ``models``: ``llama`` and ``vision`` (ResNet-18, WideResNet-18, Swin-T), each with its SDP
  rules and spec builder.
* ``train``: the run config's fields (``config``) and its one validation (``run.resolve``),
  the model families (``families``), the optimizer, data pipelines (``data``,
  ``vision_data``), checkpoints, the resumable loop (``loop``), the command-line helpers
  (``cli``) and the multi-process launcher (``python -m sdp_jax.train.launch``).
* ``tools``: ``python -m sdp_jax.tools.evaluate`` / ``generate`` / ``export`` / ``plot`` and the
  lm-evaluation-harness adapter (``harness``), all reading a trained run (``trained``).
* ``bench``: ``python -m sdp_jax.bench``, compiled memory, FLOPs, collective bytes and step
  times against plain ``jax.jit`` (``bench.jit_reference``).
* ``study``: ``python -m sdp_jax.study sdp`` (every variant against DDP) and ``mapl``
  (compressed pipeline boundaries).
"""

__version__ = "0.1.0"

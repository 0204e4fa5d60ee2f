"""sdp_jax: Subnetwork Data Parallelism (Singh et al., arXiv 2507.09029) in JAX and Flax NNX.

The package is a house with wings: each plural concern is a sub-package whose ``__init__`` is its
public face, and a module imports only the layers below its own (pyproject.toml's import-linter
contracts, one for the package and one inside each wing, checked by ``tests/test_layers.py``).
From the bottom:

* **The core** (what your own model imports: ``from sdp_jax import spec, step``):

  * ``fields`` (declared settings) and ``mesh`` (the axis names ``data`` / ``stage``, simulated
    CPU devices, the run's mesh);
  * ``options`` (what a step is given: ``StepOptions``, ``ModelHooks``) and ``costs`` (the
    analysers of compiled programs: memory and FLOPs in ``costs.program``, collective bytes in
    ``costs.comm``);
  * ``spec`` (masks and specs: ``spec.masks``, ``spec.rules``, ``spec.sdp_spec``,
    ``spec.layout``);
  * ``sync`` (collectives and placement: holder-only averaging and holder-correct clipping
    inside ``jax.shard_map`` in ``sync.collectives``, where the workers run in
    ``sync.placement``);
  * ``step`` (the step and its pieces: ``SDPStep`` in ``step.sdp_step``, a facade over
    ``step.regime``, ``step.state``, ``step.runner``, ``step.sources``, ``step.update``,
    ``step.accumulation``, ``step.host``, ``step.evaluation`` and ``step.alignment``) and
    ``pipeline`` (pipelines and projectors: GPipe and 1F1B in ``pipeline.schedules``, the
    Stiefel-manifold optax transform of MAPL in ``pipeline.stiefel``).
* ``models``: ``llama`` and ``vision`` (ResNet-18, WideResNet-18, Swin-T), each with its SDP
  rules and spec builder; ``hf_llama``.
* ``train``: the run config's fields (``config``) and its one validation (``run.resolve``),
  the model families (``families``: ``language_model``, ``vision``), the optimizer, data
  (``data``: ``tokens``, ``corpus``, ``vision``), checkpoints, the resumable loop (``loop``),
  the command-line helpers (``cli``) and several processes (``launch``: ``python -m
  sdp_jax.train.launch``, ``launch.peers``).
* ``tools``: ``python -m sdp_jax.tools.evaluate`` / ``generate`` / ``export`` / ``plot`` and the
  lm-evaluation-harness adapter (``harness``), all reading a trained run (``trained``).
* ``bench``: ``python -m sdp_jax.bench``, compiled memory, FLOPs, collective bytes and step
  times against plain ``jax.jit`` (``bench.jit_reference``).
* ``study``: ``python -m sdp_jax.study sdp`` (every variant against DDP) and ``mapl``
  (compressed pipeline boundaries).

Modules that moved into a wing keep their old import path (``import sdp_jax.placement``,
``from sdp_jax import masks``): :data:`MOVED` maps each to its new home, and importing it by the
old path gives the same module object with a ``FutureWarning`` that names the new path.
"""

import importlib as _importlib
import importlib.machinery as _machinery
import sys as _sys
import warnings as _warnings

__version__ = "0.1.0"

# Old path -> new path of every module that moved into a wing (docs/design.md, "The package's
# layers"). The wings' faces (sdp_jax.spec, .sync, .step, .pipeline, .costs, .train.data,
# .train.launch, .train.families) keep their names and need no entry.
MOVED = {
    "sdp_jax.masks": "sdp_jax.spec.masks",
    "sdp_jax.spec_rules": "sdp_jax.spec.rules",
    "sdp_jax.layout": "sdp_jax.spec.layout",
    "sdp_jax.placement": "sdp_jax.sync.placement",
    "sdp_jax.regime": "sdp_jax.step.regime",
    "sdp_jax.state": "sdp_jax.step.state",
    "sdp_jax.host": "sdp_jax.step.host",
    "sdp_jax.runner": "sdp_jax.step.runner",
    "sdp_jax.sources": "sdp_jax.step.sources",
    "sdp_jax.update": "sdp_jax.step.update",
    "sdp_jax.accumulation": "sdp_jax.step.accumulation",
    "sdp_jax.evaluation": "sdp_jax.step.evaluation",
    "sdp_jax.alignment": "sdp_jax.step.alignment",
    "sdp_jax.stiefel": "sdp_jax.pipeline.stiefel",
    "sdp_jax.comm": "sdp_jax.costs.comm",
    "sdp_jax.train.corpus": "sdp_jax.train.data.corpus",
    "sdp_jax.train.vision_data": "sdp_jax.train.data.vision",
    "sdp_jax.train.peers": "sdp_jax.train.launch.peers",
}

_OWN_SPECS = {}   # old path -> the moved module's own spec


class _MovedModules:
    """Serves an old path of :data:`MOVED` as the module at its new path (the same object, so
    ``isinstance`` checks and module state are shared), warning once per import: a meta path
    finder and its loader (importlib's protocol; no ABC, whose import is not free: ``train.py``
    imports this package first thing, before it holds signals)."""

    def find_spec(self, name, path=None, target=None):
        if name not in MOVED:
            return None
        return _machinery.ModuleSpec(name, self)

    def create_module(self, spec):
        _warnings.warn(f"{spec.name} moved to {MOVED[spec.name]}; import it from there (the old "
                       "path is served for now)", FutureWarning, stacklevel=2)
        module = _importlib.import_module(MOVED[spec.name])
        _OWN_SPECS[spec.name] = module.__spec__
        return module

    def exec_module(self, module):
        # importlib has set the old path's spec on the module; give it back its own.
        module.__spec__ = _OWN_SPECS[module.__spec__.name]

    def get_code(self, name):
        """``python -m`` of an old path: refused, naming the new one."""
        raise ImportError(f"{name} moved to {MOVED[name]}: run python -m {MOVED[name]}")


# One finder, also when the package is reloaded (a reload defines the class anew).
_sys.meta_path[:] = [f for f in _sys.meta_path if type(f).__name__ != "_MovedModules"]
_sys.meta_path.append(_MovedModules())

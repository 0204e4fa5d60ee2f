"""The host-side conversions of a train state: the full model (host or traced arrays, nested
dicts) to the stored layout of :class:`sdp_jax.step.state.StateLayout` and back (init, store,
``full_params``, the model state's), and a stored parameter tree in the optimizer's layout.

:class:`HostForms` reads the layout (kinds, shapes, partition specs, pipeline staging, shards)
and does not change it: :class:`sdp_jax.step.SDPStep` builds one beside its layout and answers
``init``, ``full_params``, ``full_state`` and ``store`` through it.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sdp_jax.spec import layout as layout_lib
from sdp_jax.spec import sdp_spec as spec_lib
from sdp_jax.step.regime import Kind
from sdp_jax.step.state import StateLayout

_flatten, _unflatten = spec_lib.flatten, spec_lib.unflatten


class HostForms:
    """The conversions between the full model and one run's stored state layout.

    Args:
      st: the run's :class:`sdp_jax.step.state.StateLayout`.
    """

    def __init__(self, st: StateLayout):
        self.st = st

    def store(self, full) -> dict:
        """Full parameters -> the stored parameter layout (nested dict)."""
        flat = _flatten(spec_lib.pure_tree(full))
        if not self.st.staged:
            return self._store_stage(flat)
        parts = []
        for s in range(self.st.stages):   # stage s: blocks [s * L / P, (s + 1) * L / P)
            part = {}
            for p, x in flat.items():
                n = self.st.spec.shapes[p][0] if self.st.staging.is_staged(p) else None
                part[p] = x[s * n:(s + 1) * n] if n is not None else x
            parts.append(self._store_stage(part))
        return self.st.staging.stack(parts, self.st.param_specs)

    def _store_stage(self, flat: dict) -> dict:
        """One stage's full parameters (flat; the whole model without a pipeline) -> stored."""
        if self.st.fsdp:
            return _unflatten({p: self.st.to_shards(p, x) for p, x in flat.items()})
        if self.st.spec.backward:
            return _unflatten(flat)
        W = self.st.spec.workers
        stored = _flatten(self.st.layout.stored(flat))
        return _unflatten({p: (jnp.broadcast_to(x, (W,) + x.shape)
                               if self.st.param_layout[p] == Kind.PER_WORKER else x)
                           for p, x in stored.items()})

    def init(self, full_params: Any) -> dict:
        """State ``{params, opt_state, step}`` (and ``stats`` with a ``state_spec``) on the
        mesh from the full model (see :meth:`sdp_jax.step.SDPStep.init`).

        Raises:
          ValueError: the parameters (or the model state) differ in paths or shapes from the
            spec's (``state_spec``'s); a step with model state given no pair."""
        traced = callable(full_params) and not hasattr(full_params, "items") \
            and not isinstance(full_params, (nnx.Module, nnx.State, tuple))
        make = full_params if traced else (lambda: full_params)
        full_state = None
        if self.st.state_spec is not None:   # (parameters, state)
            make, full_state = self._split_state(make)
        self._check_params(make)
        out = self.st.shardings(self.st.param_specs)
        if traced:
            params = jax.jit(lambda: self.store(make()), out_shardings=out)()
        else:   # a copy: the step donates the state, not the caller's model
            params = jax.jit(lambda t: jax.tree.map(jnp.copy, self.store(t)),
                             out_shardings=out)(spec_lib.pure_tree(make()))
        opt_state = jax.jit(self._opt_init,
                            out_shardings=self.st.shardings(self.st.opt_specs))(params)
        step = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(self.st.mesh, P()))
        out = {"params": params, "opt_state": opt_state, "step": step}
        if self.st.state_spec is not None:
            out["stats"] = jax.jit(lambda: jax.tree.map(jnp.copy, self.store_stats(full_state())),
                                   out_shardings=self.st.shardings(self.st.stats_specs))()
        return out

    def _split_state(self, make: Callable) -> tuple[Callable, Callable]:
        """``make() -> (parameters, model state)`` -> two functions, the state checked against
        ``state_spec``."""
        probe = jax.eval_shape(make)
        if not isinstance(probe, (tuple, list)) or len(probe) != 2:
            raise ValueError("a step with model state (state_spec) initializes from a pair "
                             "(parameters, state), or a function returning one; got "
                             f"{type(probe).__name__}.")
        got_s = spec_lib.flat_shapes(spec_lib.pure_tree(probe[1]))
        if got_s != self.st.state_spec.shapes:
            diff = sorted(set(got_s.items()) ^ set(self.st.state_spec.shapes.items()), key=str)[:2]
            raise ValueError(f"the model state differs from the one state_spec was built "
                             f"from ({diff}); build state_spec from this state.")
        return (lambda: spec_lib.pure_tree(make()[0]), lambda: spec_lib.pure_tree(make()[1]))

    def _check_params(self, make: Callable) -> None:
        got = spec_lib.flat_shapes(jax.eval_shape(lambda: spec_lib.pure_tree(make())))
        if got != self.st.full_shapes:
            diff = sorted(set(got.items()) ^ set(self.st.full_shapes.items()), key=str)[:2]
            raise ValueError(f"the parameters differ from the ones the spec was built from "
                             f"({diff}); build the spec from this model, or init from the "
                             "model the spec describes"
                             + (f" (with a pipeline the spec describes one of the {self.st.stages}"
                                " stages: sdp_jax.models.llama.make_plan(..., pipe=pipe))."
                                if self.st.staged else "."))

    def store_stats(self, full) -> dict:
        """The full model state (``stats``) -> its stored layout (nested)."""
        flat = _flatten(full)
        return _unflatten(flat) if self.st.spec.backward else \
            layout_lib.of(self.st.state_spec).stored(flat)

    def full_stats(self, stats, average: bool = False) -> dict:
        """Inverse of :meth:`store_stats` (host numpy; ``average``: holders' mean)."""
        return jax.tree.map(np.asarray, stats) if self.st.spec.backward else \
            layout_lib.of(self.st.state_spec).unprune(stats, average)

    def _opt_init(self, params):
        return self.st.optimizer.init(self.optimizer_form(params))

    def optimizer_form(self, params):
        """Stored parameters -> the optimizer's layout (the same but under backward
        masking, whose full copies the optimizer updates as shards, layout ``S``)."""
        if not self.st.spec.backward or self.st.fsdp:
            return params
        return self.st.staging.per_stage(
            lambda t: _unflatten({p: self.st.to_shards(p, x)
                                  if self.st.compact_layout[p] == Kind.SHARDED else x
                                  for p, x in _flatten(t).items()}),
            params, self.st.param_specs, self.st.compact_specs)

    def full_params(self, params, optimizer_layout: bool = False,
                    average: bool = False) -> dict:
        """The full model's parameters (host numpy, nested dict), each component from its
        first holder (always-kept per-worker copies: worker 0's), or with ``average`` its
        holders' mean (periodic averaging); see :meth:`sdp_jax.step.SDPStep.full_params`."""
        if isinstance(params, dict) and "opt_state" in params:
            params = params["params"]
        codes = self.st.compact_layout if optimizer_layout else self.st.param_layout
        specs = self.st.compact_specs if optimizer_layout else self.st.param_specs
        params = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), params)
        if not self.st.staged:
            return self._full_stage(params, codes, average)
        parts = [_flatten(self._full_stage(self.st.staging.take(params, s, specs), codes, average))
                 for s in range(self.st.stages)]
        return _unflatten({p: np.concatenate([q[p] for q in parts]) if self.st.staging.is_staged(p)
                           else parts[0][p] for p in parts[0]})

    def _full_stage(self, params, codes: dict, average: bool = False) -> dict:
        """:meth:`full_params` of one stage's stored tree in the layout ``codes`` (the whole
        model without a pipeline)."""
        flat = _flatten(params)
        if self.st.sharded_update:   # shards joined; replicated leaves as they are
            return _unflatten({p: np.asarray(self.st.from_shards(p, x))
                               if codes[p] == Kind.SHARDED else x for p, x in flat.items()})
        flat = {p: (x.astype(np.float64).mean(0).astype(x.dtype) if average else x[0])
                if codes[p] == Kind.PER_WORKER else x for p, x in flat.items()}
        return self.st.layout.unprune(_unflatten(flat), average=average)

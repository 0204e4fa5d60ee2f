"""Train a model defined outside sdp_jax through sdp_jax's own training loop: B-SDP at C = 1/2,
stopped partway as a preemption would stop it, then resumed to the end.

    python examples/custom_loop.py            # 8 simulated CPU devices, under a minute
    python examples/custom_loop.py /tmp/mlp   # the runs in /tmp/mlp (default: a new temp folder)

The residual MLP of examples/custom_model.py becomes a ``sdp_jax.train.task.Task``: its
parameters from a seed, its SDP rules, its loss, and the global batch of step ``s`` (a pure
function of the step, so a resumed run sees the batches it would have seen). The loop
(``sdp_jax.train.loop.train``) then gives it what ``train.py`` gives the built-in models:
checkpoints that resume (also on another process layout with the same number of workers),
SIGINT / SIGTERM (stop after the current step, save, return), ``metrics.jsonl`` and
TensorBoard events, finiteness checks and ``summary.json`` in the workdir.
"""
import json
import os
import sys
import tempfile

import jax

jax.config.update("jax_num_cpu_devices", 8)  # simulated workers; real devices on GPU/TPU

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from custom_model import RULES, Net  # noqa: E402  (this folder: the model and its rules)
from flax import nnx  # noqa: E402

from sdp_jax.tools import trained  # noqa: E402
from sdp_jax.train import loop  # noqa: E402
from sdp_jax.train.task import Task  # noqa: E402


class ResidualMLP(Task):
    """y = sin(sum(x)) from x ~ N(0, I_8), by the residual MLP of custom_model.py."""

    name = "residual-mlp"

    def model_fields(self):   # config.model: the model's own fields, with their defaults
        return {"depth": 8, "d": 32, "hidden": 64}

    def init(self, model, seed):   # the full model (traced: no device holds it whole)
        return Net(model.depth, nnx.Rngs(seed), model.d, model.hidden)

    def rules(self, model):
        return RULES

    def loss(self, model, plan):
        def loss_fn(params, batch):   # a worker's subnetwork (plan.local_blocks blocks), or
            x, y = batch              # the full model when evaluated: the depth of `params`
            depth = len(params["blocks"])
            net = nnx.graphdef(nnx.eval_shape(lambda: Net(depth, nnx.Rngs(0), model.d,
                                                          model.hidden)))
            return jnp.mean((nnx.merge(net, params)(x) - y) ** 2)
        return loss_fn

    def batch(self, config, step, size):   # the global batch of step `step`
        return examples(np.random.default_rng([0, config.seed, step]), size)

    def val_batches(self, config, size):
        return [examples(np.random.default_rng([1, config.seed, i]), size) for i in range(2)]


def examples(rng, size):
    x = rng.normal(size=(size, 8)).astype(np.float32)
    return x, np.sin(x.sum(1))


def max_difference(a: dict, b: dict) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a),
                                                             jax.tree.leaves(b)))


if __name__ == "__main__":
    task = ResidualMLP()
    config = task.config()        # the sdp, optim and run-control fields, and config.model
    config.sdp.variant, config.sdp.coverage = "b-sdp", 0.5
    config.steps, config.eval_every, config.checkpoint_every, config.log_every = 40, 20, 10, 10
    config.optim.warmup_steps = 5
    root = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="sdp_custom_loop_")
    workdir = os.path.join(root, "run")

    config.stop_at_step = 20      # stopped as SIGTERM or Ctrl-C would stop it, after step 20
    first = loop.train(config, workdir, task=task)
    print(f"\n[1] stopped at step {first['steps']} of {first['total_steps']} "
          f"(completed: {first['completed']}); the checkpoint of step 20 is in {workdir}\n")

    config.stop_at_step = 0       # the same command again: resumes from step 20
    second = loop.train(config, workdir, task=task)
    print(f"\n[2] resumed and finished: {second['steps']} steps, final train loss "
          f"{second['final_train_loss']:.4f}, val loss {second['final_val_loss']:.4f}; "
          f"parameters {second['params_total']:,}, stored per device "
          f"{second['params_per_device']:,}\n")

    straight = os.path.join(root, "uninterrupted")
    loop.train(config, straight, task=task)
    diff = max_difference(trained.load(workdir, task=task).full_params(),
                          trained.load(straight, task=task).full_params())
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        steps = [json.loads(line)["step"] for line in f]
    print(f"\n[3] an uninterrupted run ends with the same parameters: max |difference| "
          f"{diff:.1e}\n    {workdir}: {', '.join(sorted(f for f in os.listdir(workdir) if f[0] != '.'))}; "
          f"metrics.jsonl logged steps {steps}")

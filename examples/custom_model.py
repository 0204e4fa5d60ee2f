"""SDP on a model defined here, not in sdp_jax: B-SDP in the compact layout, and Nb-SDP.

    python examples/custom_model.py            # 8 simulated CPU devices, a few seconds
"""
import jax

jax.config.update("jax_num_cpu_devices", 8)  # simulated workers; real devices on GPU/TPU

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from sdp_jax import spec as sdp, step as sdp_step  # noqa: E402
from sdp_jax.options import StepOptions  # noqa: E402


class Block(nnx.Module):  # residual: a dropped block is its shortcut
    def __init__(self, d, hidden, rngs):
        self.up, self.down = nnx.Linear(d, hidden, rngs=rngs), nnx.Linear(hidden, d, rngs=rngs)

    def __call__(self, h):
        return h + self.down(jax.nn.gelu(self.up(h)))


class Net(nnx.Module):
    def __init__(self, depth, rngs, d=32, hidden=64):
        self.inp, self.out = nnx.Linear(8, d, rngs=rngs), nnx.Linear(d, 1, rngs=rngs)
        self.blocks = nnx.List([Block(d, hidden, rngs) for _ in range(depth)])

    def __call__(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)[:, 0]


RULES = [sdp.Blocks("blocks"),                                    # B-SDP: whole blocks
         sdp.Neurons("blocks/*/up/kernel", axis=1, kind="mlp"),   # N-SDP: hidden neurons
         sdp.Neurons("blocks/*/up/bias", axis=0, kind="mlp"),
         sdp.Neurons("blocks/*/down/kernel", axis=0, kind="mlp")]


def train(variant, coverage=0.5, steps=20, workers=8):
    model = Net(depth=8, rngs=nnx.Rngs(0))
    spec = sdp.build(model, RULES, variant, workers, coverage)
    kind = "block" if "block" in spec.kinds else "mlp"
    where = "" if kind == "block" else " of layer 0"
    print(spec.describe(), f"\n  {kind} 3{where} is held by workers", spec.holders(kind, 3))
    local = nnx.graphdef(nnx.eval_shape(lambda: Net(spec.local_blocks, nnx.Rngs(0))))

    def loss_fn(params, batch):  # params: this worker's (sub)network
        x, y = batch
        return jnp.mean((nnx.merge(local, params)(x) - y) ** 2)

    trainer = sdp_step.SDPStep(spec, loss_fn, optax.adam(3e-3),
                               options=StepOptions(grad_clip=1.0))
    state = trainer.init(model)
    x = jax.random.normal(jax.random.key(1), (workers * 16, 8))
    batch = trainer.put_batch((x, jnp.sin(x.sum(1))))
    for _ in range(steps):
        state, m = trainer.train_step(state, batch)
    print(f"  train loss after {steps} steps: {float(m['train_loss']):.4f}")
    return trainer.full_params(state)


if __name__ == "__main__":
    train("b-sdp")
    train("nb-sdp")

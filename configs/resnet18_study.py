"""The SDP study's vision model (``python -m sdp_jax.study sdp --arms digits``): the digits
default (``configs/resnet18_digits.py``: ResNet-18 at a quarter width on the handwritten digits
scikit-learn ships, 8 workers x 16 images) at 100 steps, evaluated every 25."""

import os
import runpy


def get_config():
    c = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                    "resnet18_digits.py"))["get_config"]()
    c.steps = 100
    c.optim.warmup_steps = 10
    c.eval_every = 25
    c.log_every = 25
    c.checkpoint_every = 50
    return c

"""wrn18 on CIFAR-10 (TFDS; `tfds build cifar10` once). CIFAR-100: --config.data.dataset=cifar100.

8 workers x 64 images, 8000 AdamW steps (about 100 epochs of CIFAR-10 at W=8).
"""

from sdp_jax.train.config import vision_config


def get_config():
    c = vision_config("wrn18", "cifar10")
    c.workers = 8
    return c

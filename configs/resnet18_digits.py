"""The embedded vision default: ResNet-18 at a quarter width (16, 32, 64, 128 channels) on the
handwritten digits scikit-learn ships (no download), resized to 32x32; 8 workers x 16 images,
250 steps (about 22 epochs), a few minutes on a laptop CPU.

    python train.py --config configs/resnet18_digits.py --workdir runs/digits
    python train.py --config configs/resnet18_digits.py --config.sdp.variant=b-sdp \
        --config.sdp.coverage=0.5 --workdir runs/digits-bsdp
"""

from sdp_jax.train.config import vision_config


def get_config():
    c = vision_config("resnet18", "digits")
    c.model.width = 16
    c.workers = 8
    c.batch_per_worker = 16
    c.steps = 250
    c.optim.warmup_steps = 25
    c.eval_every = 125
    c.log_every = 25
    c.checkpoint_every = 125
    return c

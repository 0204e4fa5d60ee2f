"""Tiny LLaMA for tests: 4 blocks of width 32 on byte-level text; seconds per step on a CPU."""

from sdp_jax.train.config import base_config


def get_config():
    c = base_config()
    c.model.update(vocab_size=256, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=64,
                   max_seq_len=64)
    c.workers = 4
    c.num_cpu_devices = 4
    c.seq_len = 32
    c.batch_per_worker = 2
    c.steps = 6
    c.eval_every = 3
    c.eval_batches = 2
    c.log_every = 1
    c.checkpoint_every = 3
    c.optim.warmup_steps = 2
    return c

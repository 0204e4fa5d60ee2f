"""The SDP study's language model (``python -m sdp_jax.study sdp``): a narrow byte-level
LLaMA of 8 blocks with 8 attention heads (no head grouping, so that N-SDP is realizable at
C = 3/8, 1/2 and 3/4) on the default corpus; 8 simulated workers x 4 sequences of 64 tokens.
"""

from sdp_jax.train.config import base_config


def get_config():
    c = base_config()
    c.model.update(vocab_size=256, d_model=64, n_layers=8, n_heads=8, n_kv_heads=8, d_ff=192,
                   max_seq_len=64)
    c.workers = 8
    c.num_cpu_devices = 8
    c.seq_len = 64
    c.batch_per_worker = 4
    c.steps = 200
    c.eval_every = 50
    c.eval_batches = 8
    c.log_every = 25
    c.checkpoint_every = 100
    c.optim.lr = 3e-3
    c.optim.warmup_steps = 20
    return c

"""LLaMA 500m (the paper's scale) for the memory benchmark and real-scale runs.

Shape: d_model=1536, 16 blocks, 12 heads (head dim 128), SwiGLU width 4096, vocab 32000
(the LLaMA tokenizer's size; for llm.c GPT-2 shards set --config.model.vocab_size=50304),
tie_embeddings=True. Parameter counts: see README.md (computed by LlamaConfig.param_count()).
"""

from sdp_jax.config import base_config


def get_config():
    c = base_config()
    c.model.update(vocab_size=32000, d_model=1536, n_layers=16, n_heads=12, n_kv_heads=12,
                   d_ff=4096, max_seq_len=2048, tie_embeddings=True)
    c.data.source = "llmc"
    c.sdp.variant = "b-sdp"
    c.workers = 8
    c.seq_len = 1024
    c.batch_per_worker = 8
    c.steps = 10000
    c.eval_every = 500
    c.checkpoint_every = 500
    c.optim.lr = 6e-4
    c.optim.warmup_steps = 500
    return c

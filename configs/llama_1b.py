"""LLaMA 1b (the paper's scale) for the memory benchmark and real-scale runs.

d_model=2048, 16 blocks, 16 heads (head dim 128), SwiGLU width 8192, vocab 32000 (the LLaMA
tokenizer's size; for llm.c GPT-2 shards set --config.model.vocab_size=50304), tied embeddings:
True. Parameter counts are in docs/models.md (LlamaConfig.param_count()).
"""

from sdp_jax.train.config import paper_scale_config


def get_config():
    return paper_scale_config(d_model=2048, n_layers=16, n_heads=16, d_ff=8192, coverage=0.6875,
                              tie_embeddings=True)

"""LLaMA 134m (the paper's scale) for the memory benchmark and real-scale runs.

d_model=768, 12 blocks, 12 heads (head dim 64), SwiGLU width 2048, vocab 32000 (the LLaMA
tokenizer's size; for llm.c GPT-2 shards set --config.model.vocab_size=50304), tied embeddings:
False. Parameter counts are in docs/models.md (LlamaConfig.param_count()).
"""

from sdp_jax.train.config import paper_scale_config


def get_config():
    return paper_scale_config(d_model=768, n_layers=12, n_heads=12, d_ff=2048, coverage=0.5,
                              tie_embeddings=False)

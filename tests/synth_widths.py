"""What the tests that write random `.fst` files with `fastar.synth` share: attention and indexer widths small enough
for a model of a few MB (pass them as `synth(..., **SMALL)`)."""

SMALL = dict(
    num_attention_heads=4,
    head_dim=64,
    qk_rope_head_dim=16,
    q_lora_rank=64,
    o_lora_rank=64,
    o_groups=2,
    index_n_heads=4,
    index_head_dim=32,
    index_topk=4,
    sliding_window=8,
)

"""Tiny transformers MoE models of real architectures (random init, fixed seed, nothing downloaded), shared by the
tests of feplb.hf and loaded by path in their worker processes."""

from __future__ import annotations

import torch

ARCHS = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")
VOCAB = 64


def make_model(arch: str, seed: int = 0, **overrides):
    """A 2-layer fp32 model of ``arch`` with 8 experts (top-2); DeepSeek-V3's first layer is dense, its second a MoE
    with one shared expert and grouped routing. ``overrides`` go to the config."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2,
                  # larger than the default 0.02, so that the experts' share of the logits is far above 1e-5
                  initializer_range=0.1)
    common.update(overrides)
    if arch == "mixtral":
        cfg = tf.MixtralConfig(**{"intermediate_size": 16, "num_local_experts": 8, **common})
        cls = tf.MixtralForCausalLM
    elif arch == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**{"intermediate_size": 32, "moe_intermediate_size": 16, "num_experts": 8,
                                   "head_dim": 8, **common})
        cls = tf.Qwen3MoeForCausalLM
    elif arch == "deepseek_v3":
        cfg = tf.DeepseekV3Config(**{"num_key_value_heads": 4, "intermediate_size": 32, "moe_intermediate_size": 16,
                                     "n_routed_experts": 8, "n_shared_experts": 1, "n_group": 2, "topk_group": 1,
                                     "first_k_dense_replace": 1, "q_lora_rank": 16, "kv_lora_rank": 16,
                                     "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
                                     **{k: v for k, v in common.items() if k != "num_key_value_heads"}})
        cls = tf.DeepseekV3ForCausalLM
    elif arch == "gpt_oss":   # transposed, interleaved, biased experts, its own clamped gate; here 2F == H
        cfg = tf.GptOssConfig(**{"intermediate_size": 16, "num_local_experts": 8, "head_dim": 8,
                                 "sliding_window": 8, **common})
        cls = tf.GptOssForCausalLM
    else:
        raise ValueError(f"arch: expected one of {ARCHS}, got {arch!r}")
    torch.manual_seed(seed)
    model = cls(cfg).float()
    with torch.no_grad():   # parameters initialised to zero (gpt-oss's biases, router, sinks) get random values
        for p in model.parameters():
            if not p.any():
                p.normal_(0.0, 0.1)
    return model


def tokens(rank: int, batch: int = 2, seq: int = 8) -> torch.Tensor:
    """Rank ``rank``'s input ids, int64 [batch, seq] (different on every rank)."""
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)

"""Tiny random DeepSeek-V2/V3 models built with transformers, saved the Hugging Face way."""

from __future__ import annotations

from pathlib import Path

import numpy as np

V3_BASE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
    num_experts_per_tok=2, n_group=4, topk_group=2, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
    qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1, max_position_embeddings=512,
    initializer_range=0.1, routed_scaling_factor=2.5, norm_topk_prob=True, bos_token_id=0, eos_token_id=1,
    tie_word_embeddings=False, rope_interleave=True,
)
V2_BASE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=8,
    num_experts_per_tok=3, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
    v_head_dim=16, first_k_dense_replace=1, max_position_embeddings=512, initializer_range=0.1,
    routed_scaling_factor=1.0, topk_method="greedy", bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}


def build_hf_model(model_type: str, seed: int = 0, **overrides):
    """A transformers DeepseekV2/V3ForCausalLM in float32 with every weight, norm and router bias random."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    if model_type == "deepseek_v3":
        config, cls = DeepseekV3Config(**{**V3_BASE, **overrides}), DeepseekV3ForCausalLM
    else:
        config, cls = DeepseekV2Config(**{**V2_BASE, **overrides}), DeepseekV2ForCausalLM
    model = cls(config).float().eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("norm.weight") or "layernorm" in name:
                tensor.copy_(1 + 0.1 * torch.randn_like(tensor))
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(0.1 * torch.randn_like(tensor))
    return model


def save_hf_model(model, directory: Path, **save_kwargs) -> Path:
    model.save_pretrained(directory, **save_kwargs)
    return directory


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


def hf_greedy(model, prompt: np.ndarray, num_tokens: int) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model.generate(torch.as_tensor(prompt, dtype=torch.long), max_new_tokens=num_tokens,
                             min_new_tokens=num_tokens, do_sample=False, pad_token_id=0)
    return out[:, prompt.shape[1]:].numpy()

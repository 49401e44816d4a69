"""Write a tiny model with random weights to argv[1] (run with .venv-sglang's python).

argv[2] picks the architecture (default ``llama``):
- ``llama``: a Llama, 2 layers, 4 query heads and 2 KV heads of 32, vocab 4096: SGLang's
  plain MHA path (one KV host pool).
- ``mellum``: JetBrains' Mellum (``MellumForCausalLM``), the same sizes with one
  sliding-window layer (window 128) and one full-attention layer, both MLPs dense: SGLang
  serves it as a hybrid SWA model (``SWAKVPool``; HiCache with a full and a sliding-window
  host pool, the second one handed to the L3 backend through the v2 interface). SGLang sizes
  its expert map from ``num_local_experts`` even when no layer is sparse, so it is 2 (unused).

float32, fixed seed: small enough for a CPU server, real enough for SGLang's model code. No
hub access is needed; the servers run with --skip-tokenizer-init, so no tokenizer is written.
"""

from __future__ import annotations

import sys

import torch

COMMON = dict(
    vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
    bos_token_id=1, eos_token_id=2, torch_dtype="float32",
)


def build(arch: str) -> torch.nn.Module:
    """The model of architecture ``arch`` with random weights."""
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**COMMON))
    if arch == "mellum":
        from transformers import MellumConfig, MellumForCausalLM

        return MellumForCausalLM(MellumConfig(
            **COMMON, sliding_window=128, layer_types=["sliding_attention", "full_attention"],
            mlp_layer_types=["dense", "dense"], num_local_experts=2, num_experts_per_tok=1,
            moe_intermediate_size=64,
        ))
    raise SystemExit(f"make_model.py: unknown architecture {arch!r} (llama or mellum)")


def main(path: str, arch: str = "llama") -> None:
    """Build and save the model (safetensors) and its config."""
    torch.manual_seed(0)
    build(arch).to(torch.float32).save_pretrained(path, safe_serialization=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])

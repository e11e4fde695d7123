"""A tiny model folder made on the spot: a `config.json` and nothing else.

The servers run it with `--load-format dummy` (random weights) and
`--skip-tokenizer-init` (requests carry token ids), so no download and no
tokenizer are needed. Greedy outputs are still deterministic for a given
seed, which is all the testbed needs of them.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 1024

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": VOCAB,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_model(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIG, indent=1))
    return folder

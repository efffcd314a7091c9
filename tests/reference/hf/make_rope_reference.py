"""Tiny random Llamas whose rotary embeddings are scaled, one per Hugging Face `rope_type`
pipec runs (llama3, yarn, linear, dynamic), and the logits transformers computes with them:
the reference pipec's `rope_scaling=` (executor/src/nn/hf_reference.rs) and `pipec import`
of a Llama 3.1 config (tests/cli.rs) are tested against.

Run once, in a throwaway venv outside the repository (torch 2.15.0, transformers 5.24.0):

    python tests/reference/hf/make_rope_reference.py

It writes, per model, `rope-<kind>/model.safetensors` (transformers' names),
`rope-<kind>/config.json` and `rope-<kind>/reference.json` (two rows of 12 token ids and
the float32 logits). The sizes make every scaling change the logits: heads of 8 features
(frequencies 1, 0.1, 0.01, 0.001 at θ 10,000) and contexts of 8 to 64 positions, so that
each kind's interpolated, blended and kept frequencies all occur; `dynamic` is given a
context of 8 positions, shorter than the 12 it is run on, beyond which it rescales.
"""

import json
import pathlib

import torch
from transformers import LlamaConfig, LlamaForCausalLM

HERE = pathlib.Path(__file__).parent

KINDS = {
    # Llama 3.1's form, its context scaled down: wavelengths above 64 divided by 8, below 16 kept
    "llama3": (
        32,
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "yarn": (32, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}),
    "linear": (32, {"rope_type": "linear", "factor": 2.0}),
    "dynamic": (8, {"rope_type": "dynamic", "factor": 4.0}),
}

for i, (kind, (positions, params)) in enumerate(KINDS.items()):
    torch.manual_seed(10 + i)
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        rope_parameters={"rope_theta": 10000.0, **params},
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_bias=False,
    )
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 + 0.2 * torch.randn_like(p)) if name.endswith("norm.weight") else 0.3 * torch.randn_like(p))
    ids = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    out = HERE / f"rope-{kind}"
    out.mkdir(exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)
    reference = {
        "made_with": f"torch {torch.__version__}, transformers {__import__('transformers').__version__}",
        "input_ids": ids.tolist(),
        "logits_shape": list(logits.shape),
        "logits": [round(float(v), 7) for v in logits.flatten()],
    }
    (out / "reference.json").write_text(json.dumps(reference) + "\n")
    print(kind, "written")

"""Tiny random Hugging Face models and their logits: the reference pipec's Llama-family and
GPT-2 layers are tested against (executor/src/hf_reference.rs).

Run once, in a throwaway venv outside the repository (torch 2.5.1, transformers 4.46.3):

    python tests/reference/hf/make_reference.py

It writes, per model, `<name>/model.safetensors` (the weights under transformers' names),
`<name>/config.json` and `<name>/reference.json` (the input ids and the float32 logits).
"""

import json
import pathlib

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

HERE = pathlib.Path(__file__).parent
torch.manual_seed(0)


def randomise(model):
    # weights large enough that every part of the block changes the logits visibly
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".ln_" in name or name.startswith("ln_f") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))


def write(name, model, vocab, seq):
    model.eval()
    ids = torch.randint(0, vocab, (2, seq))
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    out = HERE / name
    out.mkdir(exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / "reference.json").write_text(
        json.dumps(
            {
                "made_with": f"torch {torch.__version__}, transformers {__import__('transformers').__version__}",
                "input_ids": ids.tolist(),
                "logits_shape": list(logits.shape),
                "logits": [round(float(v), 7) for v in logits.flatten()],
            }
        )
        + "\n"
    )
    (out / "generation_config.json").unlink(missing_ok=True)


llama = LlamaConfig(
    vocab_size=50,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    attention_bias=False,
)
m = LlamaForCausalLM(llama).float()
randomise(m)
write("llama-gqa", m, 50, 12)

gpt2 = GPT2Config(
    vocab_size=50,
    n_embd=16,
    n_layer=2,
    n_head=4,
    n_positions=32,
    activation_function="gelu_new",
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
)
m = GPT2LMHeadModel(gpt2).float()
randomise(m)
write("gpt2", m, 50, 12)

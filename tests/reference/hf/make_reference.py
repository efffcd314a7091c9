"""Tiny random models and what PyTorch computes with them: the reference pipec's Llama-family,
Mixtral, GPT-2 and BERT layers (executor/src/hf_reference.rs, tests/cli.rs) and its torchvision
ResNet weights and batch normalisation (tests/cli.rs) are tested against.

Run once, in a throwaway venv outside the repository (torch 2.5.1, transformers 4.46.3,
torchvision 0.20.1; qwen3 needs transformers 4.51 or later, and qwen3 and mistral were made
with torch 2.15.0 and transformers 4.57.6); name models to make only those (llama-gqa, gpt2,
bert, resnet, mixtral, qwen3, mistral, gpt-oss-attention, deepseek-v3, deepseek-v3-moe):

    python tests/reference/hf/make_reference.py [NAME ...]

It writes, per model, `<name>/model.safetensors` (the weights under transformers' or
torchvision's names), `<name>/config.json` (transformers' models), `<name>/reference.json`
(the inputs, and the float32 logits or the loss) and the weights after one optimizer step
on those inputs as one batch — a language model's targets are its rows shifted by one, the
last row's last target the token 7, the loss the mean next-token cross-entropy over every
position; BERT's the mean cross-entropy with its labels; the ResNet's the same over two
microbatches of two (gradient accumulation) — with `torch.optim.AdamW` (lr 0.01, eps 1e-4
(the ResNet's 1e-2: see there), weight decay 0.1, none on one-dimensional parameters:
biases and norms) in `<name>/after-adamw.safetensors` and with SGD (lr 0.05, momentum 0.9,
weight decay 0.1) in `<name>/after-sgd.safetensors`.
"""

import copy
import json
import pathlib
import sys

import torch
from safetensors.torch import save_file
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
)

HERE = pathlib.Path(__file__).parent
torch.manual_seed(0)


def randomise(model):
    # weights large enough that every part of the block changes the logits visibly
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".ln_" in name or name.startswith("ln_f") or "layernorm" in name or "LayerNorm.weight" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))


def write(name, model, inputs, loss_of, extra=None, optimizers=None):
    """A model's fixture: `model.safetensors` and `config.json`, `reference.json` (the
    keyword `inputs`, `extra` and the float32 logits), and the weights after one step of
    each of `optimizers` (`OPTIMIZERS` unless given) with the loss `loss_of(logits)`, named
    `<optimizer>.safetensors`."""
    model.eval()
    with torch.no_grad():
        logits = model(**inputs).logits.float()
    out = HERE / name
    out.mkdir(exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    reference = {"made_with": f"torch {torch.__version__}, transformers {__import__('transformers').__version__}"}
    reference.update({k: v.tolist() for k, v in inputs.items()})
    reference.update(extra or {})
    reference["logits_shape"] = list(logits.shape)
    reference["logits"] = [round(float(v), 7) for v in logits.flatten()]
    (out / "reference.json").write_text(json.dumps(reference) + "\n")
    (out / "generation_config.json").unlink(missing_ok=True)
    for after, make in optimizers or OPTIMIZERS:
        m = copy.deepcopy(model).train()
        opt = make(m)
        loss = loss_of(m(**inputs).logits)
        loss.backward()
        opt.step()
        # the weights under their checkpoint names (a tied output layer saved once)
        tied = getattr(m.config, "tie_word_embeddings", False)
        state = {k: v.detach().contiguous() for k, v in m.state_dict().items() if not (k == "lm_head.weight" and tied)}
        save_file(state, out / f"{after}.safetensors", metadata={"loss": f"{loss.item():.9f}"})


def write_language_model(name, model, vocab, seq, optimizers=None):
    """A causal language model's fixture: two rows of `seq` random token ids as one batch —
    the targets are the rows shifted by one, the last row's last target the token 7, the
    loss the mean next-token cross-entropy over every position. The ids are drawn even when
    `name` is not to be made, so that the models after it draw what a whole run draws."""
    ids = torch.randint(0, vocab, (2, seq))
    if not wanted(name):
        return
    flat = ids.flatten()
    targets = torch.cat([flat[1:], torch.tensor([7])])

    def loss_of(logits):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets)

    write(name, model, {"input_ids": ids}, loss_of, optimizers=optimizers)


def adamw(eps):
    """AdamW at lr 0.01, weight decay 0.1 on the matrices and none on vectors (pipec's
    rule), with `eps` as given."""
    return lambda m: torch.optim.AdamW(
        [
            {"params": [p for p in m.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=0.01,
        eps=eps,
    )


OPTIMIZERS = [
    # GPT-2's key bias has a gradient of zero but for rounding (softmax does not see it):
    # with eps 1e-8 Adam would amplify that noise into a whole step
    ("after-adamw", adamw(1e-4)),
    ("after-sgd", lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=0.1)),
]


ONLY = set(sys.argv[1:])  # names to (re)make; all when none are given


def wanted(name):
    return not ONLY or name in ONLY


# the tiny Llama-family sizes the Llama and the Mixtral fixtures share
TINY_LLAMA = dict(
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
)
llama = LlamaConfig(**TINY_LLAMA, attention_bias=False)
# llama-gqa and gpt2 share the random stream seeded above: each is built and its ids drawn
# whether or not it is made, so a partial run makes the same bytes as a whole one
m = LlamaForCausalLM(llama).float()
randomise(m)
write_language_model("llama-gqa", m, 50, 12)

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
write_language_model("gpt2", m, 50, 12)

# A BERT sequence classifier (post-norm blocks, exact GELU, token types, the pooler): rows
# `[CLS] A [SEP] B [SEP]` with [CLS] = 1 and [SEP] = 2, their token types as a Hugging Face
# tokenizer gives a pair (0 up to and with the first [SEP], 1 after) — pipec's
# `embedding(..., types=2, sep=2)` derives the same from the ids.
bert = BertConfig(
    vocab_size=50,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=24,
    max_position_embeddings=32,
    type_vocab_size=2,
    hidden_act="gelu",
    layer_norm_eps=1e-12,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    num_labels=3,
)
if wanted("bert"):
    torch.manual_seed(1)
    m = BertForSequenceClassification(bert).float()
    randomise(m)
    ids = torch.randint(3, 50, (2, 12))
    ids[:, 0] = 1
    ids[0, 6] = 2
    ids[1, 4] = 2
    ids[:, 11] = 2
    seps = (ids == 2).long()
    types = (torch.cumsum(seps, 1) - seps).clamp(max=1)
    labels = torch.tensor([0, 2])
    write(
        "bert",
        m,
        {"input_ids": ids, "token_type_ids": types},
        lambda logits: torch.nn.functional.cross_entropy(logits, labels),
        {"labels": labels.tolist()},
    )

# A torchvision ResNet (BasicBlock, one block per stage, narrowed to 8/8/16/16 channels by
# torchvision's own `_make_layer`, so every name is torchvision's) with randomised batch
# normalisation, four 40×40 images and their labels, and one step of AdamW and one of SGD
# with momentum and weight decay (as above), each with gradient accumulation over two
# microbatches of two — `nn.BatchNorm2d`
# moves its running statistics at each of the two forwards (pipec's
# `running_stats: per_forward`).
if wanted("resnet"):
    from torch import nn
    from torchvision.models.resnet import BasicBlock, ResNet

    torch.manual_seed(2)
    m = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=5)
    m.inplanes = 8
    m.conv1 = nn.Conv2d(3, 8, kernel_size=7, stride=2, padding=3, bias=False)
    m.bn1 = nn.BatchNorm2d(8)
    m.layer1 = m._make_layer(BasicBlock, 8, 1)
    m.layer2 = m._make_layer(BasicBlock, 16, 1, stride=2)
    m.layer3 = m._make_layer(BasicBlock, 16, 1, stride=2)
    m.layer4 = m._make_layer(BasicBlock, 16, 1, stride=2)
    m.fc = nn.Linear(16, 5)
    with torch.no_grad():
        for name, mod in m.named_modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.weight.copy_(1.0 + 0.2 * torch.randn_like(mod.weight))
                mod.bias.copy_(0.1 * torch.randn_like(mod.bias))
                mod.running_mean.copy_(0.1 * torch.randn_like(mod.running_mean))
                mod.running_var.copy_(1.0 + 0.2 * torch.rand_like(mod.running_var))
    images = torch.randn(4, 3, 40, 40)
    labels = torch.tensor([0, 3, 1, 4])
    out = HERE / "resnet"
    out.mkdir(exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in m.state_dict().items()}
    save_file(state, out / "model.safetensors")
    save_file({"images": images.contiguous(), "labels": labels.float()}, out / "inputs.safetensors")
    # AdamW's eps 1e-2 here: a convolution's weight gradient sums hundreds of products
    # through four batch norms, and pipec's and torch's differ by ~1e-7 (float rounding in
    # another order); Adam's first step lr·g/(|g| + eps) passes that on times up to lr/eps,
    # which with eps 1e-4 is ~1e-6 on weights of ~0.1, above the 1e-5 relative the test
    # asks (SGD passes it on times lr: ~1e-9)
    resnet_optimizers = [("after-adamw", adamw(1e-2)), OPTIMIZERS[1]]
    for after, make in resnet_optimizers:
        t = copy.deepcopy(m).train()
        opt = make(t)
        losses = []
        for k in range(2):
            loss = torch.nn.functional.cross_entropy(t(images[2 * k : 2 * k + 2]), labels[2 * k : 2 * k + 2]) / 2
            loss.backward()
            losses.append(loss.item() * 2)
        opt.step()
        state = {k: v.detach().contiguous() for k, v in t.state_dict().items()}
        save_file(state, out / f"{after}.safetensors", metadata={"loss": f"{sum(losses) / 2:.9f}"})
    (out / "reference.json").write_text(
        json.dumps(
            {
                "made_with": f"torch {torch.__version__}, torchvision {__import__('torchvision').__version__}",
                "train_loss": sum(losses) / 2,
            }
        )
        + "\n"
    )

# A Mixtral (a mixture of experts in place of each block's MLP: a softmax router over 4
# SwiGLU experts, the top 2 per token renormalised, no load-balancing loss — transformers
# adds it only with output_router_logits). Its own seed, so the fixtures above stay as they
# were.
mixtral = MixtralConfig(
    **TINY_LLAMA,
    num_local_experts=4,
    num_experts_per_tok=2,
    output_router_logits=False,
    router_jitter_noise=0.0,
    sliding_window=None,
)
if wanted("mixtral"):
    torch.manual_seed(3)
    m = MixtralForCausalLM(mixtral).float()
    randomise(m)
    write_language_model("mixtral", m, 50, 12)

# A Qwen3 (heads of their own size: 4 query heads of 8 features on d = 16, so the query
# projection is 16 → 32 and the output projection 32 → 16, and 2 key/value heads of 8; an
# RMSNorm over each query and key head before the rotary embeddings). Qwen3 is in
# transformers from 4.51: this one was made with torch 2.15.0 and transformers 4.57.6 (its
# reference.json says so). Its own seed, so the fixtures above stay as they were.
if wanted("qwen3"):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    qwen3 = Qwen3Config(**TINY_LLAMA, head_dim=8, attention_bias=False, use_sliding_window=False)
    torch.manual_seed(4)
    m = Qwen3ForCausalLM(qwen3).float()
    randomise(m)
    write_language_model("qwen3", m, 50, 12)

# A Mistral: the Llama block with a sliding window of 4 — each position attends to itself
# and the 3 before it (transformers' `sliding_window`), so on 12 positions most rows see
# less than their whole past. Made with torch 2.15.0 and transformers 4.57.6 (its
# reference.json says so); its own seed, so the fixtures above stay as they were.
if wanted("mistral"):
    from transformers import MistralConfig, MistralForCausalLM

    mistral = MistralConfig(**TINY_LLAMA, sliding_window=4, attn_implementation="eager")
    torch.manual_seed(5)
    m = MistralForCausalLM(mistral).float()
    randomise(m)
    # AdamW's eps 1e-3 here: a key projection weight's gradient of 6e-5 takes AdamW's first
    # step lr·g/(|g| + eps) through a slope lr·eps/(|g| + eps)² of 40 with eps 1e-4, which
    # turns pipec's and torch's fp32 gradients' ~4e-7 difference (sums in another order
    # under the window's mask) into 1.6e-5 on weights of 0.8, above the test's 1e-5
    # relative; with 1e-3 the slope is 9
    write_language_model("mistral", m, 50, 12, [("after-adamw", adamw(1e-3)), OPTIMIZERS[1]])

# GPT-OSS's attention core with its sinks (transformers' `eager_attention_forward` of
# gpt_oss: a learned logit per head joins each softmax and weighs no value), alone: 4 query
# heads sharing 2 key/value heads of 8 features, 6 positions, causal in a sliding window of
# 3 (as its sliding layers), sinks of both signs. It writes the inputs, the output
# [batch, seq, heads, head_dim] and the gradients of sum(output ⊙ weights) with respect to
# the queries, keys, values and sinks.
if wanted("gpt-oss-attention"):
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    torch.manual_seed(6)
    b, h, kv, s, dh, window = 2, 4, 2, 6, 8, 3
    q = torch.randn(b, h, s, dh, requires_grad=True)
    k = torch.randn(b, kv, s, dh, requires_grad=True)
    v = torch.randn(b, kv, s, dh, requires_grad=True)
    module = torch.nn.Module()
    module.sinks = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    module.num_key_value_groups = h // kv
    module.training = False
    at = torch.arange(s)
    seen = (at[None, :] <= at[:, None]) & (at[:, None] - at[None, :] < window)
    mask = torch.where(seen, 0.0, torch.finfo(torch.float32).min)[None, None]
    out, _ = eager_attention_forward(module, q, k, v, mask, dh**-0.5)
    weights = torch.randn(out.shape)
    (out * weights).sum().backward()
    target = HERE / "gpt-oss-attention"
    target.mkdir(exist_ok=True)
    flat = lambda t: [round(float(x), 7) for x in t.detach().flatten()]
    (target / "reference.json").write_text(
        json.dumps(
            {
                "made_with": f"torch {torch.__version__}, transformers {__import__('transformers').__version__}",
                "shape": {"batch": b, "heads": h, "kv_heads": kv, "seq": s, "head_dim": dh, "window": window},
                "q": flat(q),
                "k": flat(k),
                "v": flat(v),
                "sinks": flat(module.sinks),
                "weights": flat(weights),
                "out": flat(out),
                "dq": flat(q.grad),
                "dk": flat(k.grad),
                "dv": flat(v.grad),
                "dsinks": flat(module.sinks.grad),
            }
        )
        + "\n"
    )

def tiny_deepseek(**changes):
    """The tiny DeepSeek-V3 both DeepSeek fixtures start from: d = 16, 2 layers, latent
    attention (query latent 8, key/value latent 8, heads of 4 + 4 rotary, values of 6)."""
    from transformers import DeepseekV3Config

    settings = dict(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=24,
        moe_intermediate_size=8,
        num_hidden_layers=2,
        first_k_dense_replace=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=8,
        kv_lora_rank=8,
        qk_nope_head_dim=4,
        qk_rope_head_dim=4,
        v_head_dim=6,
        max_position_embeddings=32,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_bias=False,
        rope_interleave=True,
        attn_implementation="eager",
    )
    settings.update(changes)
    return DeepseekV3Config(**settings)


# A DeepSeek-V3 of dense blocks (`first_k_dense_replace` = every layer: the MLPs are SwiGLU,
# no experts): multi-head latent attention — the queries from a latent of 8 features, the
# keys and values from a latent of 8 and a shared rotary key of 4, 4 heads whose queries and
# keys have 4 features without rotary embeddings and 4 with, values of 6 — with the rotary
# parts interleaved as DeepSeek's checkpoints store them (`rope_interleave`). Made with torch
# 2.15.0 and transformers 4.57.6 (its reference.json says so); its own seed.
if wanted("deepseek-v3"):
    from transformers import DeepseekV3ForCausalLM

    deepseek = tiny_deepseek()
    torch.manual_seed(7)
    m = DeepseekV3ForCausalLM(deepseek).float()
    randomise(m)
    write_language_model("deepseek-v3", m, 50, 12)

# A DeepSeek-V3 with its mixture of experts: one dense block, then one of 8 routed experts of
# 8 (4 per token from the 2 best of 4 groups, sigmoid scores renormalised and times 2.5) and
# a shared one, under YaRN (factor 4 over 8 positions, mscale_all_dim 1: the softmax's scale
# times (0.1 ln 4 + 1)²). The correction bias stays zero, as transformers initialises it.
# Made with torch 2.15.0 and transformers 4.57.6; its own seed.
if wanted("deepseek-v3-moe"):
    from transformers import DeepseekV3ForCausalLM

    deepseek = tiny_deepseek(
        first_k_dense_replace=1,
        n_routed_experts=8,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    )
    torch.manual_seed(11)
    m = DeepseekV3ForCausalLM(deepseek).float()
    randomise(m)
    write_language_model("deepseek-v3-moe", m, 50, 12)

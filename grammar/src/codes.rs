//! The registry of diagnostic codes: each with a title and the long explanation that
//! `pipec explain CODE` prints. Codes are stable: never reuse or renumber one.
//!
//! Ranges: E01xx document structure, E02xx quantities, E03xx model, E04xx strategy,
//! E05xx training, E06xx plan (compiler), E07xx engines (`engine:`), E09xx internal.

/// One registered code.
#[derive(Debug, Clone, Copy)]
pub struct CodeInfo {
    pub code: &'static str,
    pub title: &'static str,
    pub explanation: &'static str,
}

/// Looks a code up (case-insensitive).
pub fn lookup(code: &str) -> Option<&'static CodeInfo> {
    CODES.iter().find(|c| c.code.eq_ignore_ascii_case(code))
}

macro_rules! codes {
    ($($code:literal, $title:literal, $expl:literal;)*) => {
        /// Every registered code.
        pub const CODES: &[CodeInfo] = &[$(CodeInfo { code: $code, title: $title, explanation: $expl }),*];
    };
}

codes! {
"E0101", "YAML syntax error",
"The file is not valid YAML, so nothing else in it can be checked.

Example:

    strategy:
      stages: [2, 1
      schedule: 1f1b

The flow list `[2, 1` is never closed. Fix the YAML first; pipec then reports
every other problem at once.";

"W0106", "an inter-node bandwidth past one device's network adapter",
"`cluster.links.inter_node.bandwidth` is per device: each device's share of the network
between nodes, one direction (a DGX H100 has 8 × 400 Gb/s ConnectX-7 adapters, one per GPU,
so `bandwidth: 400Gbps`). A figure above the fastest adapter one device has (800 Gb/s,
NVIDIA ConnectX-8) is most likely the node's total, which would give every device
`devices_per_node` times its real bandwidth and make every collective across nodes look
that much faster.

    cluster:
      devices_per_node: 8
      links:
        inter_node: { bandwidth: 3200Gbps, latency: 6us }   # warning: the node's total

Write each device's share (3200 Gb/s ÷ 8 = `400Gbps`).";

"E0102", "unknown key",
"A mapping has a key pipec does not know. Keys are case-sensitive and spelled with
underscores. The help names the closest known key; `pipec schema` lists them all.

Example:

    strategy:
      microbatch: 8      # error: unknown key, did you mean `microbatches`?";

"E0103", "wrong type",
"A value has the wrong YAML type: a string where a number is needed, a list where a
mapping is needed, and so on.

Example:

    training:
      batch_size: large   # error: expected an integer";

"E0104", "missing key",
"A required key is absent. Each section's required keys are listed in docs/spec.md.

Example:

    cluster:
      nodes: 1
      # error: `devices_per_node` is missing";

"E0105", "invalid value",
"The value has the right type but is not one of the allowed values, or is out of range
(a zero where a positive number is needed, a learning rate of 0, ...). Also past the size
pipec plans, so any spec is checked and compiled in bounded time and memory: at most
65,536 devices, 1,000,000 layers after `repeat`, and 1,048,576 forward passes per step
(stage chunks × microbatches).

Example:

    model:
      loss: hinge          # error: expected `cross_entropy` or `mse`";

"E0201", "malformed quantity",
"A quantity must be a number followed by a unit, like `16GiB`, `900GB/s`, `10Gbps`,
`5us` or `312TFLOP/s`. The unit is missing or unknown.

Example:

    memory: 16 gigs       # error: unknown unit `gigs`";

"E0202", "wrong kind of unit",
"The unit exists but measures something else: a bandwidth where a memory size is
needed, a time where a bandwidth is needed, ...

Example:

    device:
      memory: 900GB/s     # error: expected a size in bytes, found a bandwidth";

"E0203", "quantity out of range",
"The quantity must be larger than zero (memory, bandwidth and throughput) or not
negative (latency).";

"E0301", "layer syntax error",
"A layer item does not follow the layer language:

    item  := [repeat N:] call (-> call)*
    call  := name [(arg, key=arg, ...)] [as label]

Example:

    - linear(784, 1024 -> relu   # error: expected `,` or `)`";

"E0302", "unknown layer",
"The layer name is not one pipec knows. Known layers: linear, conv2d, maxpool2d,
avgpool2d, flatten, relu, gelu, tanh, sigmoid, layernorm, dropout, embedding,
transformer_block.";

"E0303", "bad layer arguments",
"A layer got too many or too few arguments, an unknown keyword, or a value of the
wrong type. Signatures:

    linear(in, out, bias=true)
    conv2d(in, out, k, stride=1, pad=0, bias=true)
    maxpool2d(k, stride=k)     avgpool2d(k, stride=k)
    dropout(p)                 layernorm [(d)]
    embedding(vocab, d)        transformer_block(d, heads, ff)";

"E0304", "shape mismatch",
"The shape flowing into a layer does not fit it. pipec infers the per-sample shape from
`model.input` through every layer; the label shows the shape that arrives.

Example:

    input: [784]
    layers:
      - linear(100, 10)     # error: expects 100 input features, input has 784

At `add` every operand must have the same shape, at `concat` every dimension but the
first; the diagnostic names each operand's shape:

      - add(branch, in)     # error: add needs operands of one shape, got [256, 56, 56] and [64, 56, 56]";

"E0305", "duplicate layer label",
"Two layers carry the same `as` name, so neither a partition nor a later `add`/`concat`
can tell them apart. Names inside `repeat` get `.0`, `.1`, ... appended for partitions,
and each copy's name refers to the latest copy for what follows. `input` and `in` are
reserved, and a tensor cannot take the name of a layer or block.";

"E0306", "loss does not fit the model output",
"`cross_entropy` needs a last layer with a vector output of at least two classes;
`mse` needs a vector output. Add a `flatten` or a final `linear`.";

"E0307", "unknown tensor",
"A chain starts from, or a join names, a tensor that is not defined above. Tensors are
named with `as NAME` after a call and can be used by any later item; `input` is the
model's input and `in` a block's input. A name is visible where it was defined: inside a
block only the block's own names and `in`.

Example:

    layers:
      - conv2d(3, 64, k=3, pad=1) -> batchnorm2d as stem
      - stem -> conv2d(64, 64, k=3, pad=1) as branch
      - add(stme, branch)      # error: unknown tensor `stme`, did you mean `stem`?";

"E0308", "misplaced tensor name or join",
"`add(a, b, ...)` and `concat(a, b, ...)` take the tensors they name (two or more), so
they start their item: `- add(branch, shortcut) -> relu`. A tensor name can only start a
chain (`- x -> conv2d(...)`), and `as` names a layer's output, not an existing tensor.

Example:

    layers:
      - conv2d(64, 64, k=1) -> add(in)     # error: `add` must start its item";

"E0309", "bad block definition or call",
"A block is defined under `model.blocks` as `name(param, param=default)` mapped to its
items, and called like a layer with its arguments, by position or by name. The name may
not be a layer's, parameters are names (`true`, `false`, `input` and `in` are reserved),
and a call must give every parameter without a default exactly once.

Example:

    blocks:
      bottleneck(cin, mid, cout, stride=1):
        - conv2d(cin, mid, k=1) -> batchnorm2d -> relu
        - ...
    layers:
      - bottleneck(64, 64)              # error: missing its argument `cout`";

"E0310", "block calls itself",
"A block calls itself, directly or through other blocks. Blocks are expanded in place, so
a recursive block would never end; repeat a block with `repeat N: block(...)` instead.";

"W0311", "unused tensor or block",
"An output that nothing reads (a branch that is never joined back, an unused named
tensor) or a block that is never called. The work is still planned and run, so this is
usually a mistake: join the branch with `add`/`concat`, or remove it.";

"E0313", "blocks nested too deeply",
"Block calls nest more than 64 deep: a block calls a block that calls a block, and so on.
Each call is expanded in place, and pipec bounds the nesting so that a spec cannot exhaust
the checker's stack. Real models nest a few levels; flatten the nest by listing several
calls in one block, or repeat one call with `repeat N:`.";

"E0312", "a tied layer does not fit its embedding",
"`linear(d, vocab, bias=false, tie=NAME)` ties the output projection to the embedding whose
output is named NAME (`embedding(vocab, d) as NAME`): its weight is the transpose of the
embedding table, as in GPT-2. The name must be an `embedding`'s output, the linear layer must
map the embedding's d features to its vocab scores, and it has no bias. When the two layers
land on different pipeline stages each stage keeps a copy and their gradients are summed
(`tiedallreduce` in the streams) before every update, so the copies stay equal; that needs a
synchronous schedule.";

"W0314", "a layer argument that does not apply",
"A layer is given an argument that changes nothing for it, so it is ignored: a mixture of
experts' settings (`top_k`, `shared_experts`, `capacity`, `router`, `norm_topk`,
`aux_loss`, `skew`) on a `transformer_block` without `experts=`, or multi-head latent
attention's sizes (`q_lora`, `rope_dim`, `v_head_dim`) on one without `kv_lora=`. Usually
the block was meant to have them; add `experts=E` (or `kv_lora=R`), or remove the argument.

Example:

    - repeat 32: transformer_block(d=4096, heads=32, ff=14336, top_k=2)   # warning: no experts";

"E0315", "multi-token prediction does not fit the model",
"`model.mtp` is DeepSeek-V3's multi-token prediction: after the last transformer block,
each module embeds the tokens k positions on with the model's embedding, joins them to the
previous hidden state (two RMSNorms and a projection from 2·d to d), runs one transformer
block shaped as the model's last, and scores the vocabulary with the model's output layer.
So the model must be a causal language model: `embedding(vocab, d)` first, a causal
`transformer_block` of width d, `linear(d, vocab)` last, and `loss: cross_entropy`.

Example:

    model:
      input: [4096]
      layers:
        - embedding(129280, 7168)
        - repeat 61: transformer_block(d=7168, heads=128, ff=18432, causal=true, ...)
        - rmsnorm
        - linear(7168, 129280, bias=false)
      loss: cross_entropy
      mtp: 1                            # or { depth: 1, weight: 0.1 }";

"E0401", "strategy syntax error",
"`strategy.stages` is PipeDream notation: replica counts per stage joined by `-`
(`2-1-1`), or `straight`. A bare number must be quoted (`\"4\"` = one stage on four
workers).";

"E0402", "strategy does not match the cluster",
"The strategy needs a different number of devices than the cluster has. `2-1-1` needs
2+1+1 = 4 workers (times `tp`); `dp × pp × tp` must equal nodes × devices_per_node.

Example:

    cluster: { nodes: 1, devices_per_node: 3, ... }
    strategy: { stages: \"2-1-1\" }     # error: needs 4 devices, cluster has 3";

"E0403", "more stages than layers",
"Every pipeline stage (and every virtual stage of an interleaved schedule) needs at
least one layer.";

"E0404", "microbatches do not divide the batch",
"The global batch is split over data-parallel replicas and then into microbatches;
`batch_size` must be divisible by replicas × microbatches so every microbatch has the
same size (the result must equal one-device training).";

"E0405", "schedule does not fit the strategy",
"The schedule or one of its options makes no sense for this strategy: `interleaved`
needs at least 2 stages and `virtual_stages` ≥ 2, `chimera` an even number of stages
and of microbatches (with stages replicated R times, a multiple of 2R: each of the R
pipeline pairs sends half of its share down and half up), `zbv` two chunks per device, `dp-only` exactly one stage, a synchronous pipeline
schedule wants at least as many microbatches as stages, ...";

"E0406", "partition ranges overlap",
"Two stages of an explicit partition claim the same layer. Each layer belongs to
exactly one stage.";

"E0407", "partition leaves a gap",
"An explicit partition must cover every layer once, in order, with contiguous stages.
Some layers are in no stage, or stages are out of order.";

"E0408", "partition range out of range",
"A partition range names a layer index past the end of the model, a label no layer
carries, or is empty.";

"E0409", "partition has the wrong number of stages",
"An explicit partition needs one entry per pipeline stage (times `virtual_stages` for
interleaved schedules).";

"E0410", "conflicting strategy keys",
"`stages` (PipeDream notation) and `dp`/`pp` describe the same thing two ways; give one.
A partition written out (`partition: [\"0..4\", \"4..\"]`) in a strategy the search fills
in (an `auto` field or a `search` mapping) is refused too, and so are a schedule's `sync`,
`reduce`, `staleness` and `vertical_sync` there, which the search does not write: the
search lays stages out itself (`partition: balanced`, and PipeDream's planner).";

"E0411", "strategy does not fit the model",
"The strategy asks for something the model cannot do. Tensor parallelism (`tp` > 1)
splits consecutive layers of a chain (Megatron's column- and row-parallel pairs and
transformer blocks), so a model with branches or joins (`add`, `concat`, a tensor read
again later) runs with `tp: 1`, using pipeline and data parallelism. An output layer tied to
the embedding (`tie=`) on another stage needs a synchronous schedule: `pipedream` and `2bw`
update each stage on its own clock, so the two copies of the tied weight would drift apart.";

"E0412", "recompute names a stage the strategy does not have",
"`recompute` takes `true` (every stage), `false`, or a list of stage indices counted
from 0 — one per virtual stage for interleaved schedules, so `[0, 1]` with 4 stages
recomputes the first two. An index must be below the number of stages the strategy has
(for a layout PipeDream's planner picks, the number it picked).";

"E0413", "sequence parallelism without tensor parallelism",
"`sequence_parallel: true` splits a transformer block's layer norms, dropout and residual
adds along the sequence over the tensor-parallel group, turning each of its all-reduces
into a reduce-scatter and an all-gather (Korthikanti et al. 2022). It needs a tensor-parallel
group to split over: set `tp` above 1, or remove it.

    strategy:
      stages: straight
      tp: 1
      sequence_parallel: true   # error: nothing to split over";

"E0414", "ZeRO sharding without data parallelism",
"`zero` shards state across the data-parallel replicas of a stage: 1 the optimizer state
and master weights (12 bytes per parameter under Adam with mixed precision become 12/d),
2 also the gradients, 3 also the weights, gathered a layer at a time for its forward and its
backward. With no replicated stage there is nothing to shard over: replicate stages
(`dp` > 1, or PipeDream notation such as `stages: \"2-2\"`), or remove `zero`.

    strategy:
      dp: 1
      pp: 4
      zero: 1   # error: every stage has one replica";

"E0415", "ZeRO sharding with an asynchronous schedule",
"`zero` shards a stage's optimizer state (and gradients, and weights) across its replicas:
every step they reduce-scatter the gradients, each updates its shard, and (stages 1 and 2)
they all-gather the weights. That needs the replicas to update together, once per step.
PipeDream and PipeDream-2BW update each stage on its own clock (after every microbatch, or
every few), and asynchronous data parallelism (`sync: asp`) applies each replica's gradient
on a parameter server, so there is no step at which the shards meet. Use a synchronous
schedule, or remove `zero`.

    strategy:
      stages: \"2-2\"
      schedule: pipedream   # error with zero
      zero: 1";

"E0416", "expert parallelism without experts",
"`ep` divides every expert block's experts over the members of an expert-parallel group:
each holds `experts / ep` of them, and tokens travel to their experts' member and back in
all-to-all exchanges. A model without `experts=` blocks has nothing to divide. Give the
transformer blocks experts, or remove `ep`.

    model:
      layers:
        - repeat 4: transformer_block(d=64, heads=4, ff=256)   # dense MLPs
    strategy:
      dp: 4
      ep: 2   # error: no expert blocks";

"E0417", "expert parallelism that does not divide the replicas",
"An expert-parallel group is `ep` consecutive replicas of a stage (Megatron-LM's layout:
expert parallelism inside data parallelism). Every stage's replica count must be a
multiple of `ep`, so that every replica belongs to one group and every group holds every
expert once. Replicate the stages more (`dp` a multiple of `ep`), or lower `ep`.

    strategy:
      dp: 2
      ep: 4   # error: 2 replicas cannot form groups of 4";

"E0418", "expert parallelism that does not divide the experts",
"Each member of an expert-parallel group holds an equal share of every expert block's
experts, so `ep` must divide each block's `experts`. Choose `ep` among the divisors the
help lists, or change the number of experts.

    layers:
      - repeat 4: transformer_block(d=64, heads=4, ff=256, experts=6)
    strategy:
      dp: 4
      ep: 4   # error: 6 experts do not split 4 ways";

"E0419", "expert parallelism with an asynchronous schedule",
"An expert-parallel group's members exchange tokens inside every forward and backward, so
they must run those passes together: a schedule whose replicas update on their own clock
(PipeDream, 2BW) or asynchronous data parallelism (`sync: asp`) cannot be expert-parallel.
(Under Chimera and DualPipe a group is made of one direction's copies of a stage across
pipeline pairs, which do run together.) Every ZeRO level combines with `ep`: the dense
parameters are sharded over all of a stage's replicas, the experts' over the replicas
holding the same experts. Use a synchronous schedule, or remove `ep`.

    strategy:
      dp: 4
      ep: 2
      schedule: { kind: dp-only, sync: asp }   # error with ep";

"E0420", "context parallelism on a model that is not split along its sequence",
"`cp` splits every microbatch's sequence over a group of devices: each computes the
embedding, the per-token layers and its queries for its own positions, and attention
gathers the group's keys and values. That is exact only where attention is the one layer
that mixes positions: a chain from a token embedding (without token types) through
transformer blocks (with or without experts) and
per-token layers (linear, norms, dropout, activations, a learned position table), ending
in a cross-entropy over every position. Recurrent layers, pooling over the sequence,
convolutions and graphs are not split. Use `cp` with such a language model, or remove it.

    model:
      input: [64]
      layers:
        - embedding(vocab=256, dim=64)
        - lstm(input=64, hidden=64)   # error with cp: mixes positions step by step
        - linear(64, 256)
      loss: cross_entropy
    strategy:
      cp: 2";

"E0421", "a context-parallel degree that does not divide the sequence",
"Context parallelism cuts each sequence into 2·cp equal chunks and gives member c chunks
c and 2·cp − 1 − c, so that under a causal mask every member has the same attention work
(the early chunks attend to little, the late ones to much). 2·cp must divide the
sequence length. Choose cp from the help's list, or change the sequence length.

    model:
      input: [100]   # 100 positions
    strategy:
      cp: 4          # error: 8 chunks of 100 positions";

"E0422", "context parallelism with a schedule it cannot run under",
"A context-parallel group's members exchange keys and values inside every attention, so
they must run every forward and backward together, and they sum their gradients with the
data-parallel replicas' once per step. Schedules whose replicas update on their own clock
(PipeDream, 2BW, asynchronous data parallelism) cannot be context-parallel; nor yet can
schedules that place two copies of a stage per pipeline (Chimera, DualPipe, DualPipeV,
ZB-V). Use `gpipe`, `1f1b`, `interleaved`, `zb-h1` or `dp-only`,
or remove `cp` (`cp: auto` lets the strategy search pick a degree under the schedules it
allows).

    strategy:
      stages: \"1-1\"
      schedule: pipedream   # error with cp
      cp: 2";

"E0423", "tensor-parallel overlap without tensor parallelism",
"`tp_overlap: true` overlaps each layer's tensor-parallel collectives with its computation
(Megatron-LM's `--tp-comm-overlap`), so the plan prices only the part of them that the
layer's passes do not cover. Without a tensor-parallel group there is nothing to overlap:
set `tp` above 1, or remove it.

    strategy:
      stages: straight
      tp: 1
      tp_overlap: true   # error: no tensor-parallel collectives";

"E0424", "a context-parallel ring without context parallelism",
"`cp_comm: ring` passes each transformer block's keys and values around the
context-parallel group a block at a time, under the attention over the block before, and
keeps only the member's own (Megatron-LM's `--cp-comm-type p2p`). Without context
parallelism there is no group to pass them around: set `cp` above 1 (or `cp: auto`), or
remove `cp_comm`.

    strategy:
      stages: straight
      cp_comm: ring   # error: `cp` is 1";

"E0425", "a recompute policy that does not go together",
"`recompute` as a mapping says what every transformer block recomputes: `modules`
(Megatron-LM's recompute_modules: the parts whose outputs are recomputed) or `ops` (the
operations whose outputs are kept, all else recomputed: torchtitan's op-level policy),
`layers` (the first blocks of every stage recompute their whole forward) and `offload`.
`modules` and `ops` are two answers to one question: name one. A mapping that names
nothing recomputes nothing: write `recompute: false`.

    strategy:
      recompute: { modules: [core_attn], ops: [attention] }   # error: both";

"E0427", "expert-parallel overlap where it cannot run",
"`ep_overlap: true` runs Megatron-LM's expert-parallel overlap (its combined 1F1B): one
more forward before the first backward, then each forward together with the backward of
an earlier microbatch, each pass's all-to-alls under the other's computation. It needs
expert parallelism (`ep` above 1 or `ep: auto`) and a schedule with that 1F1B phase:
`1f1b`, `dp-only` or `interleaved` (DualPipe and DualPipeV overlap their own pairs).

    strategy:
      ep: 1
      ep_overlap: true   # error: no all-to-alls to overlap";

"E0428", "expert tensor parallelism that does not fold",
"`etp` is the expert tensor-parallel degree: `tp` (the default: each routed expert split
over the tensor-parallel ranks like the rest of the block, `ep` counting replicas) or 1
(each expert whole on one device, Megatron-LM's `--expert-tensor-parallel-size 1` and
torchtitan's `expert_tensor_parallel_degree = 1`). With `etp: 1` the expert-parallel group
of `ep` devices is made of the tensor-parallel ranks of ep / tp consecutive replicas: `ep`
must be a multiple of `tp`, and each rank dispatches its share of the sequence, which
needs `sequence_parallel: true`. Other degrees are not run by torchtitan and not modelled.

    strategy:
      dp: 4
      tp: 4
      ep: 2        # error with etp: 1: not a multiple of tp
      etp: 1
      sequence_parallel: true";

"W0426", "a recompute module that applies to no block",
"A recompute module names a part no transformer block of the model has: `moe_act`, `moe`
or `shared_experts` without a mixture of experts (or without shared experts),
`mla_up_proj` without multi-head latent attention, `mlp` where every block's MLP is a
mixture of experts, `core_attn` or `layernorm` without blocks. It recomputes nothing;
remove it.

    strategy:
      recompute: { modules: [moe_act] }   # warning on a dense model";

"E0501", "bad optimizer settings",
"An optimizer option does not apply to the chosen optimizer (`beta1` with `sgd`,
`momentum` with `adam`), or is out of range.";

"E0502", "bad data settings",
"The data section is inconsistent: a `csv`/`npy` source without a `path`, a path that
does not exist, a classification task with an `mse` loss, or a file whose contents do not
fit the model — the wrong number of columns or shape, an NPY dtype pipec does not read,
float class labels, a label that is not a whole class index of the model, a NaN or
infinite cell. `pipec check` reads the first 4 MiB of the file with the executor's reader;
`pipec run` reads all of it and stops at the first bad cell, naming its line or sample.";

"E0503", "bad checkpoint settings",
"The checkpoint settings are unusable: `checkpoint.every` must be at least 1 step, and
`checkpoint.dir` must be a relative directory name inside the run's output directory.";

"E0504", "bad training-recipe settings",
"The training recipe beside the optimizer: `lr_schedule` (a linear warm-up from 0 to the
optimizer's `lr` over `warmup` steps, then a `constant`, `linear` or `cosine` decay to
`min_lr` by `decay_steps`, default the run's `steps`), `clip_grad_norm` (the largest norm
the whole model's gradient may have: every update scales its gradients by min(1, max /
norm)), `shuffle` (a new order of a finite data set's samples every epoch) and
`validation` (`every` steps, evaluate on the last `split` of the data set, held out of
training). `min_lr` must not exceed `lr`, a decay must end after the warm-up, the
clipping norm must be positive, shuffling and validation need a data set of a finite
size, and the held-out share must be in (0, 1) and hold at least one whole batch.
`running_stats: per_forward` (batch normalisation's running statistics moved at every
forward, as PyTorch does under gradient accumulation) needs a schedule that updates every
stage once per step; `per_update`, the default, works with any.

    training:
      optimizer: { kind: adamw, lr: 0.0003 }
      lr_schedule: { warmup: 100, decay: cosine, min_lr: 0.001 }   # error: above lr
      clip_grad_norm: 1.0
      shuffle: true";

"E0505", "bad FP8 settings",
"`training.fp8` says how FP8 training runs — its scaling recipe, what the blocks' linear
layers keep in FP8, whether FP8 weight copies are kept between microbatches, what ZeRO-3
gathers — and applies only with `precision: fp8` (or `precision: auto`, where it says how FP8 runs if the
search chooses it). Set `precision: fp8`, or remove `fp8`.

    training:
      precision: bf16
      fp8: { recipe: tensorwise }   # error: not FP8 training";

"E0601", "device out of memory",
"The plan needs more memory on a device than it has. The label gives the breakdown
(weights × versions kept by the schedule, gradients, optimizer state, stashed
activations, buffers, workspace reserve). Use more stages, `recompute: true`, fewer
microbatches in flight (1F1B instead of GPipe), or a larger device.";

"W0602", "device near its memory capacity",
"The plan leaves less of a device's memory free than the headroom a GPU run needs beside
the plan's figures: 10% by default (the caching allocator's reserve beyond the peak it
allocates, 9% in Megatron-Bridge's Moonlight-16B study on H100; CUDA's context and NCCL's
buffers outside it). `strategy.search.headroom` sets another share. Shard more (`zero`),
recompute, or add devices to leave it.";

"E0603", "compiler bug: plan verification failed",
"The static verifier found a problem in the instruction streams pipec generated. This
is a bug in pipec, not in your spec; please report it with the spec.";

"E0604", "profile file problem",
"A layer profile given to the cost model cannot be read or does not match the model.";

"W0605", "schedule bubble is large",
"More than half of the devices' time in a step is idle. More microbatches, or a
schedule with smaller bubbles (interleaved, zero-bubble), would use the devices better.";

"W0606", "strategy chosen by the search",
"The strategy has `auto` fields (or is `strategy: auto`): pipec searched every strategy
that fills them in — tensor-parallel degree within a node, pipeline depth × data
parallelism, schedule, microbatches, recompute, and with `training.precision: auto` bf16 or
FP8 — and compiled the fastest one that fits in every device's memory (with the headroom
asked for). The message says what it chose and the runner-ups; the quick fix replaces the
strategy (and an `auto` precision) with the chosen one, so later compiles do not search
again. `pipec search` prints the full report.";

"E0607", "no strategy fits",
"`strategy: auto` (or an `auto` field) found no strategy to choose, among the strategies
the fixed fields and the `search` constraints allow. The message says which of three it
was: nothing was left to try (e.g. only asynchronous schedules asked for without
`asynchronous: true`); every candidate broke a rule (the commonest reasons, with counts:
e.g. a fixed `tp` that does not divide the devices); or no plan fits in every device's
memory with the headroom asked for. Allow more (drop a constraint, lower `headroom`, allow
`recompute`), use devices with more memory, or a smaller model or batch.";

"E0701", "engine release not described",
"`engine: { name: ..., version: ... }` names a release of the engine that pipec's
description of it does not cover. Each engine's description (docs/spec.md) was read at
one release and covers a stated range; a version may be a whole release in that range or a
prefix of the newest (`\"0.19\"` for Megatron-LM 0.19.2). Without `version`, the newest
release pipec describes is assumed.

Example:

    engine: { name: megatron, version: \"0.17\" }   # error: pipec describes megatron 0.19.0 to 0.19.2";

"E0702", "the engine does not run this",
"The spec names an engine (`engine:`) whose capabilities (pipec's table of what it runs,
each row with its source in the engine's code or documentation: docs/engines.md) lack
something the strategy or training asks for: a pipeline schedule, a ZeRO level beside a
pipeline, a kind of recompute, a precision, unequal replication, an asynchronous update,
or a model other than a decoder-only language model. The fix offered is the nearest value
the engine runs; `engine: pipec` (the default) runs every plan pipec compiles.

Example:

    engine: megatron
    strategy: { pp: 4, schedule: zbv }   # error: megatron 0.19.2 has no `zbv` schedule
                                         # fix: { kind: interleaved, virtual_stages: 2 }";

"E0901", "cannot read file",
"The file could not be read (missing, a directory, not UTF-8, ...).";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_unique_well_formed_and_explained() {
        let mut seen = std::collections::HashSet::new();
        for c in CODES {
            assert!(seen.insert(c.code), "duplicate code {}", c.code);
            assert!(c.code.len() == 5 && (c.code.starts_with('E') || c.code.starts_with('W')), "{}", c.code);
            assert!(c.explanation.len() > 40, "{} needs a real explanation", c.code);
        }
        assert!(lookup("e0102").is_some());
    }
}

#!/bin/bash
# The layout of NVIDIA/Megatron-LM examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh at
# tag core_v0.19.0 (5be9626709af2722333bf54797c954c09edeada3, lines 27-169, the default
# branches: Megatron FSDP with optim_grads_params, DTYPE=fp8, mock data): 8 H100s, TP1 PP1
# CP1, micro-batch 1, global batch 128, 8192 tokens, bf16 with FP8 (hybrid, delayed scaling,
# FP8 parameter gathers).
GPUS_PER_NODE=8
NUM_NODES=1
DISTRIBUTED_ARGS=(--nproc_per_node $GPUS_PER_NODE --nnodes $NUM_NODES)
MODEL_ARGS=(
    --use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
    --num-attention-heads 32 --group-query-attention --num-query-groups 8 --kv-channels 128
    --seq-length 8192 --max-position-embeddings 8192
    --position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0
    --attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --normalization RMSNorm
    --init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p
    --untie-embeddings-and-output-weights --disable-bias-linear
)
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000
    --lr 0.00015 --min-lr 0.00001 --lr-decay-style cosine --clip-grad 1.0
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16
    --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
)
DTYPE_ARGS=("--fp8-format hybrid" "--fp8-amax-history-len 1024" "--fp8-amax-compute-algo max" "--fp8-param-gather")
MODEL_PARALLEL_ARGS=(--tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel)
DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 128256)
torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py ${MODEL_ARGS[@]} ${TRAINING_ARGS[@]} ${DTYPE_ARGS[@]} ${MODEL_PARALLEL_ARGS[@]} ${DATA_ARGS[@]}

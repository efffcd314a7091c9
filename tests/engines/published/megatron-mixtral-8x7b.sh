#!/bin/bash
# The layout of NVIDIA/Megatron-LM examples/mixtral/train_mixtral_8x7b_distributed.sh at tag
# core_v0.19.0 (lines 27-88): TP1 PP4 EP8 with the distributed optimizer and the all-to-all
# dispatcher, micro-batch 1, global batch 256, 4096 tokens, bf16; on 32 GPUs, the fewest it
# validates on (world % (ETP·EP·PP) = 0, megatron/core/parallel_state.py:874-884). The model
# arguments are Mixtral 8x7B's published shape.
DISTRIBUTED_ARGS=(--nproc_per_node 8 --nnodes 4)
MODEL_ARGS=(
    --disable-bias-linear --seq-length 4096 --max-position-embeddings 32768
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
    --normalization RMSNorm --position-embedding-type rope --rotary-base 1000000 --swiglu
    --untie-embeddings-and-output-weights --group-query-attention --num-query-groups 8
)
MOE_ARGS=(
    --num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2 --moe-grouped-gemm --moe-token-dispatcher-type alltoall
    --overlap-param-gather --overlap-grad-reduce
)
DATA_ARGS=(--tokenizer-type NullTokenizer --vocab-size 32000 --mock-data)
TRAINING_ARGS=(--micro-batch-size 1 --global-batch-size 256 --lr 1e-4 --train-iters 500000 --min-lr 1.0e-5 --weight-decay 0.1 --clip-grad 1.0 --bf16)
MODEL_PARALLEL_ARGS=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --expert-model-parallel-size 8 --use-distributed-optimizer --sequence-parallel)
torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py ${MODEL_ARGS[@]} ${MOE_ARGS[@]} ${DATA_ARGS[@]} ${TRAINING_ARGS[@]} ${MODEL_PARALLEL_ARGS[@]}

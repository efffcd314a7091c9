"""Runs an engine's own argument parsing and validation on a folder `pipec emit` wrote, without
a GPU, and checks that the layout the engine derives equals pipec's (the folder's
prediction.json `layout`). Prints one line: `OK <folder> <derived layout>` or `FAIL <folder>
<why>`; exits 0 or 1.

Usage: python engine_check.py FOLDER   (in the venv scripts/engine-check.sh makes)

Patches, all of them the ones docs/benchmarks.md and the engines' research list, none of which
changes a layout rule:
- Megatron-LM: `get_device_arch_version` and `torch.cuda.get_device_capability` answer Hopper
  (validate_args asks the GPU when TP or CP > 1 and for grouped GEMM), and Transformer
  Engine's version checks and fused kernels are stubbed (the cluster has TE; the CPU box does
  not). The expert grid rule of parallel_state.initialize_model_parallel (world % (ETP·EP·PP))
  and the interleaved schedule's microbatch rule (schedules.py:1133-1153) run at start-up, not
  at parse time, and are mirrored here.
- DeepSpeed: `deepspeed.comm.get_rank` answers 0, so DeepSpeedConfig takes the data-parallel
  size from the stub mpu instead of falling back to a world of 1; the pipeline engine's
  refusal of ZeRO-2/3 (runtime/pipe/engine.py:76-77) is mirrored.
- torchtitan: none; ParallelDims validates without building a mesh.
"""
import json
import os
import shlex
import sys


def megatron(folder, want, world):
    os.environ["WORLD_SIZE"] = str(world)
    os.environ.setdefault("RANK", "0")
    args_txt = shlex.split(open(os.path.join(folder, "args.txt")).read())
    fsdp = "--use-megatron-fsdp" in args_txt
    if fsdp:
        os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    else:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    import torch
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    from packaging.version import Version
    import megatron.training.arguments as A
    import megatron.core.transformer.transformer_config as TC
    A.get_device_arch_version = lambda: 9
    for mod in (A, TC):
        mod.is_te_min_version = lambda *a, **k: True
    TC.get_te_version = lambda: Version("2.20.0")
    import megatron.core.models.common.embeddings.rope_utils as RU
    if RU.fused_apply_rotary_pos_emb is None:
        RU.fused_apply_rotary_pos_emb = lambda *a, **k: None
    import megatron.core.transformer.moe.moe_utils as MU
    for n in ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
              "fused_sort_chunks_by_index_with_probs", "fused_unpermute"):
        if getattr(MU, n, None) is None:
            setattr(MU, n, lambda *a, **k: None)
    sys.argv = ["pretrain_gpt.py"] + args_txt
    import contextlib
    with contextlib.redirect_stdout(sys.stderr):  # validate_args prints every argument
        args = A.parse_args()
        A.validate_args(args)
        A.core_transformer_config_from_args(args)
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator, get_num_microbatches
    init_num_microbatches_calculator(
        rank=0, rampup_batch_size=getattr(args, "rampup_batch_size", None),
        global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
        data_parallel_size=args.data_parallel_size * getattr(args, "gtp_weight_remat_size", 1),
        decrease_batch_size_if_needed=args.decrease_batch_size_if_needed,
        step_batch_size_schedule=getattr(args, "step_batch_size_schedule", None), seq_length=args.seq_length)
    m = get_num_microbatches()
    etp, ep, pp = args.expert_tensor_parallel_size, args.expert_model_parallel_size, args.pipeline_model_parallel_size
    if args.world_size % (etp * ep * pp):
        raise RuntimeError(f"world {args.world_size} not divisible by etp*ep*pp {etp * ep * pp}")
    vpp = args.virtual_pipeline_model_parallel_size or 1
    if vpp > 1 and (m < pp or (m % pp) != 0):
        raise RuntimeError(f"interleaved schedule: {m} microbatches with pp {pp} (schedules.py:1133-1153)")
    recompute = {None: "none", "full": "full", "selective": "selective"}[args.recompute_granularity]
    zero = 0
    if getattr(args, "use_megatron_fsdp", False):
        zero = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}[args.data_parallel_sharding_strategy]
    elif args.use_distributed_optimizer:
        zero = 1
    # Transformer Engine's FP8: the recipe TransformerConfig takes (transformer_config.py:566-590)
    config = A.core_transformer_config_from_args(args)
    fp8 = config.fp8_recipe if args.fp8 else None
    # the transformer blocks each model chunk builds (chunk c: virtual stage c // pp on rank
    # c % pp), by Megatron-LM's own split (transformer_block.py get_num_layers_to_build)
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.enums import LayerType
    layout = config.pipeline_model_parallel_layout
    if layout is not None:
        # a written layout (--pipeline-model-parallel-layout): the layers Megatron-LM parsed
        # for each rank and virtual stage (its get_num_layers_to_build counts the same list,
        # but reads the virtual stage from the uninitialised parallel state), and where it
        # builds the multi-token-prediction modules
        chunks = [layout.layout[c % pp][c // pp].count(LayerType.decoder) for c in range(pp * vpp)]
        mtp_chunks = [c for c in range(pp * vpp) if layout.layout[c % pp][c // pp].count(LayerType.mtp)]
    else:
        chunks = [get_num_layers_to_build(config, vp_stage=c // pp if vpp > 1 else None, pp_rank=c % pp)
                  for c in range(pp * vpp)]
        # without a layout the modules are built with the loss, on the last stage's last chunk
        # (multi_token_prediction.py)
        mtp_chunks = [pp * vpp - 1] if config.mtp_num_layers else []
    mtp = dict(depth=config.mtp_num_layers, weight=config.mtp_loss_scaling_factor,
               chunk=mtp_chunks[0] if len(mtp_chunks) == 1 else mtp_chunks) if config.mtp_num_layers else None
    # each block's sliding window (0: full attention), by Megatron-LM's own rule
    # (transformer/utils.py is_layer_window_attention; TE's (L, 0) window is L + 1 positions)
    from megatron.core.transformer.utils import is_layer_window_attention
    windows = [config.window_size[0] + 1
               if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, n) else 0
               for n in range(1, config.num_layers + 1)] if config.window_size else None
    return dict(world=args.world_size, tp=args.tensor_model_parallel_size, pp=pp, dp=args.data_parallel_size,
                cp=args.context_parallel_size, ep=ep, etp=etp, chunk_blocks=chunks, virtual_stages=vpp,
                block_windows=windows, mtp=mtp,
                microbatch_size=args.micro_batch_size,
                microbatches_per_replica=m, global_batch=args.global_batch_size, recompute=recompute, zero=zero,
                seq_length=args.seq_length, fp8=str(getattr(fp8, "value", fp8)) if fp8 else None)


def torchtitan(folder, want, world):
    from torchtitan.config import ConfigManager
    from torchtitan.distributed.parallel_dims import ParallelDims
    cfg = ConfigManager().parse_args(["--job.config_file", os.path.join(folder, "job.toml")])
    p = cfg.parallelism
    pd = ParallelDims(dp_shard=p.data_parallel_shard_degree, dp_replicate=p.data_parallel_replicate_degree,
                      cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
                      ep=p.expert_parallel_degree, etp=p.expert_tensor_parallel_degree, world_size=world)
    assert cfg.training.seq_len % pd.seq_len_divisor == 0, "seq_len % (tp * 2*cp) != 0"
    dp = pd.dp_replicate * pd.dp_shard
    local = cfg.training.local_batch_size
    gbs = cfg.training.global_batch_size if cfg.training.global_batch_size > 0 else local * dp
    assert gbs % (local * dp) == 0, "global % (local * dp) != 0 (train.py:196-215)"
    chunks = 1
    if pd.pp > 1:
        from torch.distributed.pipelining.schedules import get_schedule_class, PipelineScheduleSingle
        cls = get_schedule_class(p.pipeline_parallel_schedule)
        assert local % p.pipeline_parallel_microbatch_size == 0, "local batch % pp microbatch"
        m = local // p.pipeline_parallel_microbatch_size
        from torchtitan.protocols.train_spec import get_train_spec
        layers = get_train_spec(cfg.model.name).model_args[cfg.model.flavor].n_layers
        per = p.pipeline_parallel_layers_per_stage
        import math
        stages = math.ceil((layers + p.pipeline_parallel_first_stage_less_layers + p.pipeline_parallel_last_stage_less_layers) / per)
        assert stages % pd.pp == 0, f"{stages} stages over pp {pd.pp}"
        chunks = stages // pd.pp
        single = issubclass(cls, PipelineScheduleSingle)
        assert (chunks == 1) == single, f"{p.pipeline_parallel_schedule} with {chunks} stages per rank"
        from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part
        generate_llm_fqn_per_model_part(stages, layers, p.pipeline_parallel_first_stage_less_layers,
                                        p.pipeline_parallel_last_stage_less_layers)
        micro = p.pipeline_parallel_microbatch_size
    else:
        m = gbs // (local * dp)
        micro = local
    mode = cfg.activation_checkpoint.mode
    zero = 3 if pd.dp_shard > 1 and p.fsdp_reshard_after_forward != "never" else (2 if pd.dp_shard > 1 else 0)
    # torchao's FP8 through torchtitan's converters (job_config.py:731-792)
    fp8 = None
    if "quantize.linear.float8" in cfg.model.converters:
        fp8 = cfg.quantize.linear.float8.recipe_name or "tensorwise"
    elif "quantize.linear.mx" in cfg.model.converters:
        fp8 = "mxfp8"
    return dict(world=world, tp=pd.tp, pp=pd.pp, dp=dp, cp=pd.cp, ep=pd.ep, etp=pd.etp, virtual_stages=chunks,
                microbatch_size=micro, microbatches_per_replica=m, global_batch=gbs,
                recompute={"none": "none", "full": "full", "selective": "selective"}[mode], zero=zero,
                seq_length=cfg.training.seq_len, fp8=fp8)


def deepspeed(folder, want, world):
    import deepspeed.comm as dcomm
    from deepspeed.runtime.config import DeepSpeedConfig
    cfg = json.load(open(os.path.join(folder, "ds_config.json")))
    pp = cfg.get("pipeline", {}).get("stages", 1)
    tp = cfg.get("tensor_parallel", {}).get("autotp_size", 1)
    dp = world // (pp * tp)

    class FakeMPU:
        def get_data_parallel_world_size(self):
            return dp

        def get_data_parallel_rank(self):
            return 0

        def get_model_parallel_world_size(self):
            return tp

    dcomm.get_rank = lambda *a, **k: 0
    c = DeepSpeedConfig(cfg, mpu=FakeMPU())
    zero = int(c.zero_optimization_stage)
    if pp > 1 and zero >= 2:
        raise AssertionError("ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism (runtime/pipe/engine.py:76-77)")
    recompute = "full" if "activation_checkpointing" in cfg else "none"
    autoep = cfg.get("expert_parallel", {})
    return dict(world=world, tp=tp, pp=pp, dp=dp, cp=1, ep=autoep.get("autoep_size", 1),
                etp=autoep.get("expert_tensor_parallel_size", 1),
                virtual_stages=2 if cfg.get("pipeline", {}).get("schedule") == "DualPipeV" else 1,
                microbatch_size=c.train_micro_batch_size_per_gpu, microbatches_per_replica=c.gradient_accumulation_steps,
                global_batch=c.train_batch_size, recompute=recompute, zero=zero)


def main():
    folder = sys.argv[1]
    pred = json.load(open(os.path.join(folder, "prediction.json")))
    engine, want, world = pred["engine"]["name"], pred["layout"], pred["world_size"]
    try:
        got = {"megatron": megatron, "torchtitan": torchtitan, "deepspeed": deepspeed}[engine](folder, want, world)
    except SystemExit as e:
        print(f"FAIL {folder} argparse exit {e}")
        return 1
    except Exception as e:  # the engine's own refusal
        print(f"FAIL {folder} {type(e).__name__}: {e}".replace("\n", " "))
        return 1
    expect = dict(world=world, **{k: want[k] for k in ("tp", "pp", "dp", "cp", "ep", "virtual_stages", "microbatch_size",
                                                       "microbatches_per_replica", "global_batch", "recompute", "zero")})
    if want["dp"] * want["cp"] == 1:
        expect["zero"] = got.get("zero")  # nothing to shard over one replica
    if "seq_length" in got:
        expect["seq_length"] = want["seq_length"]
    if "fp8" in got:
        expect["fp8"] = want.get("fp8")
    # expert tensor parallelism only where there are experts; each chunk's blocks where the
    # engine says them
    if want["ep"] > 1:
        expect["etp"] = want["etp"]
    if "chunk_blocks" in got:
        expect["chunk_blocks"] = want.get("chunk_blocks")
    if "block_windows" in got:
        expect["block_windows"] = pred.get("block_windows")
    if "mtp" in got:
        expect["mtp"] = pred.get("mtp")
    diff = {k: (expect[k], got.get(k)) for k in expect if expect[k] != got.get(k)}
    if diff:
        print(f"FAIL {folder} layout differs (pipec, {engine}): {diff}")
        return 1
    print(f"OK {folder} {json.dumps(got, sort_keys=True)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

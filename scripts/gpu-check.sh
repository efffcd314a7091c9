#!/usr/bin/env bash
# The GPU check, in two steps.
#
#   bash scripts/gpu-check.sh build [--mpi]    on the development machine: the `cuda` binary,
#                                              release and stripped, into gpu-check/ (cudarc
#                                              loads the driver and NVRTC at run time: nothing
#                                              CUDA is linked, no GPU is needed to build);
#                                              with --mpi, built with MPI too, beside this
#                                              machine's Open MPI (Debian's) as openmpi.txz
#   bash scripts/gpu-check.sh run [--dry]      on the GPU machine (no network, no Rust; the
#                                              CUDA driver, and PyTorch for the benchmark):
#                                              results under gpu-check/results/ (or $OUT)
#
# `run` trains a matrix of small specs on the CPU and on CUDA with the same binary and
# compares every step's loss (every synchronous schedule on 2 devices sharing the GPU,
# tensor parallelism, recompute, a ResNet with batch norm, a GPT with tied embeddings);
# trains two ranks as two processes on CUDA, over MPI (when the binary has it and an
# `mpirun` is there or bundled) and over TCP; starts a one-rank NCCL communicator and times
# its all-reduce (`--nccl-check`, found where PyTorch's wheel installed it); calibrates the device; and benchmarks pipec
# against PyTorch eager on the same GPU (bench/specs/gpu/: an MLP, a GPT-2 block stack, a
# ResNet-50 stage; per-microbatch forward and backward, whole steps, the step predicted
# from `pipec profile` and from `pipec calibrate` against the measured one), with
# scripts/gpu_bench.py. `--dry` checks the specs and runs the paths on the CPU, skipping
# what needs a GPU: CI runs it so the script cannot rot.
#
# Options: --bin PATH (the pipec to use; default gpu-check/pipec, or target/debug/pipec in
# --dry mode), --tol REL (largest relative loss difference CPU vs CUDA, default 1e-3),
# --tol-16 REL (the same for the bf16 and fp16 specs, default 1e-2), --bench-only (the benchmark
# alone), --no-bench (the equality and process checks alone), --models "A B" (which of
# bench/specs/gpu/ the benchmark runs), --no-calibrate (the benchmark without calibrating).
set -euo pipefail
cd "$(dirname "$0")/.."

mode="${1:-}"
shift || true
dry=0
mpi=0
bench_only=0
no_bench=0
bin=""
tol="1e-3"
tol_16="1e-2"
models_opt=""
no_calibrate=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry) dry=1 ;;
    --mpi) mpi=1 ;;
    --bench-only) bench_only=1 ;;
    --no-bench) no_bench=1 ;;
    --bin) bin="$2"; shift ;;
    --tol) tol="$2"; shift ;;
    --tol-16) tol_16="$2"; shift ;;
    --models) models_opt="$2"; shift ;;
    --no-calibrate) no_calibrate=1 ;;
    *) echo "gpu-check: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done

case "$mode" in
  build)
    export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/pipec-target}"
    features=cuda,nccl
    [ "$mpi" = 1 ] && features=cuda,mpi,nccl
    cargo build --release --features "$features"
    mkdir -p gpu-check
    cp "$CARGO_TARGET_DIR/release/pipec" gpu-check/pipec
    strip gpu-check/pipec
    rm -f gpu-check/openmpi.txz
    if [ "$mpi" = 1 ]; then
      # this machine's Open MPI, its plugins and the libraries they load, relocatable
      # (OPAL_PREFIX): the GPU machine has no MPI and no network to install one
      bundle="$(mktemp -d)"
      for p in openmpi-bin libopenmpi3 openmpi-common libpmix2 libhwloc15 libevent-core-2.1-7 \
          libevent-pthreads-2.1-7 libevent-2.1-7 libfabric1 libucx0 libibverbs1 librdmacm1 \
          libpsm2-2 libpsm-infinipath1 libnl-3-200 libnl-route-3-200 libmunge2 ibverbs-providers; do
        dpkg -L "$p" 2>/dev/null || { echo "gpu-check: the Debian package $p is not installed" >&2; exit 1; }
      done | sort -u | while read -r f; do
        [ -f "$f" ] || continue
        case "$f" in /usr/share/doc/*|/usr/share/man/*|/usr/share/lintian/*|*.a|*/include/*) continue ;; esac
        g="$f"
        case "$g" in /lib/*) g="/usr$g" ;; esac # merged /usr: one tree
        mkdir -p "$bundle/root$(dirname "$g")"
        cp -a "$f" "$bundle/root$g"
      done
      ln -sf orterun "$bundle/root/usr/bin/mpirun" # Debian's points through /etc/alternatives
      tar cJf gpu-check/openmpi.txz -C "$bundle" root
      rm -rf "$bundle"
    fi
    carried=(gpu-check/pipec)
    [ -f gpu-check/openmpi.txz ] && carried+=(gpu-check/openmpi.txz)
    size=$(du -cb "${carried[@]}" | tail -1 | cut -f1)
    echo "gpu-check/: $((size / 1048576)) MiB (carry gpu-check/ to the GPU machine; at most 64 MiB)"
    [ "$size" -le $((64 * 1048576)) ] || { echo "gpu-check: gpu-check/ is over 64 MiB" >&2; exit 1; }
    exit 0
    ;;
  run) ;;
  *) echo "usage: scripts/gpu-check.sh build [--mpi] | run [--dry] [--bench-only] [--no-bench] [--models LIST] [--no-calibrate] [--bin PATH] [--tol REL] [--tol-16 REL]" >&2; exit 2 ;;
esac

if [ -z "$bin" ]; then
  if [ "$dry" = 1 ]; then bin="${CARGO_TARGET_DIR:-$HOME/.cache/pipec-target}/debug/pipec"; else bin="gpu-check/pipec"; fi
fi
[ -x "$bin" ] || { echo "gpu-check: no pipec binary at $bin (run \`scripts/gpu-check.sh build\` first)" >&2; exit 2; }
bin="$(realpath "$bin")"
root="$(pwd)"
out="${OUT:-gpu-check/results}"
rm -rf "$out"
mkdir -p "$out/specs"
out="$(realpath "$out")"
# reproducible kernels: CubeCL picks its kernels without timing them
export CUBECL_AUTOTUNE_LEVEL=minimal
# CUDA runs start in $work, whose cubecl.toml asks CubeCL to keep its compiled kernels
# between processes (each run otherwise compiles the same kernels again through NVRTC; on
# the H100 the check ran with it, and how much it saved was not measured)
work="$out/work"
mkdir -p "$work"
printf '[compilation]\ncache = { file = "%s" }\n' "$work/kernels" > "$work/cubecl.toml"
device_backend=cuda
device_flags=(--share-gpus)
steps_flag=()
if [ "$dry" = 1 ]; then
  device_backend=cpu
  device_flags=()
  steps_flag=(--steps 2)
  echo "gpu-check: dry run (CPU only; the GPU parts are skipped)"
else
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
  # cudarc loads NVRTC at run time: put the toolkit's (or PyTorch's wheel's) on the path
  LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"
  # (after what is there, and never a `stubs` folder: its libcuda.so is no driver)
  for d in $( (find /usr/local /usr/lib /opt -name 'libnvrtc.so*' 2>/dev/null || true) | grep -v /stubs/ | xargs -r -n1 dirname | sort -u); do
    LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
  done
  if ! command -v mpirun >/dev/null 2>&1 && [ -f gpu-check/openmpi.txz ]; then
    # the Open MPI that `build --mpi` bundled, relocated under /tmp
    ompi=/tmp/pipec-openmpi
    rm -rf "$ompi" && mkdir -p "$ompi" && tar xJf gpu-check/openmpi.txz -C "$ompi"
    export OPAL_PREFIX="$ompi/root/usr" PATH="$ompi/root/usr/bin:$PATH"
    LD_LIBRARY_PATH="$ompi/root/usr/lib/x86_64-linux-gnu:$ompi/root/usr/lib/x86_64-linux-gnu/openmpi/lib:$LD_LIBRARY_PATH"
    export PMIX_MCA_mca_base_component_path="$ompi/root/usr/lib/x86_64-linux-gnu/pmix2/lib/pmix"
    # shared memory and TCP between the ranks of one machine
    export OMPI_MCA_btl=self,vader,tcp OMPI_MCA_pml=ob1 OMPI_MCA_plm_rsh_agent=false
  fi
  export LD_LIBRARY_PATH
fi
# (a bound on every device command: a hung kernel must not eat the machine's time)
dev() { (cd "$work" && timeout 240 "$bin" "$@"); }

# every step's loss of a run against the CPU run's: the largest relative difference, within
# the tolerance or FAIL
compare() { # name reference-metrics metrics [tolerance]
  python3 - "$2" "$3" "${4:-$tol}" "$1" <<'EOF'
import json, sys
a = [json.loads(l)["loss"] for l in open(sys.argv[1])]
b = [json.loads(l)["loss"] for l in open(sys.argv[2])]
tol, name = float(sys.argv[3]), sys.argv[4]
worst = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b)) if a and len(a) == len(b) else float("inf")
print(f"{'ok  ' if worst <= tol else 'FAIL'} {name}: {len(a)} steps, largest relative loss difference {worst:.2e} (tolerance {tol:.0e})")
EOF
}

status=0
if [ "$bench_only" = 0 ]; then
# --- 1. equality: the same losses on the CPU and on the device ---------------------------
spec() { # name devices stages schedule extra-strategy-lines layers
  cat > "$out/specs/$1.yaml" <<EOF
name: gpu-check-$1
model:
  input: [32]
  layers:
    $6
  loss: cross_entropy
cluster:
  nodes: 1
  devices_per_node: $2
  device: { memory: 4GiB, throughput: 10TFLOP/s }
  links:
    intra_node: { bandwidth: 100GB/s, latency: 5us }
strategy:
  stages: $3
  schedule: $4
  microbatches: 4
$5
training:
  batch_size: 32
  steps: 5
  optimizer: { kind: adam, lr: 0.002 }
  seed: 11
  data: { kind: synthetic, samples: 256 }
EOF
}
mlp='- linear(32, 64) -> relu
    - repeat 4: linear(64, 64) -> relu
    - linear(64, 4)'
blocks='- embedding(50, 16)
    - repeat 2: transformer_block(d=16, heads=4, ff=32)
    - layernorm
    - flatten
    - linear(512, 4)'
spec gpipe 2 straight gpipe "" "$mlp"
spec 1f1b 2 straight 1f1b "" "$mlp"
spec one-device 1 straight 1f1b "" "$mlp"
spec interleaved 2 straight "{ kind: interleaved, virtual_stages: 2 }" "" "$mlp"
spec zb-h1 2 straight zb-h1 "" "$mlp"
spec zbv 2 straight zbv "" "$mlp"
spec dualpipev 2 straight dualpipev "" "$mlp"
spec dualpipe 2 straight dualpipe "" "$mlp"
spec chimera 2 straight chimera "" "$mlp"
spec dp-only 2 straight dp-only "" "$mlp"
sed -i '/^  stages: /d' "$out/specs/dp-only.yaml"
spec recompute 2 straight 1f1b "  recompute: true" "$mlp"
spec tensor-parallel 4 '"1-1"' 1f1b "  tp: 2" "$blocks"
# (the transformer takes 32 token ids: 32 × 16 = 512 features reach the head)
# the graph and language models, as the repository has them: a ResNet with batch norm, and
# a GPT whose output layer is its embedding transposed (both two 1F1B stages)
cp specs/resnet-small.yaml "$out/specs/resnet-small.yaml"
sed "s|path: data/|path: $root/specs/data/|" specs/gpt-tiny.yaml > "$out/specs/gpt-tiny.yaml"
# the memory strategies: ZeRO's three levels on 4 data-parallel replicas and ZeRO-3 on a
# 2-2 pipeline; sequence parallelism beside tp 2; context parallelism 2 (both exchanges),
# selective recompute and flash attention on the GPT
for z in 1 2 3; do
  spec "zero-$z" 4 straight dp-only "  zero: $z" "$mlp"
  sed -i '/^  stages: /d' "$out/specs/zero-$z.yaml"
done
spec zero-3-pipeline 4 '"2-2"' 1f1b "  zero: 3" "$mlp"
spec sequence-parallel 4 '"1-1"' 1f1b "  tp: 2
  sequence_parallel: true" "$blocks"
gpt() { # name devices extra-strategy-lines [model-line]
  sed -e "s|path: data/|path: $root/specs/data/|" -e "s|^  devices_per_node: .*|  devices_per_node: $2|" \
    -e "s|^  partition: balanced|  partition: balanced\n$3|" specs/gpt-tiny.yaml > "$out/specs/$1.yaml"
  [ -n "${4:-}" ] && sed -i "s|^  loss: cross_entropy|  $4\n  loss: cross_entropy|" "$out/specs/$1.yaml"
  return 0
}
gpt context-parallel 4 "  cp: 2"
gpt context-parallel-ring 4 "  cp: 2\n  cp_comm: ring"
gpt selective-recompute 2 "  recompute: selective"
gpt flash-attention 2 "" "attention: flash"
# mixture of experts: 8 experts, top-2, a shared expert, `ep: 2` per stage of a 2-2 1F1B
# pipeline, and the same on DualPipeV (its pairs run in line on the executor)
sed "s|path: data/|path: $root/specs/data/|" specs/moe-tiny.yaml > "$out/specs/moe-ep2.yaml"
# mixed precision: the GPT with its products in bf16 and in fp16 with loss scaling
# (executor/src/amp.rs), on the CPU's low-precision products and the GPU's; their roundings
# differ, so their tolerance is a 16-bit one (--tol-16)
for p in bf16 fp16; do
  sed "s|^  seed: 11|  seed: 11\n  precision: $p|" "$out/specs/gpt-tiny.yaml" > "$out/specs/gpt-tiny-$p.yaml"
done
sed -e "s|path: data/|path: $root/specs/data/|" -e 's|^  schedule: 1f1b|  schedule: dualpipev|' specs/moe-tiny.yaml > "$out/specs/moe-dualpipev.yaml"

# the CPU runs first, all at once (they are the reference); then the device runs, six at a
# time (they share the GPU; nothing here is timed)
if [ "$dry" = 0 ]; then
  for f in "$out"/specs/*.yaml; do
    name=$(basename "$f" .yaml)
    "$bin" run "$f" --backend cpu --steps 5 -o "$out/cpu/$name" > "$out/$name.cpu.log" 2>&1 &
  done
  wait
else
  # the dry run checks every spec and trains one: it proves the path, on 2 cores
  "$bin" check "$out"/specs/*.yaml > "$out/check.log" 2>&1 || { echo "FAIL: the specs do not check (see check.log)"; status=1; }
  "$bin" run "$out/specs/1f1b.yaml" --backend cpu --steps 5 -o "$out/cpu/1f1b" > "$out/1f1b.cpu.log" 2>&1 || true
fi
if [ "$dry" = 0 ]; then
  ls "$out"/specs/*.yaml | xargs -P 6 -I{} sh -c 'n=$(basename {} .yaml); cd "$0" && timeout 120 "$1" run {} --backend cuda --share-gpus --steps 5 -o "$2/dev/$n" > "$2/$n.dev.log" 2>&1' "$work" "$bin" "$out" || true
else
  # the dry run's "device" is the CPU again: one run proves the path
  "$bin" run "$out/specs/1f1b.yaml" --backend cpu --steps 5 -o "$out/dev/1f1b" > "$out/1f1b.dev.log" 2>&1 || true
fi
for f in "$out"/specs/*.yaml; do
  name=$(basename "$f" .yaml)
  [ "$dry" = 1 ] && [ "$name" != 1f1b ] && continue
  [ -f "$out/cpu/$name/metrics.jsonl" ] || { echo "FAIL $name: the CPU run failed (see $name.cpu.log)"; continue; }
  [ -f "$out/dev/$name/metrics.jsonl" ] || { echo "FAIL $name: the $device_backend run failed (see $name.dev.log)"; continue; }
  case "$name" in *-bf16|*-fp16) t="$tol_16" ;; *) t="$tol" ;; esac
  compare "$name" "$out/cpu/$name/metrics.jsonl" "$out/dev/$name/metrics.jsonl" "$t"
done | tee "$out/equality.txt"

# --- 2. more than one process: two ranks on CUDA, over MPI and over TCP -------------------
if [ "$dry" = 0 ] && command -v mpirun >/dev/null 2>&1 && ldd "$bin" 2>/dev/null | grep -q libmpi; then
  # (a ZeRO-3 pipeline and the expert-parallel MoE as 4 ranks: their gathers, reduce-scatters
  # and all-to-alls between processes)
  for run in 1f1b:2 zero-3-pipeline:4 moe-ep2:4; do
    name=${run%:*} ranks=${run#*:}
    if (cd "$work" && timeout 120 mpirun --allow-run-as-root --oversubscribe -np "$ranks" "$bin" run "$out/specs/$name.yaml" --transport mpi --backend cuda --share-gpus --steps 5 -o "$out/mpi-$name") > "$out/mpi-$name.log" 2>&1; then
      compare "mpi: $name, $ranks ranks on CUDA" "$out/cpu/$name/metrics.jsonl" "$out/mpi-$name/metrics.jsonl" | tee -a "$out/equality.txt"
    else
      echo "FAIL mpi $name: see mpi-$name.log" | tee -a "$out/equality.txt"
    fi
  done
else
  # say which of the three reasons it is
  if [ "$dry" = 1 ]; then
    why="a dry run on the CPU runs no CUDA ranks"
  elif ! command -v mpirun >/dev/null 2>&1; then
    why="no mpirun on this machine"
  else
    why="this pipec was built without MPI (build with --features cuda,mpi)"
  fi
  echo "skip mpi: $why" | tee -a "$out/equality.txt"
fi
if [ "$dry" = 0 ]; then
  pids=()
  for r in 0 1; do
    (cd "$work" && RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29517 timeout 120 "$bin" run "$out/specs/1f1b.yaml" --transport tcp --backend cuda --share-gpus --steps 5 -o "$out/tcp") > "$out/tcp.$r.log" 2>&1 &
    pids+=($!)
  done
  if wait "${pids[0]}" && wait "${pids[1]}"; then
    compare "tcp: 2 processes on CUDA" "$out/cpu/1f1b/metrics.jsonl" "$out/tcp/metrics.jsonl" | tee -a "$out/equality.txt"
  else
    echo "FAIL tcp: see tcp.0.log, tcp.1.log" | tee -a "$out/equality.txt"
  fi
fi
if [ "$dry" = 0 ]; then
  # NCCL: a one-rank communicator started over the TCP fabric and its all-reduce on the GPU
  # timed (`--nccl-check`); several GPUs need a machine with several
  if (cd "$work" && RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29518 timeout 120 "$bin" run "$out/specs/one-device.yaml" --transport tcp --backend cuda --nccl-check --steps 2 -o "$out/nccl") > "$out/nccl.log" 2>&1; then
    echo "ok nccl: $(grep -m1 'all-reduce of' "$out/nccl.log")" | tee -a "$out/equality.txt"
  else
    echo "FAIL nccl: a one-rank NCCL communicator on the GPU (see nccl.log)" | tee -a "$out/equality.txt"
  fi
fi
grep -q FAIL "$out/equality.txt" && status=1
[ -s "$out/equality.txt" ] || status=1

fi

[ "$no_bench" = 1 ] && { echo "gpu-check: results in $out (no benchmark: --no-bench)"; exit $status; }

# --- 3. the benchmark: pipec against PyTorch on the same device ----------------------------
# per model: pipec's per-layer profile on the device, a plan compiled from it, that plan
# trained (its log says measured against predicted step); the device calibrated once and each
# model's step predicted from the calibration; then PyTorch eager on the same models
models=(mlp gpt2-blocks resnet50-res3)
[ -n "$models_opt" ] && read -r -a models <<< "$models_opt"
[ "$dry" = 1 ] && models=(mlp) # the dry run only proves the path works
calibration="$out/calibrated-device.json"
if [ "$no_calibrate" = 0 ]; then
  dev calibrate --backend "$device_backend" --memory 80GiB --reps 7 -o "$calibration" > "$out/calibrate.log" 2>&1 || { echo "FAIL calibrate: see calibrate.log"; status=1; }
fi
for m in "${models[@]}"; do
  d="$out/$m"
  mkdir -p "$d"
  s="$root/bench/specs/gpu/$m.yaml"
  { dev profile "$s" --backend "$device_backend" --reps 5 -o "$d/profile.json" \
    && "$bin" compile "$s" --profile "$d/profile.json" -o "$d/plan" \
    && dev run "$d/plan/plan.json" --backend "$device_backend" "${steps_flag[@]}" -o "$d/run"; } > "$d/plan-profile.log" 2>&1 \
    || { echo "FAIL bench $m: see $m/plan-profile.log"; status=1; }
  # the same model with its products in bf16, and in fp16 (the spec's own one-device layout)
  for p in bf16 fp16; do
    sed "s|^  seed: |  precision: $p\n  seed: |" "$s" > "$d/$p.yaml"
    dev run "$d/$p.yaml" --backend "$device_backend" "${steps_flag[@]}" -o "$d/run-$p" > "$d/run-$p.log" 2>&1 \
      || { echo "FAIL bench $m $p: see $m/run-$p.log"; status=1; }
  done
  if [ -f "$calibration" ]; then
    sed "s|^  device: .*|  device: { file: $calibration }|" "$s" > "$d/calibrated.yaml"
    "$bin" compile "$d/calibrated.yaml" -o "$d/plan-calibrated" > "$d/plan-calibrated.log" 2>&1 || { echo "FAIL bench $m: see $m/plan-calibrated.log"; status=1; }
  fi
done
if [ "$dry" = 0 ] && python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  python3 scripts/gpu_bench.py torch "$out/torch.json" > "$out/torch.log" 2>&1 || { echo "FAIL torch: see torch.log"; status=1; }
  python3 scripts/gpu_bench.py staging "$out/staging.json" > "$out/staging.log" 2>&1 || true
else
  echo "skip torch: a dry run, or no PyTorch with CUDA here" | tee "$out/torch.log"
fi
python3 scripts/gpu_bench.py report "$out" | tee "$out/bench.md"
echo "gpu-check: results in $out"
exit $status

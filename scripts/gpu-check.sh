#!/usr/bin/env bash
# The GPU check, in two steps.
#
#   bash scripts/gpu-check.sh build            on the development machine: the `cuda` binary,
#                                              release and stripped, into gpu-check/ (cudarc
#                                              loads the driver and NVRTC at run time: nothing
#                                              CUDA is linked, no GPU is needed to build)
#   bash scripts/gpu-check.sh run [--dry]      on the GPU machine (no network, no Rust; the
#                                              CUDA driver, and PyTorch for the benchmark):
#                                              results under gpu-check/results/ (or $OUT)
#
# `run` trains a matrix of small specs on the CPU and on CUDA with the same binary and
# compares every step's loss (every synchronous schedule on 2 devices sharing the GPU,
# tensor parallelism, recompute); runs a 2-rank MPI CUDA job when `mpirun` is there and the
# binary was built with MPI; and benchmarks pipec against PyTorch on the same GPU (step
# time, per-layer forward/backward, achieved TFLOP/s). `--dry` runs everything on the CPU
# and skips what needs a GPU: CI runs it so the script cannot rot.
#
# Options: --bin PATH (the pipec to use; default gpu-check/pipec, or target/debug/pipec in
# --dry mode), --tol REL (largest relative loss difference CPU vs CUDA, default 1e-3).
set -euo pipefail
cd "$(dirname "$0")/.."

mode="${1:-}"
shift || true
dry=0
bin=""
tol="1e-3"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry) dry=1 ;;
    --bin) bin="$2"; shift ;;
    --tol) tol="$2"; shift ;;
    *) echo "gpu-check: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done

case "$mode" in
  build)
    export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/pipec-target}"
    cargo build --release --features cuda
    mkdir -p gpu-check
    cp "$CARGO_TARGET_DIR/release/pipec" gpu-check/pipec
    strip gpu-check/pipec
    size=$(stat -c %s gpu-check/pipec)
    echo "gpu-check/pipec: $((size / 1048576)) MiB (carry gpu-check/ to the GPU machine; at most 64 MiB)"
    [ "$size" -le $((64 * 1048576)) ] || { echo "gpu-check: the binary is over 64 MiB" >&2; exit 1; }
    exit 0
    ;;
  run) ;;
  *) echo "usage: scripts/gpu-check.sh build | run [--dry] [--bin PATH] [--tol REL]" >&2; exit 2 ;;
esac

if [ -z "$bin" ]; then
  if [ "$dry" = 1 ]; then bin="${CARGO_TARGET_DIR:-$HOME/.cache/pipec-target}/debug/pipec"; else bin="gpu-check/pipec"; fi
fi
[ -x "$bin" ] || { echo "gpu-check: no pipec binary at $bin (run \`scripts/gpu-check.sh build\` first)" >&2; exit 2; }
out="${OUT:-gpu-check/results}"
rm -rf "$out"
mkdir -p "$out/specs"
# reproducible kernels: CubeCL picks its kernels without timing them
export CUBECL_AUTOTUNE_LEVEL=minimal
device_backend=cuda
device_flags=(--share-gpus)
if [ "$dry" = 1 ]; then
  device_backend=cpu
  device_flags=()
  echo "gpu-check: dry run (CPU only; the GPU parts are skipped)"
else
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
fi

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
spec interleaved 2 straight "{ kind: interleaved, virtual_stages: 2 }" "" "$mlp"
spec zb-h1 2 straight zb-h1 "" "$mlp"
spec chimera 2 straight chimera "" "$mlp"
spec dp-only 2 straight dp-only "" "$mlp"
sed -i '/^  stages: /d' "$out/specs/dp-only.yaml"
spec recompute 2 straight 1f1b "  recompute: true" "$mlp"
spec tensor-parallel 4 '"1-1"' 1f1b "  tp: 2" "$blocks"
# (the transformer takes 32 token ids: 32 × 16 = 512 features reach the head)

status=0
for f in "$out"/specs/*.yaml; do
  name=$(basename "$f" .yaml)
  "$bin" run "$f" --backend cpu -o "$out/cpu/$name" > "$out/$name.cpu.log" 2>&1 || { echo "FAIL $name: the CPU run failed (see $out/$name.cpu.log)"; status=1; continue; }
  "$bin" run "$f" --backend "$device_backend" "${device_flags[@]}" -o "$out/dev/$name" > "$out/$name.dev.log" 2>&1 || { echo "FAIL $name: the $device_backend run failed (see $out/$name.dev.log)"; status=1; continue; }
  python3 - "$out/cpu/$name/metrics.jsonl" "$out/dev/$name/metrics.jsonl" "$tol" "$name" <<'EOF' || status=1
import json, sys
a = [json.loads(l)["loss"] for l in open(sys.argv[1])]
b = [json.loads(l)["loss"] for l in open(sys.argv[2])]
tol, name = float(sys.argv[3]), sys.argv[4]
worst = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b)) if a and len(a) == len(b) else float("inf")
ok = worst <= tol
print(f"{'ok  ' if ok else 'FAIL'} {name}: {len(a)} steps, largest relative loss difference {worst:.2e} (tolerance {tol:.0e})")
sys.exit(0 if ok else 1)
EOF
done | tee "$out/equality.txt"
grep -q FAIL "$out/equality.txt" && status=1

# --- 2. MPI with CUDA: two ranks, each on its own GPU (or sharing one) --------------------
if [ "$dry" = 0 ] && command -v mpirun >/dev/null 2>&1 && ldd "$bin" 2>/dev/null | grep -q libmpi; then
  mpirun --allow-run-as-root --oversubscribe -np 2 "$bin" run "$out/specs/1f1b.yaml" --transport mpi --backend cuda --share-gpus -o "$out/mpi" > "$out/mpi.log" 2>&1 \
    && echo "ok   mpi: 2 ranks on CUDA" | tee -a "$out/equality.txt" \
    || { echo "FAIL mpi: see $out/mpi.log" | tee -a "$out/equality.txt"; status=1; }
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

# --- 3. the benchmark: pipec against PyTorch on the same device ----------------------------
bench="$out/specs/bench.yaml"
cat > "$bench" <<'EOF'
name: gpu-check-bench
model:
  input: [1024]
  layers:
    - repeat 8: linear(1024, 1024) -> relu
    - linear(1024, 10)
  loss: cross_entropy
cluster:
  nodes: 1
  devices_per_node: 1
  device: { memory: 16GiB, throughput: 10TFLOP/s }
  links:
    intra_node: { bandwidth: 100GB/s, latency: 5us }
strategy:
  stages: straight
  schedule: gpipe
  microbatches: 8
training:
  batch_size: 256
  steps: 25
  optimizer: { kind: sgd, lr: 0.01 }
  seed: 1
EOF
bench_steps=25
[ "$dry" = 1 ] && bench_steps=6 # the dry run only proves the path works
"$bin" run "$bench" --backend "$device_backend" --steps "$bench_steps" -o "$out/bench" > "$out/bench.log" 2>&1 || { echo "FAIL bench: see $out/bench.log"; status=1; }
"$bin" profile "$bench" --backend "$device_backend" --reps 3 -o "$out/profile.json" > "$out/profile.log" 2>&1 || { echo "FAIL profile: see $out/profile.log"; status=1; }
python3 - "$out" "$dry" <<'EOF' | tee "$out/bench.txt"
import json, os, statistics, subprocess, sys, time
out, dry = sys.argv[1], sys.argv[2] == "1"
steps = [json.loads(l) for l in open(os.path.join(out, "bench", "metrics.jsonl"))] if os.path.exists(os.path.join(out, "bench", "metrics.jsonl")) else []
timed = [s["step_time_s"] for s in steps[5:]]
flops = 3 * 2 * 256 * (8 * 1024 * 1024 + 1024 * 10)  # forward + backward (2x) multiply-adds, per step
if timed:
    t = statistics.median(timed)
    print(f"pipec: median step {t * 1e3:.2f} ms over {len(timed)} steps, {flops / t / 1e12:.2f} TFLOP/s achieved")
if os.path.exists(os.path.join(out, "profile.json")):
    p = json.load(open(os.path.join(out, "profile.json")))
    mb = p.get("batch_size", 32)
    for l in p.get("layers", []):
        line = f"  layer {l['index']} {l['name']}: forward {l['forward_ms']:.3f} ms, backward {l['backward_ms']:.3f} ms"
        if l.get("parameter_bytes", 0) > 0 and l["forward_ms"] > 0:
            fwd = 2 * mb * l["parameter_bytes"] / 4  # one multiply-add per weight per sample
            line += f", forward {fwd / (l['forward_ms'] / 1e3) / 1e12:.2f} TFLOP/s"
        print(line)
if dry:
    print("skip torch: dry run")
    sys.exit(0)
try:
    import torch
except ImportError:
    print("skip torch: PyTorch is not installed here")
    sys.exit(0)
dev = torch.device("cuda")
torch.manual_seed(1)
layers = []
for _ in range(8):
    layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
model = torch.nn.Sequential(*layers, torch.nn.Linear(1024, 10)).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(256, 1024, device=dev)
y = torch.randint(0, 10, (256,), device=dev)
times = []
for step in range(25):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    opt.zero_grad()
    for mb in range(8):  # the same 8 microbatches of 32, accumulated
        loss = torch.nn.functional.cross_entropy(model(x[mb * 32:(mb + 1) * 32]), y[mb * 32:(mb + 1) * 32]) / 8
        loss.backward()
    opt.step()
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
tt = statistics.median(times[5:])
name = torch.cuda.get_device_name(0)
# dense fp32 (not tensor-core) peaks from NVIDIA's data sheets, TFLOP/s
peaks = {"H100 80GB HBM3": 67.0, "H100 PCIe": 51.0, "H200": 67.0, "A100": 19.5}
peak = next((v for k, v in peaks.items() if k in name), None)
print(f"torch {torch.__version__} on {name}: median step {tt * 1e3:.2f} ms, {flops / tt / 1e12:.2f} TFLOP/s achieved")
if timed:
    print(f"pipec / torch step time: {statistics.median(timed) / tt:.2f}x")
if peak:
    for who, t in [("pipec", statistics.median(timed) if timed else None), ("torch", tt)]:
        if t:
            print(f"{who}: {100 * flops / t / 1e12 / peak:.1f}% of the {name}'s {peak} TFLOP/s fp32 peak")
EOF
echo "gpu-check: results in $out"
exit $status

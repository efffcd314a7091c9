#!/usr/bin/env python3
"""The GPU benchmark's PyTorch side and its report (called by scripts/gpu-check.sh).

    gpu_bench.py torch OUT.json        time PyTorch eager on the models of bench/specs/gpu/
                                       (fp32, and bf16 autocast): one microbatch's forward
                                       and backward, and a whole step, on the first GPU
    gpu_bench.py staging OUT.json      time the host-staged collective's parts: copies between
                                       the GPU and host memory (pageable and pinned), and
                                       which GPUs NCCL could join here
    gpu_bench.py report DIR            the side-by-side table from DIR/torch.json and
                                       pipec's results under DIR/<model>/ (profile.json,
                                       run/metrics.jsonl, plan-profile.log, plan-calibrated.log)

The PyTorch models are written to match the specs layer for layer: the same shapes, the
same microbatches, plain SGD. GPT-2's attention is timed both ways PyTorch offers in eager
mode: `F.scaled_dot_product_attention` (a fused, flash-style kernel on this GPU) and the
written-out softmax(QKᵀ)V that pipec computes.
"""
import json
import math
import os
import re
import statistics
import sys
import time

UNIT = {"s": 1.0, "ms": 1e-3, "µs": 1e-6, "us": 1e-6, "ns": 1e-9}
MODELS = {
    # name: (microbatch, microbatches)
    "mlp": (32, 8),
    "gpt2-blocks": (2, 4),
    "resnet50-res3": (32, 2),
}


def torch_models(torch):
    nn, F = torch.nn, torch.nn.functional

    def mlp():
        layers = []
        for _ in range(8):
            layers += [nn.Linear(1024, 1024), nn.ReLU()]
        model = nn.Sequential(*layers, nn.Linear(1024, 10))
        x = lambda b: torch.randn(b, 1024)
        y = lambda b: torch.randint(0, 10, (b,))
        return model, x, y

    class Block(nn.Module):
        def __init__(self, d, heads, ff, fused):
            super().__init__()
            self.heads, self.fused = heads, fused
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, ff), nn.Linear(ff, d)

        def forward(self, x):
            b, s, d = x.shape
            h, dh = self.heads, d // self.heads
            q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, h, dh).permute(2, 0, 3, 1, 4)
            if self.fused:
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                scores = (q @ k.transpose(-2, -1)) / math.sqrt(dh)
                mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
                a = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
            x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class Gpt(nn.Module):
        def __init__(self, fused):
            super().__init__()
            self.tok, self.pos = nn.Embedding(1024, 768), nn.Parameter(torch.zeros(1024, 768))
            self.blocks = nn.Sequential(*[Block(768, 12, 3072, fused) for _ in range(4)])
            self.ln, self.head = nn.LayerNorm(768), nn.Linear(768, 1024)

        def forward(self, t):
            return self.head(self.ln(self.blocks(self.tok(t) + self.pos))).flatten(0, 1)

    def gpt(fused):
        x = lambda b: torch.randint(0, 1024, (b, 1024))
        y = lambda b: torch.randint(0, 1024, (b * 1024,))
        return Gpt(fused), x, y

    def conv_bn(cin, cout, k, stride=1):
        return [nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout)]

    class Bottleneck(nn.Module):
        def __init__(self, cin, mid, cout, stride):
            super().__init__()
            self.branch = nn.Sequential(
                *conv_bn(cin, mid, 1), nn.ReLU(), *conv_bn(mid, mid, 3, stride), nn.ReLU(), *conv_bn(mid, cout, 1)
            )
            self.shortcut = nn.Sequential(*conv_bn(cin, cout, 1, stride)) if cin != cout else nn.Identity()

        def forward(self, x):
            return F.relu(self.branch(x) + self.shortcut(x))

    def resnet():
        model = nn.Sequential(
            Bottleneck(256, 128, 512, 2),
            *[Bottleneck(512, 128, 512, 1) for _ in range(3)],
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(512, 10),
        )
        x = lambda b: torch.randn(b, 256, 56, 56)
        y = lambda b: torch.randint(0, 10, (b,))
        return model, x, y

    return {
        "mlp": [("", mlp)],
        "gpt2-blocks": [(" sdpa", lambda: gpt(True)), (" written-out attention", lambda: gpt(False))],
        "resnet50-res3": [("", resnet)],
    }


def time_torch(out_path):
    import torch

    dev = torch.device("cuda")
    # strict fp32 products (PyTorch's default for matmul; cuDNN's convolutions default to
    # TF32, turned off here too)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    results = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "models": {}}
    for name, variants in torch_models(torch).items():
        mb, n = MODELS[name]
        for label, make in variants:
            for precision in ["fp32", "bf16"]:
                torch.manual_seed(1)
                model, x, y = make()
                model = model.to(dev).train()
                opt = torch.optim.SGD(model.parameters(), lr=0.01)
                xs = [x(mb).to(dev) for _ in range(n)]
                ys = [y(mb).to(dev) for _ in range(n)]
                cast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16")

                def forward(i):
                    with cast:
                        return torch.nn.functional.cross_entropy(model(xs[i]), ys[i]) / n

                fwd, bwd, steps = [], [], []
                ev = lambda: torch.cuda.Event(enable_timing=True)
                for rep in range(25):
                    a, b, c = ev(), ev(), ev()
                    a.record()
                    loss = forward(0)
                    b.record()
                    loss.backward()
                    c.record()
                    torch.cuda.synchronize()
                    if rep >= 5:
                        fwd.append(a.elapsed_time(b))
                        bwd.append(b.elapsed_time(c))
                for rep in range(15):
                    a, b = ev(), ev()
                    a.record()
                    opt.zero_grad(set_to_none=False)
                    for i in range(n):
                        forward(i).backward()
                    opt.step()
                    b.record()
                    torch.cuda.synchronize()
                    if rep >= 5:
                        steps.append(a.elapsed_time(b))
                key = f"{name}{label} {precision}"
                results["models"][key] = {
                    "forward_ms": statistics.median(fwd),
                    "backward_ms": statistics.median(bwd),
                    "step_ms": statistics.median(steps),
                }
                print(f"torch {key}: forward {statistics.median(fwd):.3f} ms, backward "
                      f"{statistics.median(bwd):.3f} ms per microbatch; step {statistics.median(steps):.2f} ms",
                      flush=True)
                del model, opt, xs, ys
                torch.cuda.empty_cache()
    with open(out_path + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(out_path + ".tmp", out_path)


def time_staging(out_path):
    import torch

    results = {"gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "copies": []}
    for mib in [1, 16, 256]:
        n = mib * 1024 * 1024 // 4
        src = torch.randn(n, device="cuda")
        for pinned in [False, True]:
            host = torch.empty(n, pin_memory=pinned)
            for direction in ["device to host", "host to device"]:
                times = []
                for rep in range(12):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    if direction == "device to host":
                        host.copy_(src)
                    else:
                        src.copy_(host)
                    torch.cuda.synchronize()
                    if rep >= 2:
                        times.append(time.perf_counter() - t0)
                t = statistics.median(times)
                row = {"MiB": mib, "pinned": pinned, "direction": direction, "ms": t * 1e3, "GB_s": mib * 1048576 / t / 1e9}
                results["copies"].append(row)
                print(f"{direction:>14} {mib:>4} MiB {'pinned' if pinned else 'pageable'}: {t * 1e3:.3f} ms, {row['GB_s']:.1f} GB/s", flush=True)
    try:
        import torch.distributed as dist

        results["nccl"] = dist.is_nccl_available() and torch.cuda.nccl.version()
    except Exception as e:  # noqa: BLE001 (a report, not a failure)
        results["nccl"] = f"unavailable: {e}"
    print(f"NCCL {results['nccl']}; {results['gpus']} GPU(s): NCCL needs one GPU per rank", flush=True)
    with open(out_path + ".tmp", "w") as f:
        json.dump(results, f, indent=1, default=str)
    os.replace(out_path + ".tmp", out_path)


def predicted_line(path):
    """(measured s, predicted s) from a `pipec run` log's step-time line."""
    if not os.path.exists(path):
        return None
    for line in open(path, errors="replace"):
        m = re.search(r"step time: measured ([\d.]+) (\S+) .*predicted ([\d.]+) (\S+?);", line)
        if m:
            return float(m[1]) * UNIT[m[2]], float(m[3]) * UNIT[m[4]]
    return None


def compile_prediction(path):
    """The predicted step (s) from a `pipec compile` log."""
    if not os.path.exists(path):
        return None
    m = re.search(r"predicted step ([\d.]+) (\S+?)[,;)\s]", open(path, errors="replace").read())
    return float(m[1]) * UNIT[m[2]] if m else None


def median_step(path):
    """The median step (ms) of a `pipec run`'s metrics.jsonl after its first five, if any."""
    if not os.path.exists(path):
        return None
    times = [json.loads(l)["step_time_s"] for l in open(path) if l.strip()]
    return statistics.median(times[5:]) * 1e3 if len(times) > 5 else None


def report(d):
    torch_path = os.path.join(d, "torch.json")
    tr = json.load(open(torch_path)) if os.path.exists(torch_path) else {"models": {}}
    print(f"## pipec and PyTorch {tr.get('torch', '?')} eager on {tr.get('gpu', '?')}\n")
    print("Per microbatch (pipec: the sum of `pipec profile --backend cuda`'s layers; PyTorch: CUDA")
    print("events around one microbatch's forward with its loss, and its backward), and a whole step")
    print("(pipec: `pipec run --backend cuda`, the median step after the first five; PyTorch: the same")
    print("microbatches accumulated, then SGD). Ratio: PyTorch's time / pipec's (pipec's share of")
    print("PyTorch's throughput; the goal is ≥ 0.8).\n")
    print("| model | precision | pipec fwd | torch fwd | pipec bwd | torch bwd | pipec step | torch step | step ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in MODELS:
        prof_path = os.path.join(d, name, "profile.json")
        pf = pb = ps = None
        if os.path.exists(prof_path):
            p = json.load(open(prof_path))
            pf = sum(l["forward_ms"] for l in p["layers"])
            pb = sum(l["backward_ms"] for l in p["layers"])
        ps = median_step(os.path.join(d, name, "run", "metrics.jsonl"))
        ps_bf16 = median_step(os.path.join(d, name, "run-bf16", "metrics.jsonl"))
        ps_fp16 = median_step(os.path.join(d, name, "run-fp16", "metrics.jsonl"))
        for key, t in tr["models"].items():
            if not key.startswith(name + " "):
                continue
            precision = key.split()[-1]
            fmt = lambda v: f"{v:.3f} ms" if v is not None else "-"
            mine = precision == "fp32"  # the profile is fp32's; bf16 has its whole step only
            step = ps if mine else ps_bf16
            ratio = f"{t['step_ms'] / step:.2f}" if step else "-"
            print(f"| {key[:-len(precision) - 1]} | {precision} | {fmt(pf if mine else None)} | {fmt(t['forward_ms'])} | "
                  f"{fmt(pb if mine else None)} | {fmt(t['backward_ms'])} | {fmt(step)} | "
                  f"{fmt(t['step_ms'])} | {ratio} |")
        if ps_fp16:
            print(f"| {name} | fp16 (pipec, loss scaling) | - | - | - | - | {ps_fp16:.3f} ms | - | - |")
    print("\n## pipec's predicted step against its measured step (one GPU)\n")
    print("| model | prediction from | predicted | measured | measured / predicted |")
    print("|---|---|---|---|---|")
    for name in MODELS:
        r = predicted_line(os.path.join(d, name, "plan-profile.log"))
        if not r:
            continue
        measured, predicted = r
        print(f"| {name} | `pipec profile` | {predicted * 1e3:.2f} ms | {measured * 1e3:.2f} ms | {measured / predicted:.2f} |")
        calibrated = compile_prediction(os.path.join(d, name, "plan-calibrated.log"))
        if calibrated:
            print(f"| {name} | `pipec calibrate` | {calibrated * 1e3:.2f} ms | {measured * 1e3:.2f} ms | {measured / calibrated:.2f} |")


if __name__ == "__main__":
    commands = {"torch": time_torch, "staging": time_staging, "report": report}
    if len(sys.argv) != 3 or sys.argv[1] not in commands:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    commands[sys.argv[1]](sys.argv[2])

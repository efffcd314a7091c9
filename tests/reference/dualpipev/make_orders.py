"""DualPipeV's and DualPipe's per-rank compute orders, as DeepSeek's reference
implementation runs them.

Runs `DualPipeV.step` and `DualPipe.step` from deepseek-ai/DualPipe's
`dualpipe/dualpipev.py` and `dualpipe/dualpipe.py` (their paths are the arguments; the files
are read, not copied here) with their compute and communication methods replaced by
recorders, so what is recorded is exactly the order `step` issues: forwards (F), whole
backwards (B), input-gradient backwards with their weight gradient deferred (I), and the
deferred weight gradients run first in, first out (W).

DualPipeV: chunk 0 of rank r is stage r, chunk 1 stage 2R - 1 - r. DualPipe: D ranks, two
pipelines of D stages, stage s of the one going down on rank s and of the one going up on
rank D - 1 - s; a rank's phase 0 is the direction in which it is in the first half; the
down pipeline takes microbatches 0 .. N/2 - 1, the up one N/2 .. N - 1.

Writes orders.json (DualPipeV) and dualpipe-orders.json beside this script: one entry per
(ranks, microbatches), each rank's order in PyTorch's action notation (`3F0`, `2I1`, ...).
Needs torch importable (only `import torch` runs).

    python make_orders.py path/to/dualpipe/dualpipev.py path/to/dualpipe/dualpipe.py
"""

import importlib.util
import json
import sys
import types
from collections import deque
from pathlib import Path


def load(path, name):
    # the reference imports `dualpipe.comm` and `dualpipe.utils`; neither runs here
    package = types.ModuleType("dualpipe")
    comm = types.ModuleType("dualpipe.comm")
    comm.TENSOR_SHAPES, comm.TENSOR_DTYPE = [()], "float32"
    utils = types.ModuleType("dualpipe.utils")
    utils.WeightGradStore = None
    utils.run_backward = utils.scatter = utils.gather = None
    package.comm, package.utils = comm, utils
    sys.modules.update({"dualpipe": package, "dualpipe.comm": comm, "dualpipe.utils": utils})
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def order(module, ranks, rank, microbatches, bidirectional=False):
    if bidirectional:
        # phase 0: the direction in which this rank is in the first half
        down, up = (rank, 0), (ranks - 1 - rank, microbatches // 2)
        stage, base = zip(*((down, up) if rank < ranks // 2 else (up, down)))
    else:
        stage, base = [rank, 2 * ranks - 1 - rank], [0, 0]
    events, deferred = [], deque()
    f, b = [0, 0], [0, 0]

    class Queue:
        def empty(self):
            return not deferred

    class Store:
        funcs_queue = Queue()

    module.WeightGradStore = Store
    module.scatter = lambda *a, **k: []
    # a bare instance (its __init__ wants CUDA and a process group); nn.Module's own
    # attribute machinery is bypassed
    pipe = object.__new__(module.DualPipe if bidirectional else module.DualPipeV)

    def put(name, value):
        object.__setattr__(pipe, name, value)

    put("rank", rank)
    put("num_ranks", ranks)
    put("is_first_rank", rank == 0)
    put("is_last_rank", rank == ranks - 1)
    put("is_middle_rank", rank in (ranks // 2 - 1, ranks // 2))
    put("batch_dim", 0)

    def forward(phase, recv=True, send=True):
        events.append(f"{stage[phase]}F{base[phase] + f[phase]}")
        f[phase] += 1

    def backward(phase, enable_zb=False, recv=True, send=True):
        if enable_zb:
            events.append(f"{stage[phase]}I{base[phase] + b[phase]}")
            deferred.append(f"{stage[phase]}W{base[phase] + b[phase]}")
        else:
            events.append(f"{stage[phase]}B{base[phase] + b[phase]}")
        b[phase] += 1

    def forward_backward(phase0, phase1, recv0=True):
        forward(phase0)
        backward(phase1)

    def weight():
        events.append(deferred.popleft())

    put("_forward_chunk", forward)
    put("_backward_chunk", backward)
    put("_forward_backward_chunk", forward_backward)
    put("_weight_chunk", weight)
    for name in ["_reset_states", "_commit_and_wait_comm", "_recv_forward", "_send_forward",
                 "_recv_backward", "_send_backward"]:
        put(name, lambda *a, **k: None)
    put("loss_chunks", [module.torch.zeros(1)])
    put("criterion", None)
    module.torch.is_grad_enabled = lambda: True
    pipe.step(num_chunks=microbatches, criterion=lambda *a: None)
    assert not deferred, "weight gradients left over"
    return events


def write(name, source, cases):
    out = Path(__file__).with_name(name)
    out.write_text(json.dumps({"source": source, "cases": cases}, indent=1) + "\n")
    print(f"wrote {out}: {len(cases)} cases")


def main():
    v = load(sys.argv[1], "dualpipev")
    cases = []
    for ranks in [2, 3, 4]:
        for microbatches in sorted({2 * ranks, 2 * ranks + 1, 3 * ranks, 4 * ranks + 2}):
            orders = [order(v, ranks, r, microbatches) for r in range(ranks)]
            cases.append({"ranks": ranks, "microbatches": microbatches, "orders": orders})
    write("orders.json", "deepseek-ai/DualPipe dualpipe/dualpipev.py, DualPipeV.step", cases)
    if len(sys.argv) > 2:
        bi = load(sys.argv[2], "dualpipe")
        cases = []
        for ranks in [2, 4, 6]:
            for microbatches in sorted({2 * ranks, 2 * ranks + 2, 4 * ranks}):
                orders = [order(bi, ranks, r, microbatches, True) for r in range(ranks)]
                cases.append({"ranks": ranks, "microbatches": microbatches, "orders": orders})
        write("dualpipe-orders.json", "deepseek-ai/DualPipe dualpipe/dualpipe.py, DualPipe.step", cases)


if __name__ == "__main__":
    main()

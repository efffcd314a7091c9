"""DualPipeV's per-rank compute orders, as DeepSeek's reference implementation runs them.

Runs `DualPipeV.step` from deepseek-ai/DualPipe's `dualpipe/dualpipev.py` (its path is the
first argument; the file is read, not copied here) with its compute and communication
methods replaced by recorders, so what is recorded is exactly the order `step` issues:
forwards (F), whole backwards (B), input-gradient backwards with their weight gradient
deferred (I), and the deferred weight gradients run first in, first out (W). Chunk 0 of
rank r is stage r, chunk 1 is stage 2R - 1 - r. Writes orders.json beside this script:
one entry per (ranks, microbatches), each rank's order in PyTorch's action notation
(`3F0`, `2I1`, ...). Needs torch importable (only `import torch` runs).

    python make_orders.py path/to/dualpipe/dualpipev.py
"""

import importlib.util
import json
import sys
import types
from collections import deque
from pathlib import Path


def load(path):
    # the reference imports `dualpipe.comm` and `dualpipe.utils`; neither runs here
    package = types.ModuleType("dualpipe")
    comm = types.ModuleType("dualpipe.comm")
    comm.TENSOR_SHAPES, comm.TENSOR_DTYPE = [()], "float32"
    utils = types.ModuleType("dualpipe.utils")
    utils.WeightGradStore = None
    utils.run_backward = utils.scatter = utils.gather = None
    package.comm, package.utils = comm, utils
    sys.modules.update({"dualpipe": package, "dualpipe.comm": comm, "dualpipe.utils": utils})
    spec = importlib.util.spec_from_file_location("dualpipev", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def order(module, ranks, rank, microbatches):
    stage = [rank, 2 * ranks - 1 - rank]
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
    pipe = object.__new__(module.DualPipeV)

    def put(name, value):
        object.__setattr__(pipe, name, value)

    put("rank", rank)
    put("num_ranks", ranks)
    put("is_first_rank", rank == 0)
    put("is_last_rank", rank == ranks - 1)
    put("batch_dim", 0)

    def forward(phase, recv=True, send=True):
        events.append(f"{stage[phase]}F{f[phase]}")
        f[phase] += 1

    def backward(phase, enable_zb=False, recv=True, send=True):
        if enable_zb:
            events.append(f"{stage[phase]}I{b[phase]}")
            deferred.append(f"{stage[phase]}W{b[phase]}")
        else:
            events.append(f"{stage[phase]}B{b[phase]}")
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
    module.torch.is_grad_enabled = lambda: True
    pipe.step(num_chunks=microbatches, criterion=lambda *a: None)
    assert not deferred, "weight gradients left over"
    return events


def main():
    module = load(sys.argv[1])
    cases = []
    for ranks in [2, 3, 4]:
        for microbatches in sorted({2 * ranks, 2 * ranks + 1, 3 * ranks, 4 * ranks + 2}):
            orders = [order(module, ranks, r, microbatches) for r in range(ranks)]
            cases.append({"ranks": ranks, "microbatches": microbatches, "orders": orders})
    out = Path(__file__).with_name("orders.json")
    out.write_text(json.dumps({"source": "deepseek-ai/DualPipe dualpipe/dualpipev.py, DualPipeV.step",
                               "cases": cases}, indent=1) + "\n")
    print(f"wrote {out}: {len(cases)} cases")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Runs PipeDream's own optimizer on every published profile and records its plans.

Usage: run_pipedream.py PIPEDREAM_CHECKOUT [--timeout SECONDS] [--fresh]

--timeout: per optimizer run (default 600); --fresh: rerun what pipedream-plans.json
already records.

PIPEDREAM_CHECKOUT is a checkout of github.com/msr-fiddle/pipedream (its `optimizer/` and
`graph/` directories are used as they are; `numpy` and `graphviz` are only printed or drawn
there, so stand-ins are put on the path when they are missing). For each profile in this
directory and each cluster below, the optimizer runs with `--activation_compression_ratio 1`
(activation and gradient transfers between stages are counted, uncompressed; without the
flag PipeDream's optimizer ignores them) and no memory constraint. Inception-v3 and the
NASNets are first branch-compressed with PipeDream's own `Graph.compress_branches` (its
optimizer runs out of memory on the originals); the compressed graphs are written next to
the originals as `graph-compressed.txt`.

The two-level runs solve the flat problem once per start state, so they are only run
for profiles whose flat run took under a twentieth of the timeout.

The result, `pipedream-plans.json`, lists per profile and cluster PipeDream's predicted time
per minibatch, its stages (state ranges, replicas at each level, flattened replica count)
and how long the optimizer took. `compiler/tests/pipedream_profiles.rs` compares pipec's
plans against it.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# name, machines per level (innermost first), bandwidth per level in bytes/s
CLUSTERS = [
    ("flat16", [16], [2.5e9]),
    ("4x4", [4, 4], [8e9, 1.25e9]),
    ("2x8", [8, 2], [25e9, 1.25e9]),
]

COMPRESSED = {"inception_v3", "nasnetamobile", "nasnetalarge"}

STUBS = {
    "numpy.py": "def array(x):\n    return '<matrix>'\n",
    "graphviz.py": (
        "class Digraph:\n"
        "    def __init__(self, *a, **k): pass\n"
        "    def node(self, *a, **k): pass\n"
        "    def edge(self, *a, **k): pass\n"
        "    def render(self, *a, **k): pass\n"
    ),
}


def python_path(checkout, stubs):
    paths = [checkout]
    for module, text in STUBS.items():
        name = module[:-3]
        probe = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True)
        if probe.returncode != 0:
            with open(os.path.join(stubs, module), "w") as f:
                f.write(text)
    return os.pathsep.join([stubs] + paths)


def compress(checkout, env, model):
    source = os.path.join(HERE, model, "graph.txt")
    target = os.path.join(HERE, model, "graph-compressed.txt")
    code = (
        "import builtins, sys\n"
        "builtins.xrange = range  # check_fidelity is Python 2\n"
        "import graph\n"
        "gr = graph.Graph.from_str(open(sys.argv[1]).read())\n"
        "c = gr.compress_branches()\n"
        "gr.check_fidelity(c)\n"
        "open(sys.argv[2] + '.tmp', 'w').write(str(c))\n"
    )
    subprocess.run([sys.executable, "-c", code, source, target], env=env, check=True)
    os.replace(target + ".tmp", target)
    return target


TABLE_ROW = re.compile(r"^\((\d+), (\d+)\) (\S+) (\d+)$")


def parse(stdout, levels):
    """Stages from the configuration tables, outermost level first."""
    tables = []  # per level section: list of tables, each a list of (start, end, replicas)
    current = None
    for line in stdout.splitlines():
        if line.startswith("Level "):
            current = []
            tables.append(current)
        elif line.startswith("(Split start, split end)"):
            current.append([])
        else:
            m = TABLE_ROW.match(line.strip())
            if m and current is not None and current:
                current[-1].append((int(m.group(1)), int(m.group(2)), int(m.group(4))))
    time_match = re.search(r"Time per stage in pipeline: (\S+)", stdout)
    if len(tables) != levels or time_match is None:
        raise RuntimeError("unexpected optimizer output")
    # Flatten: an inner stage's devices = its replicas times the enclosing stages' replicas.
    outer = [(s, e, [r]) for table in tables[0] for (s, e, r) in table]
    for section in tables[1:]:
        rows = [row for table in section for row in table]
        inner = []
        for (s, e, r) in rows:
            parent = next(p for p in outer if p[0] <= s and e <= p[1])
            inner.append((s, e, [r] + parent[2]))
        outer = inner
    stages = []
    for (s, e, reps) in outer:
        total = 1
        for r in reps:
            total *= r
        stages.append({"states": [s, e], "replicas": reps, "devices": total})
    return float(time_match.group(1)), stages


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    checkout = os.path.abspath(sys.argv[1])
    timeout = 600
    if "--timeout" in sys.argv:
        timeout = int(sys.argv[sys.argv.index("--timeout") + 1])
    stubs = tempfile.mkdtemp()
    env = dict(os.environ, PYTHONPATH=python_path(checkout, stubs))
    out = os.path.join(HERE, "pipedream-plans.json")
    # runs already recorded are kept unless --fresh (the slow ones take minutes)
    done = {}
    if os.path.exists(out) and "--fresh" not in sys.argv:
        for r in json.load(open(out))["runs"]:
            if r["finished"]:
                done[(r["model"], r["cluster"])] = r
    results = []

    def save():
        with open(out + ".tmp", "w") as f:
            json.dump({"clusters": [{"name": n, "machines": m, "bandwidths": b} for (n, m, b) in CLUSTERS],
                       "runs": results}, f, indent=1)
            f.write("\n")
        os.replace(out + ".tmp", out)

    models = sorted(d for d in os.listdir(HERE) if os.path.isfile(os.path.join(HERE, d, "graph.txt")))
    for model in models:
        profile = os.path.join(HERE, model, "graph.txt")
        if model in COMPRESSED:
            profile = compress(checkout, env, model)
        flat_seconds = None
        for (name, machines, bandwidths) in CLUSTERS:
            if (model, name) in done:
                results.append(done[(model, name)])
                if len(machines) == 1:
                    flat_seconds = done[(model, name)].get("optimizer_seconds", timeout)
                continue
            save()
            if len(machines) > 1 and (flat_seconds is None or flat_seconds > timeout / 20):
                # PipeDream's lower levels solve every start state (final_level=False), about
                # as many times the flat problem as the profile has states
                print(f"{model} {name}: not run (the flat run took {flat_seconds} s)", flush=True)
                results.append({"model": model, "cluster": name, "finished": False,
                                "skipped": "the two-level optimizer solves the flat problem once per state"})
                continue
            cmd = [sys.executable, "optimizer_graph_hierarchical.py", "-f", profile, "-n"]
            cmd += [str(m) for m in machines] + ["-b"] + [repr(b) for b in bandwidths]
            cmd += ["--activation_compression_ratio", "1"]
            start = time.time()
            try:
                run = subprocess.run(cmd, cwd=os.path.join(checkout, "optimizer"), env=env,
                                     capture_output=True, text=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                print(f"{model} {name}: did not finish in {timeout} s", flush=True)
                results.append({"model": model, "cluster": name, "finished": False,
                                "skipped": f"did not finish in {timeout} s"})
                continue
            took = time.time() - start
            if len(machines) == 1:
                flat_seconds = round(took, 1)
            if run.returncode != 0:
                print(f"{model} {name}: failed\n{run.stderr[-2000:]}", flush=True)
                results.append({"model": model, "cluster": name, "finished": False})
                continue
            seconds, stages = parse(run.stdout, len(machines))
            layout = "-".join(str(s["devices"]) for s in stages)
            print(f"{model} {name}: {layout} {seconds * 1e3:.3f} ms ({took:.1f} s)", flush=True)
            results.append({
                "model": model,
                "cluster": name,
                "profile": os.path.relpath(profile, HERE),
                "finished": True,
                "time_ms": seconds * 1e3,
                "stages": stages,
                "optimizer_seconds": round(took, 2),
            })
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())

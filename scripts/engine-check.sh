#!/usr/bin/env bash
# Checks `pipec emit`'s configurations against the engines themselves, without a GPU: makes
# a throwaway venv OUTSIDE the repository (Python 3.12), installs the pinned engines, emits
# every example language model and every published layout (tests/engines/published, imported
# first) for every engine that accepts it, and runs each engine's own argument parsing and
# validation on the result (scripts/engine_check.py), asserting the layout it derives equals
# pipec's. Never run by CI (.ci/run runs scripts/test.sh, which does not call this): it
# downloads several GB of wheels.
#
# Usage: bash scripts/engine-check.sh [OUT]    (default OUT: a fresh temporary folder)
# Env:   ENGINE_VENV (default ~/.cache/pipec-engine-check/venv), PYTHON (a python3.12)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${CI:-}" ]; then echo "engine-check: not in CI (it installs the engines from PyPI)" >&2; exit 2; fi

VENV="${ENGINE_VENV:-$HOME/.cache/pipec-engine-check/venv}"
case "$(cd "$(dirname "$VENV")" 2>/dev/null && pwd || dirname "$VENV")/" in "$PWD"/*) echo "engine-check: the venv must be outside the repository" >&2; exit 2;; esac
PYTHON="${PYTHON:-python3.12}"
PINS=(torch==2.15.0 megatron-core==0.19.2 torchtitan==0.2.2 deepspeed==0.19.8)
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q "${PINS[@]}"
fi
"$VENV/bin/python" -c "import sys, importlib.metadata as m; print('python', sys.version.split()[0]); [print(p, m.version(p)) for p in ('torch', 'megatron-core', 'torchtitan', 'deepspeed')]"

OUT="${1:-$(mktemp -d)}"
mkdir -p "$OUT"
cargo build -q --bin pipec
PIPEC="$(cargo metadata --format-version 1 --no-deps | "$VENV/bin/python" -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/debug/pipec"

# the published layouts, imported (the GPU count where the file does not say it)
P=tests/engines/published
mkdir -p "$OUT/specs" "$OUT/emit"
for f in "$P"/*.sh "$P"/*.args; do n="$(basename "${f%.*}")"; "$PIPEC" import "$f" --name "$n" -o "$OUT/specs/$n.yaml"; done
for f in 8b:64 70b:64 405b:128; do
  n="torchtitan-llama3-${f%%:*}"; "$PIPEC" import "$P/$n.toml" --gpus "${f##*:}" --name "$n" -o "$OUT/specs/$n.yaml"
done
"$PIPEC" import "$P/deepspeed-llama2-7b.json" --gpus 2 --model-config tests/import/llama-2-7b.json --name deepspeed-llama2-7b -o "$OUT/specs/deepspeed-llama2-7b.yaml"

# each published layout's model and cluster with the strategy left to pipec's search under
# its engine: the layout the search picks, emitted and checked by that engine too
mkdir -p "$OUT/searched"
for f in "$OUT"/specs/*.yaml; do
  "$VENV/bin/python" - "$f" "$OUT/searched/$(basename "$f" .yaml)-searched.yaml" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
auto = "strategy: { tp: auto, pp: auto, dp: auto, schedule: auto, microbatches: auto, recompute: auto }\n"
text = re.sub(r"name: (\S+)", r"name: \1-searched", text, count=1)
open(sys.argv[2], "w").write(re.sub(r"strategy:\n(  .*\n)+", auto, text))
PY
done

ok=0; failed=0; refused=0
for spec in specs/gpt-tiny.yaml specs/gpt2.yaml specs/llama-tiny.yaml specs/moe-tiny.yaml specs/hybrid.yaml \
    bench/specs/published-2025/mb2604-h100-gptoss120b-bf16-64g.yaml \
    bench/specs/published-2025/mb2509-h100-deepseekv3-fp8-1024g.yaml "$OUT"/specs/*.yaml "$OUT"/searched/*.yaml; do
  engines="megatron torchtitan deepspeed"
  # a searched spec: its own engine, written as a name or `{ name: NAME, ... }`
  case "$spec" in */searched/*) engines="$(sed -n -e 's/^engine: { *name: *\([a-z]*\).*/\1/p' -e 's/^engine: \([a-z]*\) *$/\1/p' "$spec")";; esac
  for engine in $engines; do
    dir="$OUT/emit/$(basename "$spec" .yaml)-$engine"
    if ! "$PIPEC" emit --engine "$engine" "$spec" -o "$dir" 2>"$dir.log"; then
      echo "REFUSED $(basename "$spec") $engine: $(grep -m1 error "$dir.log")"; refused=$((refused + 1)); continue
    fi
    if "$VENV/bin/python" scripts/engine_check.py "$dir" 2>"$dir.check.log"; then ok=$((ok + 1)); else failed=$((failed + 1)); fi
  done
done
echo "engine-check: $ok accepted by the engine with pipec's layout, $failed failed, $refused refused by pipec emit"
[ "$failed" -eq 0 ]

#!/usr/bin/env bash
# Predicted against measured CPU steps after `pipec calibrate` (docs/benchmarks.md, "CPU
# steps after calibration"): calibrates this machine one worker at a time and two at once,
# points the benchmark specs at those device files, runs each RUNS times and prints the
# median measured step beside the prediction, then the same for tensor parallelism 2
# against 1; then `pipec calibrate --measured` on one measured run of MEASURED (default
# 1f1b) and the specs on the same device file (two workers at once) again with the engine
# file it writes. Usage:
# scripts/cpu-fidelity.sh [PIPEC] [RUNS] [MEASURED] (a release build; default
# target/release/pipec, 5 runs). Writes nothing outside a temporary directory.
set -euo pipefail
cd "$(dirname "$0")/.."
pipec=${1:-${CARGO_TARGET_DIR:-target}/release/pipec}
runs=${2:-5}
measured_on=${3:-1f1b}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
ln -s "$PWD/specs/data" "$dir/data"

echo "calibrating (one worker, then two at once)..." >&2
"$pipec" calibrate -o "$dir/one.json" >"$dir/one.log" 2>&1
"$pipec" calibrate --concurrent 2 -o "$dir/two.json" >"$dir/two.log" 2>&1

# spec SRC NAME DEVICE-FILE LINK: SRC with its device and intra-node link replaced
spec() {
    sed -e "s#^  device: .*#  device: { file: $3 }#" -e "s#^    intra_node: .*#    intra_node: $4#" "$1" >"$dir/$2.yaml"
}
spec bench/specs/mlp-cpu.yaml mlp "$dir/one.json" "{ bandwidth: 10GB/s, latency: 5us }"
spec specs/1f1b.yaml 1f1b "$dir/two.json" "{ file: $dir/two.json }"
sed -e 's/^  schedule: 1f1b/  schedule: gpipe/' "$dir/1f1b.yaml" >"$dir/gpipe.yaml"
spec specs/gpt-tiny.yaml gpt-tiny "$dir/two.json" "{ file: $dir/two.json }"
spec specs/mlp-1f1b.yaml mlp-1f1b "$dir/two.json" "{ file: $dir/two.json }"
spec specs/resnet-small.yaml resnet "$dir/two.json" "{ file: $dir/two.json }"
spec specs/cnn.yaml cnn "$dir/two.json" "{ file: $dir/two.json }"
spec bench/specs/tp-cpu.yaml tp2 "$dir/two.json" "{ file: $dir/two.json }"
sed -e 's/^  devices_per_node: 2/  devices_per_node: 1/' -e 's/^  tp: 2/  tp: 1/' \
    -e "s#^  device: .*#  device: { file: $dir/one.json }#" "$dir/tp2.yaml" >"$dir/tp1.yaml"

all="mlp gpipe 1f1b gpt-tiny mlp-1f1b resnet cnn tp1 tp2"
# the specs on the two-worker file, the one `--measured` calibrates
two="gpipe 1f1b gpt-tiny mlp-1f1b resnet cnn tp2"
# each run's "step time: measured A UNIT ..., predicted B UNIT" line, in seconds; $1: the
# spec files' prefix, then the specs' names
steps() {
    prefix=$1
    shift
    for name in "$@"; do
        for _ in $(seq "$runs"); do
            "$pipec" run "$dir/$prefix$name.yaml" --steps 10 -o "$dir/out" 2>&1 | grep '^step time:' | sed "s/^/$name /"
        done
    done
}

report() {
    python3 - "$1" <<'PY'
import re, statistics, sys
unit = {"s": 1.0, "ms": 1e-3, "µs": 1e-6, "us": 1e-6, "ns": 1e-9}
runs = {}
for line in open(sys.argv[1], encoding="utf-8"):
    m = re.match(r"(\S+) step time: measured ([\d.]+) (\S+) .*predicted ([\d.]+) (\S+?);", line)
    if m:
        name, a, ua, b, ub = m.groups()
        runs.setdefault(name, []).append((float(a) * unit[ua], float(b) * unit[ub]))
print(f"{'spec':10} {'predicted':>12} {'measured (median)':>18} {'measured / predicted':>21}   runs")
for name, rs in runs.items():
    measured = statistics.median(r[0] for r in rs)
    predicted = rs[0][1]
    each = ", ".join(f"{r[0] * 1e3:.2f}" for r in rs)
    print(f"{name:10} {predicted * 1e3:9.2f} ms {measured * 1e3:15.2f} ms {measured / predicted:21.3f}   {each} ms")
if "tp1" in runs and "tp2" in runs:
    med = lambda n: statistics.median(r[0] for r in runs[n])
    measured, predicted = med("tp2") / med("tp1"), runs["tp2"][0][1] / runs["tp1"][0][1]
    print(f"tp 2 / tp 1: measured {measured:.3f}, predicted {predicted:.3f} ({abs(measured / predicted - 1) * 100:.1f}% off)")
PY
}

steps "" $all >"$dir/steps.txt"
echo "after \`pipec calibrate\`:"
report "$dir/steps.txt"

# pipec's executor fitted to one measured run of one spec (its metrics.jsonl), the others
# predicted with the file it writes
"$pipec" run "$dir/$measured_on.yaml" --steps 30 -o "$dir/measured" >/dev/null 2>&1
if ! "$pipec" calibrate --measured "$dir/$measured_on.yaml" --log "$dir/measured/metrics.jsonl" -o "$dir/engine.json"; then
    echo "\`pipec calibrate --measured\` on $measured_on found no fit (above)"
    exit 0
fi
for name in $two; do
    sed -e "s#^name: \(.*\)#name: \1\nengine: { name: pipec, calibration: $dir/engine.json }#" "$dir/$name.yaml" >"$dir/cal-$name.yaml"
done
steps cal- $two >"$dir/steps-measured.txt"
echo "after \`pipec calibrate --measured\` on one run of $measured_on:"
report "$dir/steps-measured.txt"

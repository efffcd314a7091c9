#!/usr/bin/env bash
# Predicted against measured CPU steps after `pipec calibrate` (docs/benchmarks.md, "CPU
# steps after calibration"): calibrates this machine one worker at a time, two at once and
# four at once, points the benchmark specs and every CPU example spec at the device file of
# their worker count and runs them in RUNS rounds, each
# round every spec once in turn (a machine whose speed drifts slows every spec alike), and
# prints each spec's median measured step beside its prediction, then tensor parallelism 2
# against 1; then `pipec calibrate --measured` on the log of MEASURED's (default 1f1b)
# median run of those rounds, and the two-worker specs' same medians against the
# predictions with the engine file it writes. Usage:
# scripts/cpu-fidelity.sh [PIPEC] [RUNS] [MEASURED] (a release build; default
# target/release/pipec, 5 rounds). Writes nothing outside a temporary directory.
set -euo pipefail
cd "$(dirname "$0")/.."
pipec=${1:-${CARGO_TARGET_DIR:-target}/release/pipec}
runs=${2:-5}
measured_on=${3:-1f1b}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
ln -s "$PWD/specs/data" "$dir/data"

echo "calibrating (one worker, then two and four at once)..." >&2
"$pipec" calibrate -o "$dir/one.json" >"$dir/one.log" 2>&1
"$pipec" calibrate --concurrent 2 -o "$dir/two.json" >"$dir/two.log" 2>&1
"$pipec" calibrate --concurrent 4 -o "$dir/four.json" >"$dir/four.log" 2>&1

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

# the other CPU example specs, each on the file of its worker count
for name in llama-tiny transformer resnet-images csv-classifier; do
    spec "specs/$name.yaml" "$name" "$dir/two.json" "{ file: $dir/two.json }"
done
for name in data-parallel moe-tiny; do
    spec "specs/$name.yaml" "$name" "$dir/four.json" "{ file: $dir/four.json }"
done

examples="llama-tiny transformer resnet-images csv-classifier"
all="mlp gpipe 1f1b gpt-tiny mlp-1f1b resnet cnn tp1 tp2 $examples data-parallel moe-tiny"
# the specs on the two-worker file, the one `--measured` calibrates
two="gpipe 1f1b gpt-tiny mlp-1f1b resnet cnn tp2 $examples"
# RUNS rounds of every spec named, one `pipec run --steps 10` each; each run's "step time:
# measured A UNIT ..., predicted B UNIT" line, prefixed with the spec's name, its round and
# its log (metrics.jsonl); $1: the spec files' prefix, then the specs' names
rounds() {
    prefix=$1
    shift
    for round in $(seq "$runs"); do
        for name in "$@"; do
            out="$dir/out/$prefix$name-$round"
            "$pipec" run "$dir/$prefix$name.yaml" --steps 10 -o "$out" 2>&1 | grep '^step time:' | sed "s#^#$name $out/metrics.jsonl #"
        done
    done
}

# the rounds' lines of a file (one spec's runs each: measured, predicted seconds, log): with
# one argument the table of each spec's median measured step against its prediction, with
# a spec's name too the log of that spec's median run
cat >"$dir/steps.py" <<'PY'
import re, statistics, sys
unit = {"s": 1.0, "ms": 1e-3, "µs": 1e-6, "us": 1e-6, "ns": 1e-9}
runs = {}
for line in open(sys.argv[1], encoding="utf-8"):
    m = re.match(r"(\S+) (\S+) step time: measured ([\d.]+) (\S+) .*predicted ([\d.]+) (\S+?);", line)
    if m:
        name, log, a, ua, b, ub = m.groups()
        runs.setdefault(name, []).append((float(a) * unit[ua], float(b) * unit[ub], log))
if len(sys.argv) > 2:
    rs = sorted(runs.get(sys.argv[2], []))
    print(rs[(len(rs) - 1) // 2][2] if rs else "")
    sys.exit()
print(f"{'spec':15} {'predicted':>12} {'measured (median)':>18} {'measured / predicted':>21}   runs")
for name, rs in runs.items():
    measured = statistics.median(r[0] for r in rs)
    predicted = rs[0][1]
    each = ", ".join(f"{r[0] * 1e3:.2f}" for r in rs)
    print(f"{name:15} {predicted * 1e3:9.2f} ms {measured * 1e3:15.2f} ms {measured / predicted:21.3f}   {each} ms")
if "tp1" in runs and "tp2" in runs:
    med = lambda n: statistics.median(r[0] for r in runs[n])
    measured, predicted = med("tp2") / med("tp1"), runs["tp2"][0][1] / runs["tp1"][0][1]
    print(f"tp 2 / tp 1: measured {measured:.3f}, predicted {predicted:.3f} ({abs(measured / predicted - 1) * 100:.1f}% off)")
PY
report() {
    python3 "$dir/steps.py" "$1"
}

rounds "" $all >"$dir/steps.txt"
echo "after \`pipec calibrate\`:"
report "$dir/steps.txt"

# pipec's executor fitted to MEASURED's median run of the rounds (its metrics.jsonl), the
# others' medians of the same rounds against the predictions with the file it writes
log=$(python3 "$dir/steps.py" "$dir/steps.txt" "$measured_on")
if [ -z "$log" ]; then
    echo "no run of $measured_on to calibrate on"
    exit 1
fi
if ! "$pipec" calibrate --measured "$dir/$measured_on.yaml" --log "$log" -o "$dir/engine.json"; then
    echo "\`pipec calibrate --measured\` on $measured_on found no fit (above)"
    exit 0
fi
# the predictions with the engine file: one short run each (the measured steps are the rounds')
for name in $two; do
    sed -e "s#^name: \(.*\)#name: \1\nengine: { name: pipec, calibration: $dir/engine.json }#" "$dir/$name.yaml" >"$dir/cal-$name.yaml"
    predicted=$("$pipec" run "$dir/cal-$name.yaml" --steps 2 -o "$dir/out/cal-$name" 2>&1 | grep '^step time:' | sed -e 's/.*predicted \([^;]*\);.*/\1/')
    grep "^$name " "$dir/steps.txt" | sed -e "s/predicted [^;]*;/predicted $predicted;/"
done >"$dir/steps-measured.txt"
echo "after \`pipec calibrate --measured\` on the median of $runs runs of $measured_on:"
report "$dir/steps-measured.txt"

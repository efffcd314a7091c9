#!/usr/bin/env bash
# Runs every test of pipec. Installs what the tests need on a fresh machine first.
# Usage: bash scripts/test.sh            (CI runs exactly this through .ci/run)
set -euo pipefail
cd "$(dirname "$0")/.."

# The build directory: $CARGO_TARGET_DIR when set; else one outside the clone when there is
# one (CI starts from a fresh clone each time and may keep ~/.cache/pipec-target); else the
# clone's own target/, the directory README's first command builds into.
if [ -z "${CARGO_TARGET_DIR:-}" ]; then
  if [ -d "$HOME/.cache/pipec-target" ]; then CARGO_TARGET_DIR="$HOME/.cache/pipec-target"; else CARGO_TARGET_DIR="$PWD/target"; fi
fi
export CARGO_TARGET_DIR
mkdir -p "$CARGO_TARGET_DIR"
export CARGO_TERM_COLOR=never

if ! command -v cargo-nextest >/dev/null 2>&1 && ! cargo nextest --version >/dev/null 2>&1; then
  cargo install cargo-nextest --locked
fi

# Debian packages: Open MPI and clang (bindgen) for the `mpi` feature's tests, iproute2 for
# the two-host test's network namespaces, python3-venv for the PyPI tools below, Mesa's
# software Vulkan driver and the Vulkan loader for the `wgpu` feature's tests (tests/cubecl.rs:
# the CubeCL path a GPU runs, on the CPU).
if ! command -v mpirun >/dev/null 2>&1 || ! command -v ip >/dev/null 2>&1 \
  || ! dpkg -s libopenmpi-dev libclang-dev clang mesa-vulkan-drivers libvulkan1 >/dev/null 2>&1 \
  || ! python3 -c "import ensurepip" >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q libopenmpi-dev openmpi-bin clang libclang-dev iproute2 python3-venv \
    mesa-vulkan-drivers libvulkan1
fi

# the features of every build below, so that nothing compiles twice: MPI, and Burn's wgpu
# backend for tests/cubecl.rs, and NCCL's loader and start (the release binary has none unless asked)
FEATURES=mpi,wgpu,nccl

echo "== formatting and lints"
if ! cargo fmt --version >/dev/null 2>&1 || ! cargo clippy --version >/dev/null 2>&1; then
  rustup component add rustfmt clippy
fi
cargo fmt --all --check
(cd fuzz && cargo fmt --all --check)
cargo clippy --workspace --all-targets --features "$FEATURES" -- -D warnings
# the fuzz targets type-check: `cargo fuzz` builds them apart from the workspace, so nothing
# else notices one left behind by a change of the crates' interfaces
(cd fuzz && cargo check --bins)

echo "== build"
cargo build --workspace --all-targets --features "$FEATURES"

echo "== tests"
cargo nextest run --workspace --features "$FEATURES" --no-fail-fast

echo "== cuda feature type-checks, with MPI and NCCL (no GPU needed)"
cargo check -p pipec --features cuda,mpi,nccl

echo "== the GPU check, dry (CPU only): proves scripts/gpu-check.sh end to end"
GPU_CHECK_DIR="$(mktemp -d)"
OUT="$GPU_CHECK_DIR/gpu-check" bash scripts/gpu-check.sh run --dry --bin "$CARGO_TARGET_DIR/debug/pipec"
# it says why it skipped the MPI ranks: the dry run, not a missing mpirun or MPI build
grep -q "skip mpi: a dry run on the CPU runs no CUDA ranks" "$GPU_CHECK_DIR"/gpu-check/*equality.txt
rm -rf "$GPU_CHECK_DIR"

echo "== example specs check clean, plan-level rules included (the published configurations that do not fit an 80 GB GPU, *-none, say so with E0601)"
PIPEC="$CARGO_TARGET_DIR/debug/pipec"
"$PIPEC" check specs/*.yaml bench/specs/*.yaml bench/specs/gpu/*.yaml bench/specs/megatron/*.yaml $(ls bench/specs/published/*.yaml | grep -v -- '-none\.yaml$') \
  $(awk -F, '$6 == "yes" { print "bench/specs/published-2025/" $1 }' bench/specs/published-2025/runs.csv)
for f in bench/specs/published/*-none.yaml; do
  out="$("$PIPEC" check "$f" --format json || true)"
  grep -q '"code":"E0601"' <<<"$out" || { echo "$f: expected E0601 (it does not fit)" >&2; exit 1; }
done

# PyPI packages in a virtual environment outside the clone (pinned below)
VENV="${PIPEC_VENV:-$HOME/.cache/pipec-venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -c "import pytest_lsp, pytest_asyncio, jsonschema, yaml" 2>/dev/null \
  || "$VENV/bin/pip" install -q "pytest-lsp==1.0.1" "pytest-asyncio>=1,<2" "jsonschema>=4.23,<5" "PyYAML>=6,<7"

echo "== language server driven by an independent client (pytest-lsp)"
PIPEC_BIN="$CARGO_TARGET_DIR/debug/pipec" "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/lsp

echo "== the committed JSON Schema against the specs (an independent validator: jsonschema, draft 2020-12)"
"$VENV/bin/python" scripts/validate-schema.py schema/pipec.schema.json specs/*.yaml bench/specs/*.yaml bench/specs/gpu/*.yaml bench/specs/published/*.yaml bench/specs/published-2025/*.yaml bench/specs/megatron/*.yaml
"$VENV/bin/python" scripts/validate-schema.py --reject schema/pipec.schema.json specs/invalid/unknown-key-strategy.yaml

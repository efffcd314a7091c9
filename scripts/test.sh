#!/usr/bin/env bash
# Runs every test of pipec. Installs what the tests need on a fresh machine first.
# Usage: bash scripts/test.sh            (CI runs exactly this through .ci/run)
set -euo pipefail
cd "$(dirname "$0")/.."

# Reuse a build directory outside the clone when there is one (CI starts from a fresh clone
# each time); a fresh machine simply builds into it.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/pipec-target}"
mkdir -p "$CARGO_TARGET_DIR"
export CARGO_TERM_COLOR=never

if ! command -v cargo-nextest >/dev/null 2>&1 && ! cargo nextest --version >/dev/null 2>&1; then
  cargo install cargo-nextest --locked
fi

echo "== build"
cargo build --workspace --all-targets

echo "== tests"
cargo nextest run --workspace --no-fail-fast

echo "== cuda feature type-checks (no GPU needed)"
cargo check -p pipec-executor --features cuda

echo "== example specs check clean"
"$CARGO_TARGET_DIR/debug/pipec" check specs/*.yaml

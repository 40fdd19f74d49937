#!/usr/bin/env bash
# The whole test suite, as CI runs it: set-up, formatting, lints, the static
# guest agent, then every test of the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '==> %s\n' "$*" >&2; }
start=$SECONDS

scripts/setup.sh

log "cargo fmt --check"
cargo fmt --all -- --check

log "cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings

log "building the static guest agent"
AGENTENV_GUEST_BIN="$(agentenv-guest/build-static.sh)"
export AGENTENV_GUEST_BIN

log "building tests"
cargo nextest run --workspace --locked --no-run

log "running tests"
cargo nextest run --workspace --locked --no-fail-fast

log "running doc tests"
cargo test --workspace --locked --doc

log "all tests passed in $((SECONDS - start)) s"

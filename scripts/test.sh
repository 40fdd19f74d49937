#!/usr/bin/env bash
# The whole test suite, as CI runs it: set-up, formatting, lints, the static
# guest agent, then every test of the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '==> %s\n' "$*" >&2; }
start=$SECONDS

# A CI checkout is built once: incremental state would only cost disk there.
if [ -n "${CI:-}" ]; then
  export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
fi

scripts/setup.sh

log "cargo fmt --check"
cargo fmt --all -- --check

log "cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings

log "building the static guest agent"
AGENTENV_GUEST_BIN="$(agentenv-guest/build-static.sh)"
export AGENTENV_GUEST_BIN

log "building the static attacker of the attack suite"
AGENTENV_ATTACK_BIN="$(agentenv-attack/build-static.sh)"
export AGENTENV_ATTACK_BIN

log "building the static VMM (the node runs it jailed)"
AGENTENV_VMM_BIN="$(agentenv-vmm/build-static.sh)"
export AGENTENV_VMM_BIN

log "building tests"
cargo nextest run --workspace --locked --no-run

log "running tests"
cargo nextest run --workspace --locked --no-fail-fast --profile ci

# A test that cannot run here says SKIPPED and passes; on a machine set up by
# scripts/setup.sh as root nothing may be skipped. (nextest keeps its report
# under the workspace's target/nextest, whatever CARGO_TARGET_DIR says.)
report=target/nextest/ci/junit.xml
if [ ! -s "$report" ]; then
  echo "no test report at $report: cannot tell whether tests were skipped" >&2
  exit 1
fi
skipped="$(grep -o 'SKIPPED[^&<]*' "$report" | sort -u || true)"
if [ -n "$skipped" ]; then
  echo "tests were skipped instead of run:" >&2
  echo "$skipped" >&2
  exit 1
fi

# The one kind of test that may not run here: booting a Linux guest needs real
# KVM, which these machines lack. Such tests say "NOT RUN HERE: <why>"; list them.
not_run="$(grep -o 'NOT RUN HERE:[^&<]*' "$report" | sort -u || true)"
if [ -n "$not_run" ]; then
  echo "tests that need hardware this machine lacks:" >&2
  echo "$not_run" >&2
fi

log "running doc tests"
cargo test --workspace --locked --doc

log "all tests passed in $((SECONDS - start)) s"

#!/usr/bin/env bash
# The first command to run: installs missing Debian packages, builds the release
# binaries and the static guest agent, installs the `aenv` CLI into /usr/local/bin, and
# starts a local cluster (a scheduler, a gateway and two runtime nodes) with `agentenv up`. Flags are passed to `agentenv up`,
# e.g. `scripts/up.sh --nodes 3 --listen 127.0.0.1:8081`. Ctrl-C stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" -ne 0 ]; then
  echo "up.sh: sandboxes run in jails (namespaces, cgroups, veth, iptables), which need root: run 'sudo $0 $*'" >&2
  exit 1
fi

log() { printf '==> %s\n' "$*" >&2; }

log "checking Debian packages (scripts/setup.sh)"
scripts/setup.sh

log "building agentenv, agentenv-scheduler, agentenv-gateway, agentenv-node, aenv (release)"
cargo build --release -p agentenv-bin \
  --bin agentenv --bin agentenv-scheduler --bin agentenv-gateway --bin agentenv-node --bin aenv >&2

log "building the static guest agent"
guest="$(agentenv-guest/build-static.sh)"

target="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"

# The CLI the banner points at: on the PATH, replaced by each run's build.
bindir="${AENV_CLI_DIR:-/usr/local/bin}"
log "installing aenv into $bindir (AENV_CLI_DIR chooses another directory)"
install -D -m 0755 "$target/release/aenv" "$bindir/aenv"
exec "$target/release/agentenv" up --bin-dir "$target/release" --guest-binary "$guest" "$@"

#!/usr/bin/env bash
# Builds agentenv-guest as a statically linked binary (the agent never calls NSS, it
# reads /etc/passwd and /etc/group itself), so it runs in any root filesystem. Prints
# the path of the binary: <target dir>/<target>/release/agentenv-guest.
set -euo pipefail
export AGENTENV_STATIC_TARGET="${AGENTENV_GUEST_TARGET:-${AGENTENV_STATIC_TARGET:-}}"
[ -n "$AGENTENV_STATIC_TARGET" ] || unset AGENTENV_STATIC_TARGET
exec "$(dirname "$0")/../scripts/build-static.sh" agentenv-guest agentenv-guest

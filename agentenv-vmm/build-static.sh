#!/usr/bin/env bash
# Builds agentenv-vmm as a statically linked binary: the node runs each VMM jailed in a
# directory that holds only its kernel, disk and sockets, where no shared library is
# found. Prints the path of the binary: <target dir>/<target>/release/agentenv-vmm.
set -euo pipefail
exec "$(dirname "$0")/../scripts/build-static.sh" agentenv-vmm agentenv-vmm

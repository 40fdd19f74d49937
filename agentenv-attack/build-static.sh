#!/usr/bin/env bash
# Builds sandbox-attack (the attacker of the attack suite) as a statically linked binary,
# so it runs inside any sandbox's root filesystem. Prints the path of the binary:
# <target dir>/<target>/release/sandbox-attack.
set -euo pipefail
exec "$(dirname "$0")/../scripts/build-static.sh" agentenv-attack sandbox-attack

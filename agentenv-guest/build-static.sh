#!/usr/bin/env bash
# Builds agentenv-guest as a statically linked binary (glibc with crt-static;
# the agent never calls NSS, it reads /etc/passwd and /etc/group itself), so
# it runs in any root filesystem. Prints the path of the binary.
#
# The explicit --target keeps RUSTFLAGS away from build scripts and proc
# macros, which must stay dynamically linked. Output goes to the shared
# target dir: target/x86_64-unknown-linux-gnu/release/agentenv-guest.
set -euo pipefail
cd "$(dirname "$0")/.."
target="${AGENTENV_GUEST_TARGET:-$(rustc -vV | sed -n 's/^host: //p')}"
case "$target" in
  *-linux-gnu) ;;
  *-linux-musl) ;;
  *) echo "build-static.sh: unsupported target $target (want *-linux-gnu or *-linux-musl)" >&2; exit 1 ;;
esac
RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+crt-static" \
  cargo build --release -p agentenv-guest --bin agentenv-guest --target "$target" >&2
bin="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/$target/release/agentenv-guest"
if ! file "$bin" | grep -q 'statically linked\|static-pie linked'; then
  echo "build-static.sh: $bin is not statically linked:" >&2
  file "$bin" >&2
  exit 1
fi
echo "$bin"

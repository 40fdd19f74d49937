#!/usr/bin/env bash
# Builds one binary of the workspace statically linked (glibc with crt-static; our
# programs that run inside sandboxes or jails never call NSS), so it runs in any root
# filesystem or in a jail that holds nothing else. Prints the path of the binary.
#
#   scripts/build-static.sh <package> <binary>
#
# The explicit --target keeps RUSTFLAGS away from build scripts and proc macros, which
# must stay dynamically linked. Output goes to cargo's target directory:
# <target dir>/<target>/release/<binary>. AGENTENV_STATIC_TARGET picks another target
# (*-linux-gnu or *-linux-musl).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -ne 2 ]; then
  echo "usage: scripts/build-static.sh <package> <binary>" >&2
  exit 2
fi
package="$1"
binary="$2"
target="${AGENTENV_STATIC_TARGET:-$(rustc -vV | sed -n 's/^host: //p')}"
case "$target" in
  *-linux-gnu) ;;
  *-linux-musl) ;;
  *) echo "build-static.sh: unsupported target $target (want *-linux-gnu or *-linux-musl)" >&2; exit 1 ;;
esac
RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+crt-static" \
  cargo build --release -p "$package" --bin "$binary" --target "$target" >&2
bin="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/$target/release/$binary"
if ! file "$bin" | grep -q 'statically linked\|static-pie linked'; then
  echo "build-static.sh: $bin is not statically linked:" >&2
  file "$bin" >&2
  exit 1
fi
echo "$bin"

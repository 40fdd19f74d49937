#!/usr/bin/env bash
# Builds the agentenv-vmm guest kernel (vmlinux and bzImage) from Debian's linux-source-6.1
# with the fragment kernel.config next to this script, once per machine: the result is
# cached under /var/cache/agentenv/guest-kernel/<hash of the fragment and the source>/ and
# reused while neither changes. Prints the directory holding vmlinux and bzImage last.
#
#   agentenv-vmm/guest/build-kernel.sh            # build (or reuse) and print the directory
#   AENV_GUEST_KERNEL_CACHE=/x build-kernel.sh    # another cache root
#   JOBS=4 build-kernel.sh                        # parallel make jobs (default: nproc)
#   build-kernel.sh --check-config                # only check that the fragment holds
#                                                 # after olddefconfig (a minute; no build)
#
# Takes about 15 minutes on 2 cores. Needs root for apt-get when packages are missing.
set -euo pipefail

check_only=0
case "${1:-}" in
    --check-config) check_only=1 ;;
    "") ;;
    *) echo "usage: $0 [--check-config]" >&2; exit 2 ;;
esac
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
fragment="$here/kernel.config"
cache_root=${AENV_GUEST_KERNEL_CACHE:-/var/cache/agentenv/guest-kernel}
jobs=${JOBS:-$(nproc)}
src_tar=/usr/src/linux-source-6.1.tar.xz

say() { printf 'build-kernel: %s\n' "$*" >&2; }

need=()
[ -f "$src_tar" ] || need+=(linux-source-6.1)
for tool in bc flex bison make gcc; do
    command -v "$tool" >/dev/null 2>&1 || need+=("$tool")
done
dpkg -s libelf-dev >/dev/null 2>&1 || need+=(libelf-dev)
dpkg -s libssl-dev >/dev/null 2>&1 || need+=(libssl-dev)
if [ ${#need[@]} -gt 0 ]; then
    # gcc and make come with build-essential.
    pkgs=()
    for p in "${need[@]}"; do
        case "$p" in gcc|make) pkgs+=(build-essential) ;; *) pkgs+=("$p") ;; esac
    done
    say "installing ${pkgs[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${pkgs[@]}" >/dev/null
fi

src_version=$(dpkg-query -W -f='${Version}' linux-source-6.1 2>/dev/null || echo unknown)
key=$( (cat "$fragment"; echo "$src_version") | sha256sum | cut -c1-16)
out="$cache_root/$key"
if [ "$check_only" = 0 ] && [ -f "$out/vmlinux" ] && [ -f "$out/bzImage" ]; then
    say "cached: $out"
    echo "$out"
    exit 0
fi

mkdir -p "$cache_root"
work=$(mktemp -d "$cache_root/.build-XXXXXX")
trap 'rm -rf "$work"' EXIT
say "unpacking $src_tar ($src_version)"
tar -xf "$src_tar" -C "$work"
tree=$(find "$work" -maxdepth 1 -mindepth 1 -type d -name 'linux-source-*' | head -n1)
cd "$tree"
say "configuring: tinyconfig + $(basename "$fragment")"
make -s tinyconfig >&2
./scripts/kconfig/merge_config.sh -m .config "$fragment" >/dev/null
make -s olddefconfig >&2
# Every option of the fragment must have survived olddefconfig (a dependency missing in
# the fragment silently drops an option otherwise).
missing=0
while IFS= read -r line; do
    case "$line" in
        CONFIG_*=*)
            grep -qx "$line" .config || { say "option lost: $line"; missing=1; } ;;
        "# CONFIG_"*" is not set")
            opt=${line#\# }; opt=${opt%% *}
            if grep -q "^$opt=" .config; then say "option still set: $opt"; missing=1; fi ;;
    esac
done < "$fragment"
[ "$missing" = 0 ] || { say "the fragment does not hold with this source: fix kernel.config"; exit 1; }
if [ "$check_only" = 1 ]; then
    say "every option of $(basename "$fragment") holds after olddefconfig"
    exit 0
fi
say "building with $jobs jobs (about 15 minutes on 2 cores)"
start=$(date +%s)
make -j"$jobs" vmlinux bzImage 2>&1 | grep --line-buffered -E '^  (LD|OBJCOPY|BUILD)|error' >&2 || true
[ -f vmlinux ] && [ -f arch/x86/boot/bzImage ] || { say "the build failed"; exit 1; }
say "built in $(( $(date +%s) - start )) s"
staging="$cache_root/.stage-$key-$$"
mkdir -p "$staging"
cp vmlinux "$staging/vmlinux"
cp arch/x86/boot/bzImage "$staging/bzImage"
cp .config "$staging/config"
rm -rf "$out"
mv "$staging" "$out"
say "done: $out"
echo "$out"

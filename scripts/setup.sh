#!/usr/bin/env bash
# Installs what a fresh machine lacks to build and test AgentENV: the Debian
# packages listed in scripts/apt-packages.txt and cargo-nextest. Safe to run
# again: it installs only what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '==> %s\n' "$*" >&2; }

missing=()
while read -r pkg; do
  pkg="${pkg%%#*}"
  pkg="$(echo "$pkg" | xargs)"
  [ -n "$pkg" ] || continue
  # Node.js from other sources (NodeSource) bundles npm and conflicts with Debian's.
  if [ "$pkg" = npm ] && command -v npm >/dev/null 2>&1; then
    continue
  fi
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$pkg")
  fi
done < scripts/apt-packages.txt

if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: missing Debian packages: ${missing[*]}; run this script as root (or install them) and retry" >&2
    exit 1
  fi
  log "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! cargo nextest --version >/dev/null 2>&1; then
  log "installing cargo-nextest"
  cargo install --locked cargo-nextest
fi

# The web console embeds npm packages (xterm.js) pinned by its lockfile; install
# them once here so builds need no registry. The stamp skips an unchanged lockfile.
console=agentenv-proxy/console
if ! cmp -s "$console/package-lock.json" "$console/node_modules/.agentenv-lock" 2>/dev/null; then
  log "installing the console's npm packages (npm ci --prefix $console)"
  npm ci --prefix "$console" --ignore-scripts --no-audit --no-fund >/dev/null
  cp "$console/package-lock.json" "$console/node_modules/.agentenv-lock"
fi

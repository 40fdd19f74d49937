#!/usr/bin/env bash
# Installs AgentENV on this host for a static multi-node deployment:
#   --role control-plane   agentenv-scheduler + agentenv-gateway (user agentenv-control)
#   --role runtime         agentenv-node as aenv.service + the static guest agent
#   --role all             both (a single-host cluster)
#
# It builds the binaries (or copies them from --bin-dir), creates the service user,
# the directories with their modes, the configs and the systemd units. The API key and
# the sandbox access-token seed are taken from AENV_API_KEY and
# AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED when set, generated only when absent, and an
# existing secret or config file is NEVER overwritten (re-running is safe; binaries and
# units are updated).
#
# Options:
#   --role ROLE              control-plane | runtime | all (required)
#   --bin-dir DIR            take agentenv-scheduler, agentenv-gateway, agentenv-node from DIR
#                            (default: build them with cargo from this checkout)
#   --guest-binary PATH      the static guest agent (default: agentenv-guest/build-static.sh)
#   --node-id ID             runtime: AENV_NODE_ID written into a new /etc/default/aenv
#                            (default: the host name)
#   --scheduler URL          runtime: heartbeat endpoint, e.g. http://10.0.0.10:9090
#   --root DIR               install into DIR instead of / (image building, tests); users
#                            are created in DIR/etc, systemctl is not called
#   --no-start               do not enable or start the services
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/.." && pwd)"

role=""; bin_dir=""; guest=""; node_id=""; scheduler=""; root=""; start=1
while [ $# -gt 0 ]; do
  case "$1" in
    --role) role="${2:-}"; shift 2 ;;
    --bin-dir) bin_dir="${2:-}"; shift 2 ;;
    --guest-binary) guest="${2:-}"; shift 2 ;;
    --node-id) node_id="${2:-}"; shift 2 ;;
    --scheduler) scheduler="${2:-}"; shift 2 ;;
    --root) root="${2:-}"; shift 2 ;;
    --no-start) start=0; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

die() { echo "install.sh: $*" >&2; exit 1; }
log() { printf '==> %s\n' "$*" >&2; }

case "$role" in
  control-plane|runtime|all) ;;
  "") die "--role is required: control-plane, runtime or all" ;;
  *) die "unknown --role $role: use control-plane, runtime or all" ;;
esac
[ "$(id -u)" -eq 0 ] || die "run as root (it creates users, /etc/agentenv and systemd units)"
if [ -n "$scheduler" ]; then
  case "$scheduler" in
    http://*|https://*) ;;
    *) die "--scheduler must be a URL with its scheme, e.g. http://10.0.0.10:9090 (heartbeats need http://; only the gateway's scheduler_addr is a plain host:port)" ;;
  esac
fi
if [ -n "$root" ]; then
  mkdir -p "$root"
  root="$(cd "$root" && pwd)"
fi
want_cp=0; want_rt=0
[ "$role" = runtime ] || want_cp=1
[ "$role" = control-plane ] || want_rt=1

# --- binaries ---------------------------------------------------------------------
bins=()
[ $want_cp = 1 ] && bins+=(agentenv-scheduler agentenv-gateway)
[ $want_rt = 1 ] && bins+=(agentenv-node)
if [ -z "$bin_dir" ]; then
  command -v cargo >/dev/null || die "cargo not found: install Rust, or pass --bin-dir with prebuilt binaries"
  log "building ${bins[*]} (release)"
  args=(); for b in "${bins[@]}"; do args+=(--bin "$b"); done
  (cd "$repo" && cargo build --release -p agentenv-bin "${args[@]}" >&2)
  bin_dir="$(cd "$repo" && cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/release"
fi
for b in "${bins[@]}"; do
  [ -x "$bin_dir/$b" ] || die "$bin_dir/$b is missing: build it with 'cargo build --release -p agentenv-bin --bins' or fix --bin-dir"
done
if [ $want_rt = 1 ] && [ -z "$guest" ]; then
  log "building the static guest agent"
  guest="$("$repo/agentenv-guest/build-static.sh")"
fi
# The microVM monitor, for AENV_BACKEND=microvm|auto: statically linked, since the node
# runs each VMM jailed in a directory that holds nothing else.
vmm=""
if [ $want_rt = 1 ]; then
  if [ -x "$bin_dir/agentenv-vmm" ] && ! file "$bin_dir/agentenv-vmm" | grep -q 'dynamically linked'; then
    vmm="$bin_dir/agentenv-vmm"
  elif command -v cargo >/dev/null; then
    log "building the static VMM"
    vmm="$("$repo/agentenv-vmm/build-static.sh")"
  fi
fi
if [ $want_rt = 1 ]; then
  [ -f "$guest" ] || die "guest agent $guest not found: build it with agentenv-guest/build-static.sh"
fi

install -d -m 0755 "$root/usr/local/bin"
for b in "${bins[@]}"; do
  install -m 0755 "$bin_dir/$b" "$root/usr/local/bin/$b"
  log "installed $root/usr/local/bin/$b"
done

# --- users ------------------------------------------------------------------------
prefix_args=()
[ -n "$root" ] && prefix_args=(--prefix "$root")
uid_of() { awk -F: -v u="$1" '$1==u{print $3}' "$root/etc/passwd"; }
gid_of() { awk -F: -v g="$1" '$1==g{print $3}' "$root/etc/group"; }
ensure_user() {
  local u="$1" home="$2"
  if [ -z "$(gid_of "$u")" ]; then
    groupadd "${prefix_args[@]}" --system "$u"
  fi
  if [ -z "$(uid_of "$u")" ]; then
    useradd "${prefix_args[@]}" --system --gid "$u" --no-create-home --home-dir "$home" \
      --shell /usr/sbin/nologin "$u"
    log "created system user $u"
  else
    log "system user $u exists"
  fi
}

# new_file PATH MODE OWNER GROUP: reads the content from stdin and writes PATH only if
# it does not exist yet. Returns 1 (and leaves PATH alone) if it exists.
new_file() {
  local path="$1" mode="$2" owner="$3" group="$4" tmp
  if [ -e "$path" ]; then
    log "kept existing $path"
    cat >/dev/null
    return 1
  fi
  # Called as `new_file ... || true`, where errexit is off: check every step.
  tmp="$(mktemp "$(dirname "$path")/.new.XXXXXX")" || die "cannot write in $(dirname "$path")"
  chmod 0600 "$tmp" || die "chmod $tmp failed"
  cat >"$tmp" || die "writing $tmp failed"
  chown "$owner:$group" "$tmp" || die "chown $tmp failed"
  chmod "$mode" "$tmp" || die "chmod $tmp failed"
  mv -n "$tmp" "$path" || die "cannot create $path"
  rm -f "$tmp"
  log "wrote $path"
}

random_hex() { od -An -tx1 -N32 /dev/urandom | tr -d ' \n'; }

# The shared API key: AENV_API_KEY, else the one already installed, else a new one.
existing_key=""
for f in "$root/etc/agentenv/auth.env" "$root/etc/default/aenv"; do
  if [ -z "$existing_key" ] && [ -f "$f" ]; then
    existing_key="$(sed -n 's/^AENV_API_KEY="\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$f" | head -1)"
  fi
done
api_key="${AENV_API_KEY:-${existing_key:-e2b_$(random_hex)}}"
case "$api_key" in
  *[!A-Za-z0-9._~-]*) die "the API key may contain only A-Z a-z 0-9 . _ ~ -" ;;
esac
[ ${#api_key} -ge 32 ] && [ ${#api_key} -le 256 ] || die "the API key must be 32 to 256 characters long"

install -d -m 0755 "$root/etc/systemd/system" "$root/usr/local/share/doc/agentenv"
for d in quickstart.md static-multi-node.md configuration.md troubleshooting.md; do
  [ -f "$repo/docs/$d" ] && install -m 0644 "$repo/docs/$d" "$root/usr/local/share/doc/agentenv/$d"
done

# --- control plane ------------------------------------------------------------------
if [ $want_cp = 1 ]; then
  ensure_user agentenv-control /nonexistent
  cg="$(gid_of agentenv-control)"
  install -d -o 0 -g "$cg" -m 0750 "$root/etc/agentenv"
  new_file "$root/etc/agentenv/control-plane.json" 0640 0 "$cg" <"$here/control-plane.json" || true
  printf 'AENV_API_KEY=%s\n' "$api_key" | new_file "$root/etc/agentenv/auth.env" 0640 0 "$cg" || true
  for u in agentenv-scheduler agentenv-gateway; do
    install -m 0644 "$here/systemd/$u.service" "$root/etc/systemd/system/$u.service"
  done
  install -m 0755 "$here/verify-cluster.sh" "$root/usr/local/bin/agentenv-verify-cluster"
fi

# --- runtime node -------------------------------------------------------------------
if [ $want_rt = 1 ]; then
  install -d -o 0 -g 0 -m 0750 "$root/var/lib/aenv" "$root/var/lib/aenv/bin" "$root/var/lib/aenv/templates"
  install -d -o 0 -g 0 -m 0700 "$root/var/lib/aenv/secrets"
  install -d -m 0755 "$root/etc/default"
  install -m 0755 "$guest" "$root/var/lib/aenv/bin/agentenv-guest"
  if [ -n "$vmm" ]; then
    install -m 0755 "$vmm" "$root/var/lib/aenv/bin/agentenv-vmm"
  else
    log "no static agentenv-vmm (build it with agentenv-vmm/build-static.sh): microVM sandboxes are unavailable on this node (the jail runs them)"
  fi
  seed="${AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED:-$(random_hex)}"
  id="${node_id:-$(hostname)}"
  {
    echo '# AgentENV runtime node (aenv.service). See /usr/local/share/doc/agentenv/configuration.md.'
    echo 'API_ADDR="0.0.0.0:8000"'
    echo "# Must equal this node's id in scheduler.nodes of the control-plane config."
    echo "AENV_NODE_ID=\"$id\""
    if [ -n "$scheduler" ]; then
      echo 'AENV_OBSERVABILITY_SCHEDULER_REPORT_ENABLED="true"'
      echo "AENV_OBSERVABILITY_SCHEDULER_ENDPOINT=\"$scheduler\""
    else
      echo '# Heartbeats: set both, with the http:// scheme, e.g. http://10.0.0.10:9090'
      echo 'AENV_OBSERVABILITY_SCHEDULER_REPORT_ENABLED="false"'
      echo '#AENV_OBSERVABILITY_SCHEDULER_ENDPOINT="http://10.0.0.10:9090"'
    fi
    echo '# Shared: the API key on the gateway and every node; the seed on every node only.'
    echo "AENV_API_KEY=\"$api_key\""
    echo "AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED=\"$seed\""
    echo 'AENV_HOME_PATH="/var/lib/aenv"'
    echo 'AENV_RUNTIME_PATH="/run/aenv"'
    echo 'AENV_GUEST_BINARY_PATH="/var/lib/aenv/bin/agentenv-guest"'
    echo 'AENV_BACKEND="jail"'
    echo '# The snapshot store every node shares (mount it first); unset: node-local.'
    echo '#AENV_SNAPSHOT_STORE="/mnt/aenv-snapshots"'
  } | new_file "$root/etc/default/aenv" 0600 0 0 || true
  install -m 0644 "$here/systemd/aenv.service" "$root/etc/systemd/system/aenv.service"
fi

# --- systemd ------------------------------------------------------------------------
units=()
[ $want_cp = 1 ] && units+=(agentenv-scheduler agentenv-gateway)
[ $want_rt = 1 ] && units+=(aenv)
if [ -z "$root" ] && [ -d /run/systemd/system ]; then
  systemctl daemon-reload
  if [ $start = 1 ]; then
    systemctl enable --now "${units[@]}"
    log "started ${units[*]}"
  fi
else
  log "systemd not running here (or --root): enable with 'systemctl enable --now ${units[*]}'"
fi

echo
echo "AgentENV installed (${role})."
[ $want_cp = 1 ] && echo "  control plane: edit /etc/agentenv/control-plane.json (scheduler.nodes), key in /etc/agentenv/auth.env"
[ $want_rt = 1 ] && echo "  runtime node:  /etc/default/aenv (AENV_NODE_ID=${node_id:-$(hostname)}), data in /var/lib/aenv"
echo "  The API key is the same everywhere; copy /etc/agentenv/auth.env's value to each node's /etc/default/aenv"
echo "  (or install each node with AENV_API_KEY and AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED set)."

#!/usr/bin/env bash
# Installs AgentENV on this host for a static multi-node deployment:
#   --role control-plane   agentenv-scheduler + agentenv-gateway (user agentenv-control)
#   --role runtime         agentenv-node as aenv.service + the static guest agent
#   --role all             both (a single-host cluster)
#
# It builds the binaries (or copies them from --bin-dir), creates the service user,
# the directories with their modes, the configs and the systemd units. Every listener
# other hosts reach serves TLS with the certificates of --tls-dir, and every link is
# mutual TLS; without --tls-dir the script refuses, unless --plain-http says that
# another layer encrypts. The API key, the sandbox access-token seed and the cluster
# credential (the token every gRPC call to the scheduler carries) are taken from
# AENV_API_KEY, AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED and AENV_CLUSTER_TOKEN when set,
# else from what is already installed, and generated only when absent; an existing
# secret, certificate or config file is NEVER overwritten (re-running is safe;
# binaries and units are updated).
#
# Options:
#   --role ROLE              control-plane | runtime | all (required)
#   --tls-dir DIR            the certificates, made with `agentenv certs` (see
#                            docs/static-multi-node.md): DIR/ca.pem, and for the control
#                            plane scheduler.pem, scheduler-key.pem, gateway.pem,
#                            gateway-key.pem, for a runtime node <node id>.pem and
#                            <node id>-key.pem. They are copied to /etc/agentenv/tls
#                            (control plane) and /etc/aenv/tls (node); ca-key.pem is not
#   --plain-http             no TLS anywhere (listeners and links in clear text): only on
#                            a private network where another layer (a VPN, WireGuard,
#                            IPsec) encrypts; the configs then say allow_plain_http
#   --bin-dir DIR            take agentenv-scheduler, agentenv-gateway, agentenv-node from DIR
#                            (default: build them with cargo from this checkout)
#   --guest-binary PATH      the static guest agent (default: agentenv-guest/build-static.sh)
#   --node-id ID             runtime: AENV_NODE_ID written into a new /etc/default/aenv
#                            (default: the host name); names its certificate in --tls-dir
#   --scheduler URL          runtime: heartbeat endpoint, e.g. https://10.0.0.10:9090
#                            (http:// with --plain-http)
#   --root DIR               install into DIR instead of / (image building, tests); users
#                            are created in DIR/etc, systemctl is not called
#   --no-start               do not enable or start the services
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/.." && pwd)"

role=""; bin_dir=""; guest=""; node_id=""; scheduler=""; root=""; start=1
tls_dir=""; plain=0
while [ $# -gt 0 ]; do
  case "$1" in
    --role) role="${2:-}"; shift 2 ;;
    --tls-dir) tls_dir="${2:-}"; shift 2 ;;
    --plain-http) plain=1; shift ;;
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
if [ -n "$scheduler" ]; then
  case "$scheduler" in
    http://*|https://*) ;;
    *) die "--scheduler must be a URL with its scheme: write https://$scheduler (http://$scheduler with --plain-http); only the gateway's scheduler_addr is a plain host:port" ;;
  esac
fi
# How the cluster's traffic is protected: an explicit choice.
if [ -n "$tls_dir" ] && [ $plain = 1 ]; then
  die "--tls-dir and --plain-http exclude each other: pass --tls-dir DIR for TLS everywhere, or --plain-http alone"
fi
if [ -z "$tls_dir" ] && [ $plain = 0 ]; then
  die "no TLS: pass --tls-dir DIR with the certificates made by 'agentenv certs ca' and 'agentenv certs issue' (docs/static-multi-node.md, step 1), or --plain-http to send API keys, sandbox tokens and the cluster credential in clear text because another layer (a VPN, WireGuard, IPsec) encrypts"
fi
case "$scheduler" in
  http://*) [ $plain = 1 ] || die "--scheduler $scheduler: the scheduler serves TLS, write https://${scheduler#http://} (http:// only with --plain-http)" ;;
  https://*) [ $plain = 0 ] || die "--scheduler $scheduler: with --plain-http the scheduler serves plain gRPC, write http://${scheduler#https://}" ;;
esac
[ "$(id -u)" -eq 0 ] || die "run as root (it creates users, /etc/agentenv and systemd units)"
if [ -n "$root" ]; then
  mkdir -p "$root"
  root="$(cd "$root" && pwd)"
fi
want_cp=0; want_rt=0
[ "$role" = runtime ] || want_cp=1
[ "$role" = control-plane ] || want_rt=1
id="${node_id:-$(hostname)}"

# --- certificates -------------------------------------------------------------------
# The files this host needs from --tls-dir: each certificate serves its listener and
# identifies its holder to the other end of a link (mutual TLS).
if [ -n "$tls_dir" ]; then
  [ -d "$tls_dir" ] || die "--tls-dir $tls_dir is not a directory: make the CA with 'agentenv certs ca --dir $tls_dir' and the certificates with 'agentenv certs issue --dir $tls_dir --name NAME --ip ADDRESS'"
  tls_dir="$(cd "$tls_dir" && pwd)"
  certs=()
  [ $want_cp = 1 ] && certs+=(scheduler gateway)
  [ $want_rt = 1 ] && certs+=("$id")
  [ -f "$tls_dir/ca.pem" ] || die "$tls_dir/ca.pem is missing: copy ca.pem from the directory of 'agentenv certs ca' (never ca-key.pem) into $tls_dir"
  for c in "${certs[@]}"; do
    for f in "$c.pem" "$c-key.pem"; do
      [ -f "$tls_dir/$f" ] || die "$tls_dir/$f is missing: on the CA's host run 'agentenv certs issue --dir <CA dir> --name $c --ip <this host's address>' and copy $c.pem and $c-key.pem with ca.pem into $tls_dir"
    done
  done
  # With openssl at hand, catch a certificate of another CA or a key of another
  # certificate now rather than at the first handshake.
  if command -v openssl >/dev/null; then
    for c in "${certs[@]}"; do
      openssl verify -CAfile "$tls_dir/ca.pem" "$tls_dir/$c.pem" >/dev/null 2>&1 \
        || die "$tls_dir/$c.pem is not signed by $tls_dir/ca.pem (or has expired): issue it again with 'agentenv certs issue --dir <CA dir> --name $c --ip <this host's address> --force' from the CA whose ca.pem you copied"
      [ "$(openssl x509 -noout -pubkey -in "$tls_dir/$c.pem" 2>/dev/null)" = "$(openssl pkey -pubout -in "$tls_dir/$c-key.pem" 2>/dev/null)" ] \
        || die "$tls_dir/$c-key.pem is not the key of $tls_dir/$c.pem: copy the two files that 'agentenv certs issue --name $c' wrote together"
    done
  else
    log "openssl not found: the certificates in $tls_dir are not checked before they are installed"
  fi
fi

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

# check_secret NAME VALUE: a shared secret is 32 to 256 characters of A-Z a-z 0-9 . _ ~ -
check_secret() {
  case "$2" in
    *[!A-Za-z0-9._~-]*) die "$1 may contain only A-Z a-z 0-9 . _ ~ -" ;;
  esac
  if [ ${#2} -lt 32 ] || [ ${#2} -gt 256 ]; then
    die "$1 must be 32 to 256 characters long"
  fi
}

# The shared API key: AENV_API_KEY, else the one already installed, else a new one.
existing_key=""
for f in "$root/etc/agentenv/auth.env" "$root/etc/default/aenv"; do
  if [ -z "$existing_key" ] && [ -f "$f" ]; then
    existing_key="$(sed -n 's/^AENV_API_KEY="\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$f" | head -1)"
  fi
done
api_key="${AENV_API_KEY:-${existing_key:-e2b_$(random_hex)}}"
check_secret "the API key" "$api_key"

# The cluster credential: AENV_CLUSTER_TOKEN, else the one already installed, else a
# new one. The scheduler checks it on every gRPC call; the gateway and the nodes send it.
cp_token_file=/etc/agentenv/cluster-token
rt_token_file=/etc/aenv/cluster-token
existing_token=""; existing_token_file=""
for f in "$cp_token_file" "$rt_token_file"; do
  if [ -z "$existing_token" ] && [ -f "$root$f" ]; then
    existing_token="$(head -n 1 "$root$f")"
    existing_token_file="$f"
  fi
done
token_origin=AENV_CLUSTER_TOKEN
if [ -n "${AENV_CLUSTER_TOKEN:-}" ]; then
  if [ -n "$existing_token" ] && [ "$AENV_CLUSTER_TOKEN" != "$existing_token" ]; then
    log "warning: AENV_CLUSTER_TOKEN differs from the token installed in $root$existing_token_file, which is kept; every host needs the same token"
  fi
elif [ -n "$existing_token" ]; then
  token_origin="$existing_token_file"
else
  token_origin=generated
fi
cluster_token="${AENV_CLUSTER_TOKEN:-${existing_token:-$(random_hex)}}"
check_secret "the cluster token (AENV_CLUSTER_TOKEN)" "$cluster_token"

# install_copy SRC DEST MODE GROUP: a copy of SRC (a certificate or a key) as DEST,
# owned by root:GROUP, unless DEST exists: an installed file is never replaced.
install_copy() {
  local src="$1" dest="$2" mode="$3" group="$4"
  if [ -e "$dest" ] && ! cmp -s "$src" "$dest"; then
    log "warning: $dest differs from $src and is kept; to renew it, copy the new file over it and restart the services that use it"
  fi
  new_file "$dest" "$mode" 0 "$group" <"$src" || true
}

if [ $plain = 1 ]; then
  log "warning: --plain-http: every listener other hosts reach serves plain HTTP or gRPC, so API keys, sandbox tokens and the cluster credential cross the network in clear text; use it only where another layer (a VPN, WireGuard, IPsec) encrypts"
fi

install -d -m 0755 "$root/etc/systemd/system" "$root/usr/local/share/doc/agentenv"
for d in quickstart.md static-multi-node.md configuration.md troubleshooting.md security.md; do
  [ -f "$repo/docs/$d" ] && install -m 0644 "$repo/docs/$d" "$root/usr/local/share/doc/agentenv/$d"
done

# --- control plane ------------------------------------------------------------------
if [ $want_cp = 1 ]; then
  ensure_user agentenv-control /nonexistent
  cg="$(gid_of agentenv-control)"
  install -d -o 0 -g "$cg" -m 0750 "$root/etc/agentenv"
  if [ -n "$tls_dir" ]; then
    # Readable by the services' user only: keys 0640 root:agentenv-control.
    install -d -o 0 -g "$cg" -m 0750 "$root/etc/agentenv/tls"
    install_copy "$tls_dir/ca.pem" "$root/etc/agentenv/tls/ca.pem" 0644 "$cg"
    for c in scheduler gateway; do
      install_copy "$tls_dir/$c.pem" "$root/etc/agentenv/tls/$c.pem" 0644 "$cg"
      install_copy "$tls_dir/$c-key.pem" "$root/etc/agentenv/tls/$c-key.pem" 0640 "$cg"
    done
    new_file "$root/etc/agentenv/control-plane.json" 0640 0 "$cg" <"$here/control-plane.json" || true
  elif [ -e "$root/etc/agentenv/control-plane.json" ]; then
    log "kept existing $root/etc/agentenv/control-plane.json"
  else
    # The same file without TLS: plain listeners and links, allowed explicitly.
    command -v python3 >/dev/null || die "python3 is needed to write control-plane.json for --plain-http (or install with --tls-dir)"
    plain_cfg="$(python3 - "$here/control-plane.json" <<'PY'
import json, sys

def with_allow(section, after):
    out = {}
    for k, v in section.items():
        if k in ("tls", "node_tls", "scheduler_tls"):
            continue
        out[k] = v
        if k == after:
            out["allow_plain_http"] = True
    return out

c = json.load(open(sys.argv[1]))
for n in c["scheduler"]["nodes"]:
    n["endpoint"] = n["endpoint"].replace("https://", "http://", 1)
c["scheduler"] = with_allow(c["scheduler"], "grpc_listen_addr")
c["gateway"] = with_allow(c["gateway"], "http_listen_addr")
print(json.dumps(c, indent=2))
PY
)" || die "could not write control-plane.json for --plain-http from $here/control-plane.json"
    printf '%s\n' "$plain_cfg" | new_file "$root/etc/agentenv/control-plane.json" 0640 0 "$cg" || true
  fi
  printf 'AENV_API_KEY=%s\n' "$api_key" | new_file "$root/etc/agentenv/auth.env" 0640 0 "$cg" || true
  printf '%s\n' "$cluster_token" | new_file "$root$cp_token_file" 0640 0 "$cg" || true
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
  # The node runs as root: its certificates, key and token are root's alone.
  install -d -o 0 -g 0 -m 0700 "$root/etc/aenv"
  if [ -n "$tls_dir" ]; then
    install -d -o 0 -g 0 -m 0700 "$root/etc/aenv/tls"
    install_copy "$tls_dir/ca.pem" "$root/etc/aenv/tls/ca.pem" 0644 0
    install_copy "$tls_dir/$id.pem" "$root/etc/aenv/tls/node.pem" 0644 0
    install_copy "$tls_dir/$id-key.pem" "$root/etc/aenv/tls/node-key.pem" 0600 0
  fi
  printf '%s\n' "$cluster_token" | new_file "$root$rt_token_file" 0600 0 0 || true
  install -m 0755 "$guest" "$root/var/lib/aenv/bin/agentenv-guest"
  if [ -n "$vmm" ]; then
    install -m 0755 "$vmm" "$root/var/lib/aenv/bin/agentenv-vmm"
  else
    log "no static agentenv-vmm (build it with agentenv-vmm/build-static.sh): microVM sandboxes are unavailable on this node (the jail runs them)"
  fi
  seed="${AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED:-$(random_hex)}"
  if [ $plain = 1 ]; then example_scheduler=http://10.0.0.10:9090; else example_scheduler=https://10.0.0.10:9090; fi
  {
    echo '# AgentENV runtime node (aenv.service). See /usr/local/share/doc/agentenv/configuration.md.'
    echo 'API_ADDR="0.0.0.0:8000"'
    if [ -n "$tls_dir" ]; then
      echo '# The API and data plane over TLS; clients (the gateway) present a certificate of the CA.'
      echo 'AENV_TLS_CERT_FILE="/etc/aenv/tls/node.pem"'
      echo 'AENV_TLS_KEY_FILE="/etc/aenv/tls/node-key.pem"'
      echo 'AENV_TLS_CLIENT_CA_FILE="/etc/aenv/tls/ca.pem"'
    else
      echo '# Plain HTTP on every interface (--plain-http): only where another layer encrypts.'
      echo 'AENV_ALLOW_PLAIN_HTTP="true"'
    fi
    echo "# Must equal this node's id in scheduler.nodes of the control-plane config."
    echo "AENV_NODE_ID=\"$id\""
    if [ -n "$scheduler" ]; then
      echo 'AENV_OBSERVABILITY_SCHEDULER_REPORT_ENABLED="true"'
      echo "AENV_OBSERVABILITY_SCHEDULER_ENDPOINT=\"$scheduler\""
    else
      echo "# Heartbeats: set both, with the scheme, e.g. $example_scheduler"
      echo 'AENV_OBSERVABILITY_SCHEDULER_REPORT_ENABLED="false"'
      echo "#AENV_OBSERVABILITY_SCHEDULER_ENDPOINT=\"$example_scheduler\""
    fi
    if [ -n "$tls_dir" ]; then
      echo "# The scheduler's CA, and this node's certificate as its client identity."
      echo 'AENV_SCHEDULER_CA_FILE="/etc/aenv/tls/ca.pem"'
      echo 'AENV_SCHEDULER_CLIENT_CERT_FILE="/etc/aenv/tls/node.pem"'
      echo 'AENV_SCHEDULER_CLIENT_KEY_FILE="/etc/aenv/tls/node-key.pem"'
    fi
    echo "# The cluster credential: the same token as the control plane's $cp_token_file."
    echo "AENV_CLUSTER_TOKEN_FILE=\"$rt_token_file\""
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

if [ $plain = 1 ]; then scheme=http; else scheme=https; fi
echo
echo "AgentENV installed (${role}$([ $plain = 1 ] && echo ', plain HTTP'))."
if [ $want_cp = 1 ]; then
  echo "  control plane: /etc/agentenv/control-plane.json (list every node in scheduler.nodes as"
  echo "                 {\"id\": \"<node id>\", \"endpoint\": \"$scheme://<its address>:8000\"}), API key in"
  echo "                 /etc/agentenv/auth.env, cluster token in $cp_token_file"
  [ -n "$tls_dir" ] && echo "                 certificates in /etc/agentenv/tls"
fi
if [ $want_rt = 1 ]; then
  echo "  runtime node:  /etc/default/aenv (AENV_NODE_ID=$id), cluster token in $rt_token_file, data in /var/lib/aenv"
  [ -n "$tls_dir" ] && echo "                 certificates in /etc/aenv/tls (node.pem is $id.pem)"
fi
echo "Every host needs the same API key and cluster token, every runtime node the same seed."
if [ $want_cp = 1 ]; then
  echo "For each runtime host:"
  if [ -n "$tls_dir" ]; then
    echo "  1. here: agentenv certs issue --dir <CA dir> --name <node id> --ip <its address>, then copy ca.pem,"
    echo "     <node id>.pem and <node id>-key.pem (never ca-key.pem) to a directory DIR there"
    echo "  2. there: install.sh --role runtime --tls-dir DIR --node-id <node id> --scheduler https://<this host>:9090"
  else
    echo "  there: install.sh --role runtime --plain-http --node-id <node id> --scheduler http://<this host>:9090"
  fi
  echo "     with the shared secrets in its environment (sudo -E), read here with"
  echo "       export AENV_API_KEY=\"\$(sudo sed -n 's/^AENV_API_KEY=//p' /etc/agentenv/auth.env)\""
  echo "       export AENV_CLUSTER_TOKEN=\"\$(sudo cat $cp_token_file)\""
  if [ $want_rt = 1 ]; then
    cat <<'EOS'
       export AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED="$(sudo sed -n 's/^AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED="\(.*\)"$/\1/p' /etc/default/aenv)"
EOS
  else
    echo "       export AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED=<one seed for every node>"
  fi
  if [ -n "$tls_dir" ]; then
    echo "Clients trust the cluster's CA: copy /etc/agentenv/tls/ca.pem to them and set SSL_CERT_FILE to it;"
    echo "the gateway is https://<this host>:8080."
  fi
  echo "Then check every hop: sudo agentenv-verify-cluster"
fi
if [ $want_cp = 0 ]; then
  echo "List it in the control plane's scheduler.nodes as"
  echo "  {\"id\": \"$id\", \"endpoint\": \"$scheme://<this host's address>:8000\"} and restart agentenv-scheduler there."
fi
if [ $plain = 1 ]; then
  echo "WARNING: --plain-http: keys, tokens and the cluster credential cross the network in clear text;"
  echo "  keep every port on a network that another layer encrypts, or re-install with --tls-dir."
fi
if [ "$token_origin" = generated ] && [ $want_cp = 0 ]; then
  echo "WARNING: AENV_CLUSTER_TOKEN was not set, so this host generated a cluster token of its own, which the"
  echo "  scheduler refuses: copy the control plane's $cp_token_file to $rt_token_file here (mode 0600), then"
  echo "  systemctl restart aenv"
fi

#!/usr/bin/env bash
# Checks a static multi-node cluster from the control-plane host, hop by hop, the way
# docs/static-multi-node.md "Verify the cluster" does by hand, and says what to fix:
#   1. every node in scheduler.nodes answers /health at its endpoint (over TLS for an
#      https:// endpoint, trusting gateway.node_tls.ca_file and presenting the gateway's
#      client certificate, gateway.node_tls.cert_file, as the gateway does);
#   2. every node accepts the shared API key (a node with another key is named);
#   3. the gateway answers /health;
#   4. the gateway's /nodes lists every configured node as ready (or draining).
# Exit status 0 when all checks pass, 1 otherwise. Run it with sudo: the key, the
# client certificate's key and the config are readable by root and agentenv-control.
#
# Options (defaults are the installed paths):
#   --config PATH    control-plane JSON (/etc/agentenv/control-plane.json)
#   --auth PATH      file with AENV_API_KEY=... (/etc/agentenv/auth.env); AENV_API_KEY wins
#   --gateway URL    the gateway as seen from here (default from the config:
#                    https://127.0.0.1:8080 with gateway.tls, else http://127.0.0.1:8080)
#   --cacert PATH    the CA the gateway's certificate chains to (default: the config's
#                    gateway.node_tls.ca_file, the cluster's CA)
set -uo pipefail

config=/etc/agentenv/control-plane.json
auth=/etc/agentenv/auth.env
gateway=""
gateway_ca=""
while [ $# -gt 0 ]; do
  case "$1" in
    --config) config="${2:-}"; shift 2 ;;
    --auth) auth="${2:-}"; shift 2 ;;
    --gateway) gateway="${2:-}"; shift 2 ;;
    --cacert) gateway_ca="${2:-}"; shift 2 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "verify-cluster.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

key="${AENV_API_KEY:-}"
if [ -z "$key" ]; then
  [ -r "$auth" ] || { echo "FAIL: no API key: set AENV_API_KEY or make $auth readable (run with sudo)"; exit 1; }
  key="$(sed -n 's/^AENV_API_KEY="\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$auth" | head -1)"
  [ -n "$key" ] || { echo "FAIL: $auth has no AENV_API_KEY= line"; exit 1; }
fi
[ -r "$config" ] || { echo "FAIL: cannot read $config (run with sudo)"; exit 1; }
# One tab-separated line per fact: the gateway's URL and CA, the node link's TLS
# files, the scheduler's scheme, then one line per node.
facts="$(python3 -c 'import json,sys
c = json.load(open(sys.argv[1]))
s, g = c["scheduler"], c.get("gateway", {})
tls = lambda sec, k: str((sec.get(k) or {}).get("cert_file") or "").strip()
port = str(g.get("http_listen_addr", "127.0.0.1:8080")).rsplit(":", 1)[-1]
nt = g.get("node_tls") or {}
ca = str(nt.get("ca_file") or (g.get("scheduler_tls") or {}).get("ca_file") or "").strip()
print("gateway", "%s://127.0.0.1:%s" % ("https" if tls(g, "tls") else "http", port), ca or "-", sep="\t")
print("node_tls", ca or "-", str(nt.get("cert_file") or "").strip() or "-", str(nt.get("key_file") or "").strip() or "-", sep="\t")
print("scheduler", "https" if tls(s, "tls") else "http", sep="\t")
for n in s["nodes"]:
    print("node", n["id"], n["endpoint"].rstrip("/"), sep="\t")' "$config")" \
  || { echo "FAIL: $config: not a control-plane config with a scheduler.nodes list"; exit 1; }

field() { printf '%s\n' "$facts" | awk -F '\t' -v k="$1" -v i="$2" '$1==k{print $i; exit}'; }
[ -n "$gateway" ] || gateway="$(field gateway 2)"
[ -n "$gateway_ca" ] || gateway_ca="$(field gateway 3)"
node_ca="$(field node_tls 2)"; node_cert="$(field node_tls 3)"; node_key="$(field node_tls 4)"
scheduler_scheme="$(field scheduler 2)"
nodes="$(printf '%s\n' "$facts" | awk -F '\t' '$1=="node"{print $2 "\t" $3}')"

# curl options of each hop: trust the cluster's CA; toward the nodes also present the
# gateway's client certificate (nodes with AENV_TLS_CLIENT_CA_FILE require one).
gw_args=()
[ "$gateway_ca" != - ] && gw_args+=(--cacert "$gateway_ca")
node_args=()
[ "$node_ca" != - ] && node_args+=(--cacert "$node_ca")
[ "$node_cert" != - ] && [ "$node_key" != - ] && node_args+=(--cert "$node_cert" --key "$node_key")
for f in "$gateway_ca" "$node_ca" "$node_cert" "$node_key"; do
  if [ "$f" != - ] && [ ! -r "$f" ]; then
    echo "FAIL: cannot read $f, named in $config (run with sudo; the install puts it in /etc/agentenv/tls)"
    exit 1
  fi
done

failures=0
ok() { echo "ok    $*"; }
fail() { echo "FAIL  $*"; failures=$((failures + 1)); }
# probe ARGS...: sets status (the HTTP status, 000 for none) and rc (curl's exit status).
status=""; rc=0
probe() {
  status="$(curl -s -o /dev/null -m 10 -w '%{http_code}' "$@")"
  rc=$?
}
# why URL CA CERT: what curl's exit status $rc says about a request to URL, trusting
# CA and presenting CERT ("-": none), that got no answer.
why() {
  case "$rc" in
    60) echo "its certificate is not trusted for that address: it must be signed by the cluster's CA ($2) and valid for the address in $1 (agentenv certs issue --name <name> --ip <address>)" ;;
    35|56)
      if [ "${1%%://*}" != https ]; then
        echo "the connection failed: if that listener serves TLS, write https:// in $config"
      elif [ "$3" != - ]; then
        echo "the TLS handshake failed: a plain listener there (then write http://), or it refuses the client certificate $3 (it must be signed by the CA of its AENV_TLS_CLIENT_CA_FILE)"
      else
        echo "the TLS handshake failed: a plain listener there (then write http://), or it requires a client certificate"
      fi ;;
    52) echo "an empty reply: the listener may serve TLS; write https:// in $config" ;;
    58) echo "curl cannot use the client certificate $3 with its key (readable? the two files issued together?)" ;;
    77) echo "curl cannot read the CA file $2" ;;
    6) echo "the host name does not resolve" ;;
    *) echo "unreachable from this host (curl exit $rc)" ;;
  esac
}

while IFS=$'\t' read -r id endpoint; do
  [ -n "$id" ] || continue
  probe "${node_args[@]}" "$endpoint/health"
  if [ "${status:0:1}" != 2 ]; then
    if [ "$status" = 000 ]; then detail="$(why "$endpoint" "$node_ca" "$node_cert")"; else detail="HTTP $status"; fi
    fail "$id: $endpoint/health: $detail; check that aenv runs there (systemctl status aenv) and that port ${endpoint##*:} is open from the gateway host"
    continue
  fi
  ok "$id: $endpoint/health"
  probe "${node_args[@]}" -H "X-API-Key: $key" "$endpoint/sandboxes"
  case "$status" in
    2*) ok "$id: accepts the shared API key" ;;
    401) fail "$id: rejects the API key the gateway uses: set AENV_API_KEY in that host's /etc/default/aenv to the value in $auth, then systemctl restart aenv" ;;
    *) fail "$id: GET $endpoint/sandboxes answered HTTP $status" ;;
  esac
done <<<"$nodes"

probe "${gw_args[@]}" "$gateway/health"
if [ "${status:0:1}" = 2 ]; then ok "gateway: $gateway/health"; else
  if [ "$status" = 000 ]; then detail="$(why "$gateway" "$gateway_ca" -)"; else detail="HTTP $status"; fi
  fail "gateway: $gateway/health: $detail; check systemctl status agentenv-gateway"
fi

listed="$(curl -s -m 10 "${gw_args[@]}" -H "X-API-Key: $key" "$gateway/nodes")"
while IFS=$'\t' read -r id endpoint; do
  [ -n "$id" ] || continue
  state="$(printf '%s' "$listed" | python3 -c 'import json,sys
try:
    v = json.load(sys.stdin)
except ValueError:
    v = []
print(next((n.get("status", "") for n in v if isinstance(n, dict) and n.get("id") == sys.argv[1]), "absent"))' "$id")"
  if [ "$state" = ready ]; then
    ok "$id: ready in $gateway/nodes"
  elif [ "$state" = draining ]; then
    # Its heartbeats arrive; an operator took it out of placement on purpose.
    ok "$id: draining in $gateway/nodes (no new sandboxes go there until: aenv node undrain $id)"
  else
    hint="AENV_OBSERVABILITY_SCHEDULER_ENDPOINT=\"$scheduler_scheme://<scheduler>:9090\" (with $scheduler_scheme://) and AENV_CLUSTER_TOKEN_FILE holding the scheduler's cluster token"
    [ "$scheduler_scheme" = https ] && hint="$hint, AENV_SCHEDULER_CA_FILE (the cluster's CA) and AENV_SCHEDULER_CLIENT_CERT_FILE/AENV_SCHEDULER_CLIENT_KEY_FILE (its certificate)"
    fail "$id: $state in $gateway/nodes: on that host /etc/default/aenv needs AENV_NODE_ID=\"$id\", AENV_OBSERVABILITY_SCHEDULER_REPORT_ENABLED=\"true\", $hint, and port 9090 of the scheduler must be reachable from it; see journalctl -u aenv"
  fi
done <<<"$nodes"

if [ "$failures" -gt 0 ]; then
  echo "$failures check(s) failed"
  exit 1
fi
echo "cluster OK"

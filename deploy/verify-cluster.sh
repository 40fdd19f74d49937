#!/usr/bin/env bash
# Checks a static multi-node cluster from the control-plane host, hop by hop, the way
# docs/static-multi-node.md "Verify the cluster" does by hand, and says what to fix:
#   1. every node in scheduler.nodes answers /health at its endpoint;
#   2. every node accepts the shared API key (a node with another key is named);
#   3. the gateway answers /health;
#   4. the gateway's /nodes lists every configured node as ready.
# Exit status 0 when all checks pass, 1 otherwise.
#
# Options (defaults are the installed paths):
#   --config PATH    control-plane JSON (/etc/agentenv/control-plane.json)
#   --auth PATH      file with AENV_API_KEY=... (/etc/agentenv/auth.env); AENV_API_KEY wins
#   --gateway URL    the gateway as seen from here (http://127.0.0.1:8080)
set -uo pipefail

config=/etc/agentenv/control-plane.json
auth=/etc/agentenv/auth.env
gateway=http://127.0.0.1:8080
while [ $# -gt 0 ]; do
  case "$1" in
    --config) config="${2:-}"; shift 2 ;;
    --auth) auth="${2:-}"; shift 2 ;;
    --gateway) gateway="${2:-}"; shift 2 ;;
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
[ -r "$config" ] || { echo "FAIL: cannot read $config"; exit 1; }
nodes="$(python3 -c 'import json,sys
for n in json.load(open(sys.argv[1]))["scheduler"]["nodes"]:
    print(n["id"], n["endpoint"].rstrip("/"))' "$config")" || { echo "FAIL: $config: no scheduler.nodes list"; exit 1; }

failures=0
ok() { echo "ok    $*"; }
fail() { echo "FAIL  $*"; failures=$((failures + 1)); }
code() { curl -s -o /dev/null -m 10 -w '%{http_code}' "$@"; }

while read -r id endpoint; do
  c="$(code "$endpoint/health")"
  if [ "${c:0:1}" != 2 ]; then
    fail "$id: $endpoint/health is unreachable from this host (HTTP $c): check that aenv runs there (systemctl status aenv) and that port ${endpoint##*:} is open from the gateway host"
    continue
  fi
  ok "$id: $endpoint/health"
  c="$(code -H "X-API-Key: $key" "$endpoint/sandboxes")"
  case "$c" in
    2*) ok "$id: accepts the shared API key" ;;
    401) fail "$id: rejects the API key the gateway uses: set AENV_API_KEY in that host's /etc/default/aenv to the value in $auth, then systemctl restart aenv" ;;
    *) fail "$id: GET $endpoint/sandboxes answered HTTP $c" ;;
  esac
done <<<"$nodes"

c="$(code "$gateway/health")"
if [ "${c:0:1}" = 2 ]; then ok "gateway: $gateway/health"; else
  fail "gateway: $gateway/health answered HTTP $c: check systemctl status agentenv-gateway"
fi

listed="$(curl -s -m 10 -H "X-API-Key: $key" "$gateway/nodes")"
while read -r id endpoint; do
  status="$(printf '%s' "$listed" | python3 -c 'import json,sys
try:
    v = json.load(sys.stdin)
except ValueError:
    v = []
print(next((n.get("status", "") for n in v if isinstance(n, dict) and n.get("id") == sys.argv[1]), "absent"))' "$id")"
  if [ "$status" = ready ]; then
    ok "$id: ready in $gateway/nodes"
  else
    fail "$id: $status in $gateway/nodes: on that host /etc/default/aenv needs AENV_NODE_ID=\"$id\", AENV_OBSERVABILITY_SCHEDULER_REPORT_ENABLED=\"true\" and AENV_OBSERVABILITY_SCHEDULER_ENDPOINT=\"http://<scheduler>:9090\" (with http://), and port 9090 of the scheduler must be reachable from it; see journalctl -u aenv"
  fi
done <<<"$nodes"

if [ "$failures" -gt 0 ]; then
  echo "$failures check(s) failed"
  exit 1
fi
echo "cluster OK"

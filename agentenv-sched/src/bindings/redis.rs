//! Bindings in Redis, shared by a primary scheduler and its query-only
//! replicas, and surviving a scheduler restart.
//!
//! The layout is the one every AgentENV scheduler uses, so schedulers of
//! either implementation can share one Redis:
//!
//! * `agentenv:scheduler:bindings:sandbox:<id>`: the JSON
//!   `{"node":{"node_id":"…","endpoint":"…"}}`, expiring after the binding TTL;
//! * `agentenv:scheduler:bindings:node:<node_id>`: the SET of ids the node
//!   owns, expiring an hour after its last write.
//!
//! One key outside that layout carries the rule for a roster sampled before
//! a create (see the module above): `agentenv:scheduler:pending:node:<node_id>`,
//! the SET of ids RecordAssignment bound to the node since its last roster,
//! expiring after the binding TTL. A scheduler that does not know it drops
//! such a binding at once, as it always did.
//!
//! Record and reconcile are Lua scripts (one EVALSHA each; the script is
//! loaded again after a Redis restart). They build their keys inside, so the
//! store needs one Redis, not a Redis Cluster. Every operation gives up after
//! [`OP_TIMEOUT`]; the connection is re-established in the background when
//! Redis comes back.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use agentenv_core::proto::scheduler_v1::Node;
use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use serde::{Deserialize, Serialize};
use tokio::time::{Duration, Instant};

use super::{BindingStore, StoreError};

/// Prefix of the binding and node-set keys.
pub const BINDINGS_PREFIX: &str = "agentenv:scheduler:bindings";
/// Prefix of the per-node sets of ids recorded since the node's last roster.
pub const PENDING_PREFIX: &str = "agentenv:scheduler:pending";
/// How long a node's set of ids lives after its last write.
pub const NODE_SET_TTL: Duration = Duration::from_secs(3600);
/// How long any Redis operation (connecting included) may take.
pub const OP_TIMEOUT: Duration = Duration::from_secs(2);

/// The owner named by a binding record, or nil for a missing or malformed one.
const LUA_OWNER: &str = r#"
local function owner(raw)
  if not raw then return nil end
  local ok, rec = pcall(cjson.decode, raw)
  if not ok or type(rec) ~= 'table' or type(rec.node) ~= 'table' then return nil end
  local n = rec.node.node_id
  if type(n) ~= 'string' or n == '' then return nil end
  return n
end
"#;

/// ARGV: prefix, pending prefix, id, node id, record JSON, ttl ms, set ttl ms.
const LUA_RECORD: &str = r#"
local prefix, pprefix, id, node = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local value, ttl, set_ttl = ARGV[5], ARGV[6], ARGV[7]
local bkey = prefix .. ':sandbox:' .. id
local old = owner(redis.call('GET', bkey))
if old and old ~= node then redis.call('SREM', prefix .. ':node:' .. old, id) end
redis.call('SET', bkey, value, 'PX', ttl)
local skey = prefix .. ':node:' .. node
redis.call('SADD', skey, id)
redis.call('PEXPIRE', skey, set_ttl)
local pkey = pprefix .. ':node:' .. node
redis.call('SADD', pkey, id)
redis.call('PEXPIRE', pkey, ttl)
return 1
"#;

/// ARGV: prefix, pending prefix, node id, record JSON, ttl ms, set ttl ms,
/// force ("1": ignore pending ids), then the roster (trimmed, unique, non-blank).
/// Returns 1 when it restarted the TTL of every binding the roster lists, else 0.
///
/// The bindings a roster lists again are rewritten (their TTL restarted) only when the
/// node's last such rewrite is a third of the TTL old, or the node's record changed: a
/// binding then always has at least two thirds of its TTL left after its node's last
/// heartbeat, and a heartbeat costs Redis a fraction of the writes (new and dropped ids
/// are handled at every heartbeat).
const LUA_RECONCILE: &str = r#"
local prefix, pprefix, node, value = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local ttl, set_ttl, force = ARGV[5], ARGV[6], ARGV[7]
local first = 8
local skey = prefix .. ':node:' .. node
local pkey = pprefix .. ':node:' .. node
local rkey = pprefix .. ':refreshed:' .. node
local fresh = force ~= '1' and #ARGV >= first and redis.call('GET', rkey) == value
local roster = {}
for i = first, #ARGV do roster[ARGV[i]] = true end
local pending = {}
if force ~= '1' then
  for _, id in ipairs(redis.call('SMEMBERS', pkey)) do pending[id] = true end
end
redis.call('DEL', pkey)
local listed = {}
local kept = 0
for _, id in ipairs(redis.call('SMEMBERS', skey)) do
  if roster[id] then
    listed[id] = true
  elseif pending[id] then
    kept = kept + 1
  else
    local bkey = prefix .. ':sandbox:' .. id
    if owner(redis.call('GET', bkey)) == node then redis.call('DEL', bkey) end
    redis.call('SREM', skey, id)
  end
end
local batch = {}
for i = first, #ARGV do
  local id = ARGV[i]
  local bkey = prefix .. ':sandbox:' .. id
  -- An id already in this node's set is bound here; a stale membership in
  -- another node's set is harmless, as deletions check the owner.
  if not listed[id] then
    local old = owner(redis.call('GET', bkey))
    if old and old ~= node then redis.call('SREM', prefix .. ':node:' .. old, id) end
    batch[#batch + 1] = id
    if #batch == 1000 then
      redis.call('SADD', skey, unpack(batch))
      batch = {}
    end
    redis.call('SET', bkey, value, 'PX', ttl)
  elseif not fresh then
    redis.call('SET', bkey, value, 'PX', ttl)
  end
end
if #batch > 0 then redis.call('SADD', skey, unpack(batch)) end
if #ARGV >= first and not fresh then
  redis.call('SET', rkey, value, 'PX', math.max(1, math.floor(tonumber(ttl) / 3)))
elseif #ARGV < first then
  redis.call('DEL', rkey)
end
if #ARGV >= first or kept > 0 then
  redis.call('PEXPIRE', skey, set_ttl)
else
  redis.call('DEL', skey)
end
if #ARGV >= first and not fresh then return 1 end
return 0
"#;

/// A binding's value, fields in the order other schedulers write them.
#[derive(Serialize, Deserialize)]
struct Record<N> {
    node: N,
}

#[derive(Serialize)]
struct RecordNode<'a> {
    node_id: &'a str,
    endpoint: &'a str,
}

#[derive(Deserialize)]
struct ReadNode {
    #[serde(default)]
    node_id: String,
    #[serde(default)]
    endpoint: String,
}

fn record_json(node_id: &str, endpoint: &str) -> String {
    serde_json::to_string(&Record {
        node: RecordNode { node_id, endpoint },
    })
    .unwrap_or_default()
}

/// Bindings in one Redis (see the module documentation for the layout).
#[derive(Clone)]
pub struct RedisBindingStore {
    conn: ConnectionManager,
    /// The address, without its password, for messages.
    addr: String,
    ttl_ms: u64,
    record: redis::Script,
    reconcile: redis::Script,
    /// Whether the last operation succeeded: failures are logged when they
    /// start and end, not once per call.
    healthy: Arc<AtomicBool>,
}

impl RedisBindingStore {
    /// Connects to the Redis at `addr` and checks it answers a PING within
    /// [`OP_TIMEOUT`]. `addr` is `host:port`, `redis://[:password@]host:port/db`,
    /// or `rediss://…` for TLS. Bindings expire `ttl` after their last refresh.
    pub async fn connect(addr: &str, ttl: Duration) -> Result<Self, StoreError> {
        let shown = redact(addr.trim());
        let url = connection_url(addr).map_err(|m| StoreError(format!("{shown}: {m}")))?;
        let client = redis::Client::open(url.as_str())
            .map_err(|e| StoreError(format!("{shown}: invalid Redis address: {e}")))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(OP_TIMEOUT))
            .set_response_timeout(Some(OP_TIMEOUT))
            .set_number_of_retries(2)
            .set_min_delay(Duration::from_millis(50))
            .set_max_delay(Duration::from_millis(500));
        let unreachable =
            |e: &dyn std::fmt::Display| StoreError(format!("cannot reach Redis at {shown}: {e}"));
        let mut conn = tokio::time::timeout(
            OP_TIMEOUT,
            client.get_connection_manager_with_config(config),
        )
        .await
        .map_err(|_| unreachable(&"no answer within 2s"))?
        .map_err(|e| unreachable(&e))?;
        let pong: Result<String, _> =
            tokio::time::timeout(OP_TIMEOUT, redis::cmd("PING").query_async(&mut conn))
                .await
                .map_err(|_| unreachable(&"no answer to PING within 2s"))?;
        pong.map_err(|e| unreachable(&e))?;
        Ok(Self {
            conn,
            addr: shown,
            ttl_ms: u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1),
            record: redis::Script::new(&format!("{LUA_OWNER}{LUA_RECORD}")),
            reconcile: redis::Script::new(&format!("{LUA_OWNER}{LUA_RECONCILE}")),
            healthy: Arc::new(AtomicBool::new(true)),
        })
    }

    /// The Redis address, without its password.
    pub fn address(&self) -> &str {
        &self.addr
    }

    async fn timed<T>(
        &self,
        what: &str,
        op: impl Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, StoreError> {
        let result = match tokio::time::timeout(OP_TIMEOUT, op).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(StoreError(format!("redis {what} at {}: {e}", self.addr))),
            Err(_) => Err(StoreError(format!(
                "redis {what} at {}: no answer within {OP_TIMEOUT:?}",
                self.addr
            ))),
        };
        let ok = result.is_ok();
        if self.healthy.swap(ok, Ordering::Relaxed) != ok {
            match &result {
                Ok(_) => {
                    tracing::info!(redis = %self.addr, "Redis answers again; bindings are served")
                }
                Err(e) => tracing::warn!(
                    redis = %self.addr,
                    error = %e.0,
                    "Redis failed; binding lookups and records answer UNAVAILABLE until it answers again"
                ),
            }
        }
        result
    }

    /// Makes `sandbox_ids` the node's roster (see [`BindingStore::reconcile_node`]);
    /// whether the TTL of every binding it lists was restarted (at most once a
    /// third of the TTL per node, and whenever the node's record changes).
    pub async fn reconcile_roster(
        &self,
        node: &Node,
        sandbox_ids: &[String],
    ) -> Result<bool, StoreError> {
        if node.node_id.trim().is_empty() {
            return Ok(false);
        }
        let mut seen = std::collections::HashSet::with_capacity(sandbox_ids.len());
        let ids: Vec<&str> = sandbox_ids
            .iter()
            .map(|s| s.trim())
            .filter(|s| !s.is_empty() && seen.insert(*s))
            .collect();
        // No binding without an address to route to.
        if !ids.is_empty() && node.endpoint.trim().is_empty() {
            return Ok(false);
        }
        self.run_reconcile(node, &ids, false).await
    }

    async fn run_reconcile(
        &self,
        node: &Node,
        ids: &[&str],
        force: bool,
    ) -> Result<bool, StoreError> {
        let node_id = node.node_id.trim();
        let mut inv = self.reconcile.prepare_invoke();
        inv.arg(BINDINGS_PREFIX)
            .arg(PENDING_PREFIX)
            .arg(node_id)
            .arg(record_json(node_id, node.endpoint.trim()))
            .arg(self.ttl_ms)
            .arg(NODE_SET_TTL.as_millis() as u64)
            .arg(if force { "1" } else { "0" });
        for id in ids {
            inv.arg(*id);
        }
        let mut conn = self.conn.clone();
        self.timed("reconcile", inv.invoke_async::<i64>(&mut conn))
            .await
            .map(|refreshed| refreshed == 1)
    }
}

#[async_trait]
impl BindingStore for RedisBindingStore {
    async fn get(&self, sandbox_id: &str, _now: Instant) -> Result<Option<Node>, StoreError> {
        let id = sandbox_id.trim();
        if id.is_empty() {
            return Ok(None);
        }
        let key = format!("{BINDINGS_PREFIX}:sandbox:{id}");
        let mut conn = self.conn.clone();
        let raw: Option<Vec<u8>> = self
            .timed("GET", redis::cmd("GET").arg(&key).query_async(&mut conn))
            .await?;
        // A malformed or incomplete record is a miss, left for its TTL.
        let Some(rec) = raw.and_then(|r| serde_json::from_slice::<Record<ReadNode>>(&r).ok())
        else {
            return Ok(None);
        };
        let n = rec.node;
        if n.node_id.is_empty() || n.endpoint.is_empty() {
            return Ok(None);
        }
        Ok(Some(Node {
            node_id: n.node_id,
            endpoint: n.endpoint,
        }))
    }

    async fn record(&self, sandbox_id: &str, node: &Node, _now: Instant) -> Result<(), StoreError> {
        let (id, node_id, endpoint) =
            (sandbox_id.trim(), node.node_id.trim(), node.endpoint.trim());
        if id.is_empty() || node_id.is_empty() || endpoint.is_empty() {
            return Ok(());
        }
        let mut inv = self.record.prepare_invoke();
        inv.arg(BINDINGS_PREFIX)
            .arg(PENDING_PREFIX)
            .arg(id)
            .arg(node_id)
            .arg(record_json(node_id, endpoint))
            .arg(self.ttl_ms)
            .arg(NODE_SET_TTL.as_millis() as u64);
        let mut conn = self.conn.clone();
        self.timed("record", inv.invoke_async::<i64>(&mut conn))
            .await
            .map(drop)
    }

    async fn reconcile_node(
        &self,
        node: &Node,
        sandbox_ids: &[String],
        _now: Instant,
    ) -> Result<(), StoreError> {
        self.reconcile_roster(node, sandbox_ids).await.map(drop)
    }

    async fn forget_node(&self, node_id: &str) -> Result<(), StoreError> {
        if node_id.trim().is_empty() {
            return Ok(());
        }
        let node = Node {
            node_id: node_id.to_string(),
            endpoint: String::new(),
        };
        self.run_reconcile(&node, &[], true).await.map(drop)
    }
}

/// `addr` as a URL the client takes: URLs of the schemes Redis speaks as
/// they are, `host:port` as `redis://host:port`.
fn connection_url(addr: &str) -> Result<String, String> {
    let addr = addr.trim();
    if addr.is_empty() {
        return Err("empty address".into());
    }
    if let Some((scheme, _)) = addr.split_once("://") {
        return match scheme {
            "redis" | "rediss" | "redis+unix" | "unix" => Ok(addr.to_string()),
            other => Err(format!(
                "unsupported scheme {other:?}; use host:port, redis://[:password@]host:port/db or rediss://[:password@]host:port/db"
            )),
        };
    }
    let port_ok = addr
        .rsplit_once(':')
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
    if !port_ok || addr.contains('/') || addr.contains('@') {
        return Err(
            "not a host:port; use host:port (e.g. 127.0.0.1:6379) or redis://[:password@]host:port/db"
                .into(),
        );
    }
    Ok(format!("redis://{addr}"))
}

/// `addr` with the password of a URL replaced by `***`.
fn redact(addr: &str) -> String {
    let Some((scheme, rest)) = addr.split_once("://") else {
        return addr.to_string();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => format!("{scheme}://***@{}", &rest[at + 1..]),
        None => addr.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_become_urls_and_bad_ones_say_what_to_write() {
        assert_eq!(
            connection_url(" 127.0.0.1:6379 ").unwrap(),
            "redis://127.0.0.1:6379"
        );
        assert_eq!(
            connection_url("redis://:pw@h:1/2").unwrap(),
            "redis://:pw@h:1/2"
        );
        assert_eq!(connection_url("rediss://h:1").unwrap(), "rediss://h:1");
        for bad in ["", "localhost", "h:port", ":6379", "http://h:1", "h:1/2"] {
            let err = connection_url(bad).unwrap_err();
            assert!(
                err.contains("host:port") || err.contains("empty"),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn passwords_never_reach_messages() {
        assert_eq!(redact("redis://:secret@h:1/0"), "redis://***@h:1/0");
        assert_eq!(redact("rediss://u:secret@h:1"), "rediss://***@h:1");
        assert_eq!(redact("h:6379"), "h:6379");
        assert_eq!(redact("redis://h:1/0"), "redis://h:1/0");
    }

    #[test]
    fn the_record_json_has_the_shared_field_order() {
        assert_eq!(
            record_json("node-a", "http://10.0.0.1:8000"),
            r#"{"node":{"node_id":"node-a","endpoint":"http://10.0.0.1:8000"}}"#
        );
    }
}

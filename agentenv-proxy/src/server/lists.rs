//! Node and cluster lists: `GET /nodes` from the scheduler's heartbeat
//! view, `/nodes/{id}` proxied to that node, and `GET /sandboxes` (and
//! `/v2/sandboxes`, paginated) fanned out to every node and merged; a node
//! that does not answer is left out and named.

use std::net::SocketAddr;

use agentenv_core::proto::scheduler_v1 as pb;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode};
use tokio::time::Instant;

use super::proxy::{ProxyPlan, request_host};
use super::{ClientTls, Gateway, LIST_BODY_CAP, scheduler_error};
use crate::body::{GatewayBody, boxed, concat, empty, error_response, json_response, read_prefix};
use crate::cluster_list::{self, Cursor, ListedSandbox, NodeList, NodeWalk, Order, WalkEnd};
use crate::forward::{Forwarded, rewrite_request_headers, upstream_uri};
use crate::nodes::NodeView;
use crate::routing::{MISSING_NODES_HEADER, NEXT_TOKEN_HEADER};

impl Gateway {
    /// `GET /nodes[?clusterID=…]`: the scheduler's view of the nodes.
    pub(super) async fn node_list(
        &self,
        query: Option<&str>,
        deadline: Instant,
    ) -> Response<GatewayBody> {
        let cluster = query_value(query, "clusterID").unwrap_or_default();
        let call = self.inner.scheduler.list_observed_nodes(cluster.trim());
        match self.rpc("ListObservedNodes", deadline, call).await {
            Ok(nodes) => {
                let views: Vec<NodeView> = nodes.iter().map(NodeView::from).collect();
                json_response(StatusCode::OK, &views)
            }
            Err(status) => scheduler_error(&status),
        }
    }

    /// `POST` / `DELETE /nodes/{id}/drain`: the scheduler stops (or resumes)
    /// placing new sandboxes on the node; 204 when done.
    pub(super) async fn node_drain(
        &self,
        node_id: &str,
        drain: bool,
        deadline: Instant,
    ) -> Response<GatewayBody> {
        let (rpc, verb) = if drain {
            ("DrainNode", "drain")
        } else {
            ("UndrainNode", "undrain")
        };
        let call = self.inner.scheduler.set_draining(node_id, drain);
        match self.rpc(rpc, deadline, call).await {
            Ok(_) => {
                let mut resp = Response::new(empty());
                *resp.status_mut() = StatusCode::NO_CONTENT;
                resp
            }
            Err(status) if status.code() == tonic::Code::Unimplemented => error_response(
                StatusCode::NOT_IMPLEMENTED,
                &format!(
                    "the scheduler cannot {verb} nodes: {}; send it to a primary scheduler of this version",
                    status.message()
                ),
            ),
            Err(status) => scheduler_error(&status),
        }
    }

    /// `/nodes/{id}…`: proxied to that node, found by its heartbeats.
    pub(super) async fn node_detail(
        &self,
        req: Request<GatewayBody>,
        remote: SocketAddr,
        node_id: &str,
        deadline: Instant,
        long_lived: bool,
    ) -> Response<GatewayBody> {
        let cluster = query_value(req.uri().query(), "clusterID").unwrap_or_default();
        let call = self.inner.scheduler.get_node(node_id, cluster.trim());
        let observed = match self.rpc("GetNode", deadline, call).await {
            Ok(n) => n,
            Err(status) => return scheduler_error(&status),
        };
        if observed.endpoint.trim().is_empty() {
            return error_response(StatusCode::BAD_GATEWAY, "resolved node endpoint is empty");
        }
        let uri = match upstream_uri(&observed.endpoint, req.uri().path(), req.uri().query()) {
            Ok(u) => u,
            Err(_) => return error_response(StatusCode::BAD_GATEWAY, "invalid upstream endpoint"),
        };
        let plan = ProxyPlan {
            node: pb::Node {
                node_id: observed.node_id.clone(),
                endpoint: observed.endpoint.clone(),
            },
            uri,
            route: "/nodes/{node_id}",
            deadline: (!long_lived).then_some(deadline),
            record: false,
            host_route: None,
            data_plane: false,
            timing: None,
        };
        self.proxy(req, remote, plan, &mut false).await
    }

    /// `GET /sandboxes` (newest first) and `/v2/sandboxes` (paginated, in
    /// its `order`): every node's list, fetched at once and merged. A node
    /// that does not answer is left out and named in
    /// `x-agentenv-missing-nodes`; one that refuses the request (4xx) fails
    /// it.
    pub(super) async fn cluster_list(
        &self,
        req: Request<GatewayBody>,
        remote: SocketAddr,
        v2: bool,
        deadline: Instant,
    ) -> Response<GatewayBody> {
        let nodes = match self
            .rpc("ListNodes", deadline, self.inner.scheduler.list_nodes())
            .await
        {
            Ok(n) => n,
            Err(status) => return scheduler_error(&status),
        };
        if nodes.is_empty() {
            return error_response(StatusCode::BAD_GATEWAY, "cluster list unavailable");
        }
        let raw_query = req.uri().query().unwrap_or("").to_string();
        let pairs = cluster_list::parse_query(&raw_query);
        // A v2 page: in which order, how many items, after which one.
        let (asked_order, limit, cursor) = if v2 {
            let asked_order = match cluster_list::parse_order(&pairs) {
                Ok(o) => o,
                Err(e) => return error_response(StatusCode::BAD_REQUEST, &e.to_string()),
            };
            let limit = match cluster_list::parse_limit(&pairs) {
                Ok(l) => l,
                Err(e) => return error_response(StatusCode::BAD_REQUEST, &e.to_string()),
            };
            let token = pairs
                .iter()
                .find(|(k, _)| k == "nextToken")
                .map(|(_, v)| v.as_str());
            let cursor = match cluster_list::parse_token(token) {
                Ok(c) => c,
                Err(e) => return error_response(StatusCode::BAD_REQUEST, &e.to_string()),
            };
            if limit <= 0 {
                return json_response(StatusCode::OK, &Vec::<ListedSandbox>::new());
            }
            let limit = usize::try_from(limit).unwrap_or(usize::MAX);
            (asked_order, Some(limit), cursor)
        } else {
            (None, None, None)
        };
        let order = asked_order.unwrap_or_default();
        let headers = fanout_headers(&req, remote);
        let target = ListTarget {
            path: req.uri().path(),
            v2,
            raw_query: &raw_query,
            pairs: &pairs,
            order: asked_order,
            headers: &headers,
        };
        let (lists, missing) = match self
            .gather(&nodes, &target, cursor.as_ref(), limit, order, deadline)
            .await
        {
            Ok(g) => g,
            Err(refused) => return refused,
        };
        let mut resp = if lists.is_empty() {
            error_response(StatusCode::BAD_GATEWAY, "cluster list unavailable")
        } else if let Some(limit) = limit {
            let (page, next) = cluster_list::page(lists, limit, order);
            let mut resp = json_response(StatusCode::OK, &page);
            if let Some(next) = next
                && let Ok(v) = HeaderValue::from_str(&next)
            {
                resp.headers_mut().insert(NEXT_TOKEN_HEADER, v);
            }
            resp
        } else {
            let all = lists.into_iter().flat_map(|l| l.items).collect();
            json_response(StatusCode::OK, &cluster_list::merge(all, Order::Desc))
        };
        if !missing.is_empty()
            && let Ok(v) = HeaderValue::from_str(&missing)
        {
            resp.headers_mut().insert(MISSING_NODES_HEADER, v);
        }
        resp
    }

    /// Every node's part of a cluster list at once (after `cursor` in
    /// `order`): the lists of the nodes that answered, and the ids of those
    /// that did not (comma-separated, in `nodes` order). A node's refusal
    /// (4xx) is the answer instead.
    async fn gather(
        &self,
        nodes: &[pb::Node],
        target: &ListTarget<'_>,
        cursor: Option<&Cursor>,
        limit: Option<usize>,
        order: Order,
        deadline: Instant,
    ) -> Result<(Vec<NodeList>, String), Response<GatewayBody>> {
        let mut pending: FuturesUnordered<_> = nodes
            .iter()
            .enumerate()
            .map(|(i, node)| {
                let walk = NodeWalk::new(cursor.cloned(), limit, order);
                async move {
                    let listed =
                        tokio::time::timeout_at(deadline, self.list_node(node, target, walk)).await;
                    (i, listed)
                }
            })
            .collect();
        let mut lists = Vec::with_capacity(nodes.len());
        let mut missing = Vec::new();
        while let Some((i, listed)) = pending.next().await {
            let node = &nodes[i];
            let why = match listed {
                Ok(Ok(mut list)) => {
                    for item in &mut list.items {
                        item.node_id = Some(node.node_id.clone());
                    }
                    lists.push(list);
                    continue;
                }
                Ok(Err(NodeFailure::Refused(status, message))) => {
                    tracing::warn!(node_id = %node.node_id, %status, %message, "cluster list: node refused the request");
                    return Err(error_response(status, &message));
                }
                Ok(Err(NodeFailure::Unavailable(why))) => why,
                Err(_) => "no answer within the request timeout".to_string(),
            };
            tracing::warn!(
                node_id = %node.node_id,
                endpoint = %node.endpoint,
                reason = %why,
                "cluster list: node did not answer; listing the other nodes without it"
            );
            self.inner.metrics.count_missing_node(&node.node_id);
            missing.push(i);
        }
        missing.sort_unstable();
        let missing = missing
            .iter()
            .map(|&i| nodes[i].node_id.as_str())
            .collect::<Vec<_>>()
            .join(",");
        Ok((lists, missing))
    }

    /// One node's part of a cluster list: its pages, followed as `walk`
    /// says, all within [`LIST_BODY_CAP`] bytes.
    async fn list_node(
        &self,
        node: &pb::Node,
        target: &ListTarget<'_>,
        mut walk: NodeWalk,
    ) -> Result<NodeList, NodeFailure> {
        use NodeFailure::Unavailable;
        let mut budget = LIST_BODY_CAP;
        while let Some(next) = walk.next_request() {
            let query = if target.v2 {
                cluster_list::v2_node_query(target.pairs, target.order, &next)
            } else {
                cluster_list::v1_node_query(target.raw_query, &next)
            };
            let query = (!query.is_empty()).then_some(query);
            let uri = upstream_uri(&node.endpoint, target.path, query.as_deref())
                .map_err(|_| Unavailable("its endpoint is not a valid URI".into()))?;
            let mut up = Request::new(empty());
            *up.uri_mut() = uri;
            *up.headers_mut() = target.headers.clone();
            let resp = self
                .pool
                .send(up)
                .await
                .map_err(|e| Unavailable(e.to_string()))?;
            let status = resp.status();
            if status.is_client_error() {
                return Err(NodeFailure::Refused(status, refusal_message(resp).await));
            }
            if !status.is_success() {
                return Err(Unavailable(format!("it answered {status}")));
            }
            let token = resp
                .headers()
                .get(NEXT_TOKEN_HEADER)
                .and_then(|v| v.to_str().ok())
                .map(str::trim)
                .filter(|t| !t.is_empty())
                .map(str::to_string);
            let (frames, len, rest) = read_prefix(boxed(resp.into_body()), budget)
                .await
                .map_err(|e| Unavailable(format!("reading its answer failed: {e}")))?;
            if rest.is_some() {
                return Err(Unavailable(format!(
                    "its list is larger than {LIST_BODY_CAP} bytes"
                )));
            }
            budget = budget.saturating_sub(len);
            let items: Vec<ListedSandbox> = serde_json::from_slice(&concat(&frames))
                .map_err(|e| Unavailable(format!("its answer is not a sandbox list: {e}")))?;
            if walk.take_page(items, token) == WalkEnd::Stalled {
                tracing::warn!(node_id = %node.node_id, "cluster list: node's next-page token goes nowhere; using the pages it gave");
            }
        }
        Ok(walk.finish())
    }
}

/// What every node is asked for a cluster list.
struct ListTarget<'a> {
    path: &'a str,
    v2: bool,
    raw_query: &'a str,
    pairs: &'a [(String, String)],
    /// The v2 `order` the client gave (`None`: the default).
    order: Option<Order>,
    headers: &'a http::HeaderMap,
}

/// Why a node's list was not used.
enum NodeFailure {
    /// The node refused the request (4xx): the whole list fails with it.
    Refused(StatusCode, String),
    /// No usable answer (unreachable, 5xx, not a list): listed without it.
    Unavailable(String),
}

/// The headers of a request the gateway makes to a node on a client's behalf (a list,
/// metrics of several sandboxes): the client's, with the `X-Forwarded-*` of the client's
/// request, without a body length.
pub(super) fn fanout_headers(req: &Request<GatewayBody>, remote: SocketAddr) -> http::HeaderMap {
    let host = request_host(req);
    let request_uri = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".into());
    let mut headers = req.headers().clone();
    rewrite_request_headers(
        &mut headers,
        false,
        &Forwarded {
            client_ip: remote.ip().to_canonical(),
            host: host.as_ref(),
            method: req.method(),
            request_uri: &request_uri,
            tls: req.extensions().get::<ClientTls>().is_some(),
        },
    );
    headers.remove(header::CONTENT_LENGTH);
    headers
}

/// Largest refusal body of a node whose message is relayed.
const REFUSAL_BODY_CAP: usize = 16 << 10;

/// The message of a node's refusal (its JSON error body's `message`, so that the client
/// learns what to fix), else the status's reason.
async fn refusal_message(resp: Response<crate::pool::PooledBody>) -> String {
    let status = resp.status();
    let reason = || {
        status
            .canonical_reason()
            .unwrap_or("client error")
            .to_string()
    };
    match read_prefix(boxed(resp.into_body()), REFUSAL_BODY_CAP).await {
        Ok((frames, _, None)) => {
            serde_json::from_slice::<agentenv_core::error::ErrorBody>(&concat(&frames))
                .ok()
                .map(|b| b.message)
                .filter(|m| !m.trim().is_empty())
                .unwrap_or_else(reason)
        }
        _ => reason(),
    }
}

fn query_value(query: Option<&str>, key: &str) -> Option<String> {
    cluster_list::parse_query(query?)
        .into_iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v)
}

//! Node and cluster lists: `GET /nodes` from the scheduler's heartbeat
//! view, `/nodes/{id}` proxied to that node, and `GET /sandboxes` (and
//! `/v2/sandboxes`, paginated) fanned out to every node and merged.

use std::net::SocketAddr;

use agentenv_core::proto::scheduler_v1 as pb;
use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode};
use tokio::time::Instant;

use super::proxy::{ProxyPlan, request_host};
use super::{ClientTls, Gateway, LIST_BODY_CAP, scheduler_error};
use crate::body::{GatewayBody, boxed, concat, empty, error_response, json_response, read_prefix};
use crate::cluster_list::{self, ListedSandbox};
use crate::forward::{Forwarded, rewrite_request_headers, upstream_uri};
use crate::nodes::NodeView;
use crate::routing::NEXT_TOKEN_HEADER;

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
        };
        self.proxy(req, remote, plan, &mut false).await
    }

    /// `GET /sandboxes` and `/v2/sandboxes` (paginated): every node's
    /// list, fetched at once and merged.
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
        let upstream_query = if v2 {
            cluster_list::v2_upstream_query(&pairs)
        } else {
            raw_query.clone()
        };
        let upstream_query = (!upstream_query.is_empty()).then_some(upstream_query);
        let host = request_host(&req);
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
        let path = req.uri().path().to_string();
        let fetches = nodes.iter().map(|node| {
            let headers = headers.clone();
            let path = path.as_str();
            let query = upstream_query.as_deref();
            async move {
                let uri = upstream_uri(&node.endpoint, path, query).map_err(|_| None)?;
                let mut up = Request::new(empty());
                *up.uri_mut() = uri;
                *up.headers_mut() = headers;
                let resp = self.pool.send(up).await.map_err(|e| {
                    tracing::warn!(node_id = %node.node_id, error = ?e, "cluster list: node unreachable");
                    None
                })?;
                let status = resp.status();
                if !status.is_success() {
                    tracing::warn!(node_id = %node.node_id, %status, "cluster list: node answered with an error");
                    return Err(Some(status));
                }
                let (frames, _, rest) = read_prefix(boxed(resp.into_body()), LIST_BODY_CAP).await.map_err(|_| None)?;
                if rest.is_some() {
                    tracing::warn!(node_id = %node.node_id, "cluster list: node answer too large");
                    return Err(None);
                }
                serde_json::from_slice::<Vec<ListedSandbox>>(&concat(&frames)).map_err(|e| {
                    tracing::warn!(node_id = %node.node_id, error = %e, "cluster list: node answer is not a sandbox list");
                    None
                })
            }
        });
        let all = match tokio::time::timeout_at(deadline, futures::future::try_join_all(fetches))
            .await
        {
            Ok(Ok(lists)) => lists.into_iter().flatten().collect::<Vec<_>>(),
            Ok(Err(Some(status))) if status.is_client_error() => {
                return error_response(status, status.canonical_reason().unwrap_or("client error"));
            }
            Ok(Err(_)) | Err(_) => {
                return error_response(StatusCode::BAD_GATEWAY, "cluster list unavailable");
            }
        };
        let merged = cluster_list::merge(all);
        if !v2 {
            return json_response(StatusCode::OK, &merged);
        }
        let limit = match cluster_list::parse_limit(&pairs) {
            Ok(l) => l,
            Err(e) => return error_response(StatusCode::BAD_REQUEST, &e.to_string()),
        };
        let token = pairs
            .iter()
            .find(|(k, _)| k == "nextToken")
            .map(|(_, v)| v.as_str());
        let cursor = match cluster_list::parse_token(token, time::OffsetDateTime::now_utc()) {
            Ok(c) => c,
            Err(e) => return error_response(StatusCode::BAD_REQUEST, &e.to_string()),
        };
        let (page, next) = cluster_list::paginate(merged, cursor, limit);
        let mut resp = json_response(StatusCode::OK, &page);
        if let Some(next) = next
            && let Ok(v) = HeaderValue::from_str(&next)
        {
            resp.headers_mut().insert(NEXT_TOKEN_HEADER, v);
        }
        resp
    }
}

fn query_value(query: Option<&str>, key: &str) -> Option<String> {
    cluster_list::parse_query(query?)
        .into_iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v)
}

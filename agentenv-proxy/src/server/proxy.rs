//! The hyper lane: a request as hyper read it is authenticated, routed
//! ([`Router::decide`](super::route::Router::decide)), answered by the
//! gateway or proxied to its node through the pool, with the request
//! histogram recorded when the response body ends; successful creates and
//! forks are followed by RecordAssignment.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use agentenv_core::proto::scheduler_v1 as pb;
use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri, Version};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use tokio::time::Instant;

use super::route::{Decision, RoutingFacts, decode_path};
use super::timing::{Phases, SERVER_TIMING};
use super::{
    ClientTls, Gateway, Inner, SNIFF_CAP, record_timeout, scheduler_error, upstream_unavailable,
};
use crate::body::{
    BodyDeadlineExceeded, BoxError, DeadlineBody, GatewayBody, ReplayBody, boxed,
    caused_by_client_body, client_body, concat, empty, error_response, full, read_prefix,
};
use crate::client::SchedulerClient;
use crate::forward::{Endpoint, Forwarded, rewrite_request_headers, rewrite_response_headers};
use crate::hint::capture_hint;
use crate::host_route::HostRoute;
use crate::metrics::{GatewayMetrics, RequestLabels, UpstreamLabels};
use crate::routing::{
    API_KEY_HEADER, IDEMPOTENCY_KEY_HEADER, NODE_ID_HEADER, RouteSource, SANDBOX_ID_HEADER,
    TARGET_PORT_HEADER, create_kind, header_str, is_long_lived, is_proxy_path, is_stream_input,
    is_websocket, method_label, records_assignment, route_label, sandbox_id_from_headers,
    status_label, target_port_from_headers,
};

/// Records the request histogram when dropped: with the response status, or
/// `client_closed` when the client went away first.
struct Recorder<'a> {
    metrics: &'a GatewayMetrics,
    start: Instant,
    method: &'static str,
    route: &'static str,
    source: RouteSource,
    status: Option<u16>,
    instrument: bool,
    /// The response body is already whole in memory: its end is known
    /// when the head is.
    body_complete: bool,
}

impl Drop for Recorder<'_> {
    fn drop(&mut self) {
        if !self.instrument {
            return;
        }
        let status = self.status.map(status_label).unwrap_or("client_closed");
        self.metrics.observe_request(
            RequestLabels {
                method: self.method,
                route: self.route,
                route_source: self.source.label(),
                status,
            },
            self.start.elapsed().as_secs_f64(),
        );
    }
}

/// The request histogram sample of a request whose response body is still
/// being sent.
struct RequestDone {
    inner: Arc<Inner>,
    labels: RequestLabels,
    start: Instant,
}

impl RequestDone {
    fn record(self) {
        self.inner
            .metrics
            .observe_request(self.labels, self.start.elapsed().as_secs_f64());
    }
}

/// A response body that records its request when it ends, fails or is
/// dropped (the client went away mid-body: the status was already sent).
struct TimedBody {
    inner: GatewayBody,
    done: Option<RequestDone>,
}

impl Body for TimedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        let finished = match &polled {
            Poll::Ready(None | Some(Err(_))) => true,
            Poll::Ready(Some(Ok(_))) => this.inner.is_end_stream(),
            Poll::Pending => false,
        };
        if finished && let Some(done) = this.done.take() {
            done.record();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for TimedBody {
    fn drop(&mut self) {
        if let Some(done) = self.done.take() {
            done.record();
        }
    }
}

/// Where a proxied request goes and how.
pub(super) struct ProxyPlan {
    pub(super) node: pb::Node,
    pub(super) uri: Uri,
    pub(super) route: &'static str,
    /// `None` for long-lived requests (no timeout).
    pub(super) deadline: Option<Instant>,
    pub(super) record: bool,
    pub(super) host_route: Option<HostRoute>,
    /// A data-plane request (routed by host or routing headers): the API key is
    /// not sent on to the node, which checks the sandbox's own tokens.
    pub(super) data_plane: bool,
    /// The gateway's phases so far, for `Server-Timing` (`None`: not timed).
    pub(super) timing: Option<Phases>,
}

impl Gateway {
    /// Handles one request from `remote`. Never fails: errors are responses.
    pub async fn handle<B>(&self, req: Request<B>, remote: SocketAddr) -> Response<GatewayBody>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let req = req.map(client_body);
        let mut rec = Recorder {
            metrics: &self.inner.metrics,
            start: Instant::now(),
            method: method_label(req.method()),
            route: "unmatched",
            source: RouteSource::Unknown,
            status: None,
            instrument: true,
            body_complete: false,
        };
        let resp = self.dispatch(req, remote, &mut rec).await;
        if !rec.instrument || rec.body_complete || resp.body().is_end_stream() {
            rec.status = Some(resp.status().as_u16());
            return resp;
        }
        // The request lasts until its response body has been sent.
        rec.instrument = false;
        let done = RequestDone {
            inner: self.inner.clone(),
            labels: RequestLabels {
                method: rec.method,
                route: rec.route,
                route_source: rec.source.label(),
                status: status_label(resp.status().as_u16()),
            },
            start: rec.start,
        };
        resp.map(|inner| {
            boxed(TimedBody {
                inner,
                done: Some(done),
            })
        })
    }

    async fn dispatch(
        &self,
        req: Request<GatewayBody>,
        remote: SocketAddr,
        rec: &mut Recorder<'_>,
    ) -> Response<GatewayBody> {
        let Some(decoded) = decode_path(req.uri().path()).map(std::borrow::Cow::into_owned) else {
            return error_response(
                StatusCode::BAD_REQUEST,
                "invalid request path: bad percent-encoding",
            );
        };
        rec.route = route_label(&decoded);
        let host = request_host(&req);
        let router = &self.inner.router;
        let host_route =
            router.host_route(host.as_ref().and_then(|h| h.to_str().ok()).unwrap_or(""));
        if matches!(host_route, Ok(None)) && crate::console::is_console_path(&decoded) {
            let console = self.inner.console.clone();
            return crate::console::handle(self.clone(), console, req, remote).await;
        }
        let headers = req.headers();
        let facts = RoutingFacts {
            method: req.method(),
            decoded: &decoded,
            host_route: &host_route,
            sandbox_id: sandbox_id_from_headers(headers),
            has_port: target_port_from_headers(headers).is_some(),
        };
        let deadline = rec.start + self.inner.opts.request_timeout;
        // Owned from here on: the request moves into the handler.
        let (sandbox_id, source) = match router.decide(&facts, || router.authorized(headers)) {
            Decision::Reject(status, message) => return error_response(status, message),
            Decision::Local => {
                rec.instrument = false;
                return if decoded == "/health" {
                    let mut resp = Response::new(empty());
                    *resp.status_mut() = StatusCode::NO_CONTENT;
                    resp
                } else {
                    error_response(StatusCode::NOT_FOUND, "404 page not found")
                };
            }
            Decision::BadHost => {
                let message = host_route.err().map(|e| e.to_string()).unwrap_or_default();
                return error_response(StatusCode::BAD_REQUEST, &message);
            }
            Decision::ClusterList { v2 } => {
                rec.source = RouteSource::Gateway;
                // Rare paths are boxed so their state does not grow
                // (and get copied with) every proxied request's future.
                return Box::pin(self.cluster_list(req, remote, v2, deadline)).await;
            }
            Decision::SandboxMetrics => {
                rec.source = RouteSource::Gateway;
                return Box::pin(self.sandbox_metrics(req, remote, deadline)).await;
            }
            Decision::NodeList => {
                rec.source = RouteSource::Gateway;
                let query = req.uri().query().map(str::to_string);
                return Box::pin(self.node_list(query.as_deref(), deadline)).await;
            }
            Decision::NodeDetail(node_id) => {
                rec.source = RouteSource::Gateway;
                let node_id = node_id.to_string();
                let long_lived = is_long_lived(req.headers());
                return Box::pin(self.node_detail(req, remote, &node_id, deadline, long_lived))
                    .await;
            }
            Decision::NodeDrain { node_id, drain } => {
                rec.source = RouteSource::Gateway;
                let node_id = node_id.to_string();
                return Box::pin(self.node_drain(&node_id, drain, deadline)).await;
            }
            Decision::NodeMove(node_id) => {
                rec.source = RouteSource::Gateway;
                let node_id = node_id.to_string();
                return Box::pin(self.move_node(req, remote, &node_id, deadline)).await;
            }
            Decision::Route { id, source } => (id.map(str::to_string), source),
        };
        let host_route = host_route.ok().flatten();
        self.handle_proxy(req, remote, decoded, sandbox_id, source, host_route, rec)
            .await
    }

    #[allow(clippy::too_many_arguments)]
    async fn handle_proxy(
        &self,
        mut req: Request<GatewayBody>,
        remote: SocketAddr,
        decoded: String,
        sandbox_id: Option<String>,
        source: RouteSource,
        host_route: Option<HostRoute>,
        rec: &mut Recorder<'_>,
    ) -> Response<GatewayBody> {
        let opts = &self.inner.opts;
        let deadline = rec.start + opts.request_timeout;
        let long_lived = is_long_lived(req.headers());
        rec.source = source;
        // Control-plane answers carry the gateway's phases (never the tenant's data
        // plane, whose headers are the sandbox's).
        let mut phases = (!source.is_data_plane()).then(|| Phases::new(rec.start.into_std()));
        let mut mark = |name| {
            if let Some(p) = phases.as_mut() {
                p.mark(name);
            }
        };
        mark("route");

        // Call the trait object itself, not the blanket impl for `Arc<T>`
        // (which would box one more future per call).
        let scheduler: &dyn SchedulerClient = &*self.inner.scheduler;
        // A request routed by a sandbox id whose answer says the route may be stale
        // makes the gateway forget the route it keeps.
        let routed_id = sandbox_id.clone();
        let method = req.method().clone();
        let node = match sandbox_id {
            Some(id) => {
                let node = self.lookup_route(&id, deadline).await;
                mark("lookup");
                node
            }
            None => {
                // A retried idempotent create goes where its first request went.
                let idempotent = create_kind(req.method(), &decoded)
                    .and(header_str(req.headers(), IDEMPOTENCY_KEY_HEADER))
                    .map(agentenv_core::idempotency::sandbox_id);
                let first = match &idempotent {
                    Some(id) => match self
                        .rpc("LookupNode", deadline, scheduler.lookup_node(id))
                        .await
                    {
                        Ok(node) => Some(node),
                        Err(status) if status.code() == tonic::Code::NotFound => None,
                        Err(status) => return scheduler_error(&status),
                    },
                    None => None,
                };
                if idempotent.is_some() {
                    mark("lookup");
                }
                match first {
                    Some(node) => Ok(node),
                    None => {
                        let hint = match create_kind(req.method(), &decoded) {
                            Some(kind) => {
                                let (mut parts, body) = req.into_parts();
                                let captured = tokio::time::timeout_at(
                                    deadline,
                                    Box::pin(capture_hint(kind, &mut parts.headers, body)),
                                )
                                .await;
                                match captured {
                                    Ok(Ok((hint, body))) => {
                                        req = Request::from_parts(parts, body);
                                        Some(hint)
                                    }
                                    Ok(Err(e)) => {
                                        tracing::debug!(error = ?e, "reading a create body failed");
                                        return error_response(
                                            StatusCode::BAD_REQUEST,
                                            "failed to read request body",
                                        );
                                    }
                                    Err(_) => {
                                        return error_response(
                                            StatusCode::BAD_REQUEST,
                                            "failed to read request body",
                                        );
                                    }
                                }
                            }
                            None => None,
                        };
                        mark("hint");
                        let scheduled =
                            Box::pin(self.rpc("Schedule", deadline, scheduler.schedule(hint)))
                                .await;
                        mark("schedule");
                        // Bound before the create runs: a retry through any gateway finds
                        // the node while it makes the sandbox (its heartbeats keep it).
                        if let (Ok(node), Some(id)) = (&scheduled, &idempotent) {
                            self.record(std::slice::from_ref(id), node).await;
                            mark("bind");
                        }
                        scheduled
                    }
                }
            }
        };
        let node = match node {
            Ok(n) => n,
            Err(status) => return scheduler_error(&status),
        };

        // Data-plane routes go under `/proxy` (kept once if already there).
        let under_proxy = source.is_data_plane() && !is_proxy_path(&decoded);
        let parts: &[&str] = if under_proxy {
            &["/proxy", req.uri().path()]
        } else {
            &[req.uri().path()]
        };
        let uri = match Endpoint::cached(&node.endpoint)
            .and_then(|e| e.uri(parts, req.uri().query()))
        {
            Ok(u) => u,
            Err(e) => {
                tracing::warn!(node_id = %node.node_id, error = %e, "scheduler returned an unusable endpoint");
                return error_response(StatusCode::BAD_GATEWAY, "invalid upstream endpoint");
            }
        };
        let record = records_assignment(req.method(), &decoded, source);
        let plan = ProxyPlan {
            node,
            uri,
            route: rec.route,
            deadline: (!long_lived).then_some(deadline),
            record,
            host_route,
            data_plane: source.is_data_plane(),
            timing: phases,
        };
        // Boxed: the exchange's state then lives in one place instead of
        // being moved through every caller's future on the way in.
        let resp = Box::pin(self.proxy(req, remote, plan, &mut rec.body_complete)).await;
        if let Some(id) = routed_id
            && (resp.status().is_server_error()
                || (method == Method::DELETE && !source.is_data_plane()))
        {
            // The node lost the sandbox or could not be reached, or the sandbox (or
            // part of it) was deleted: the next request asks the scheduler.
            self.forget_route(&id);
        }
        resp
    }

    /// Sets `body_complete` when the response body is already whole.
    pub(super) async fn proxy(
        &self,
        mut req: Request<GatewayBody>,
        remote: SocketAddr,
        plan: ProxyPlan,
        body_complete: &mut bool,
    ) -> Response<GatewayBody> {
        let websocket = is_websocket(req.headers());
        let client_upgrade = websocket.then(|| hyper::upgrade::on(&mut req));
        let host = request_host(&req);
        let stream_input = is_stream_input(req.method(), req.uri().path());
        let (mut parts, body) = req.into_parts();
        rewrite_request_headers(
            &mut parts.headers,
            websocket,
            &Forwarded {
                client_ip: remote.ip().to_canonical(),
                host: host.as_ref(),
                method: &parts.method,
                request_uri: parts.uri.path_and_query().map_or("/", |p| p.as_str()),
                tls: parts.extensions.get::<ClientTls>().is_some(),
            },
        );
        if plan.data_plane {
            parts.headers.remove(API_KEY_HEADER);
        }
        if let Some(r) = &plan.host_route {
            parts.headers.insert(
                SANDBOX_ID_HEADER,
                HeaderValue::from_str(&r.sandbox_id).expect("a DNS label is a valid header"),
            );
            parts
                .headers
                .insert(TARGET_PORT_HEADER, HeaderValue::from(r.port));
        }
        parts.uri = plan.uri;
        parts.version = Version::HTTP_11;
        parts.extensions = http::Extensions::new();
        let method = parts.method.clone();
        let upstream_req = Request::from_parts(parts, body);
        let mut phases = plan.timing;
        if let Some(p) = phases.as_mut() {
            p.skip();
        }

        let start = Instant::now();
        let sent = self.pool.send(upstream_req);
        let result = match plan.deadline {
            Some(d) => match tokio::time::timeout_at(d, sent).await {
                Ok(r) => r.map_err(Some),
                Err(_) => Err(None),
            },
            None => sent.await.map_err(Some),
        };
        let upstream_metric = |status: &'static str| {
            self.inner.metrics.observe_upstream(
                UpstreamLabels {
                    route: plan.route,
                    status,
                },
                start.elapsed().as_secs_f64(),
            );
        };
        let mut resp = match result {
            Ok(r) => r,
            Err(None) => {
                upstream_metric("5xx");
                tracing::warn!(node_id = %plan.node.node_id, "upstream did not answer before the request timeout");
                return error_response(StatusCode::GATEWAY_TIMEOUT, "upstream timeout");
            }
            Err(Some(e)) if caused_by_client_body(&e) => {
                upstream_metric("4xx");
                if stream_input {
                    tracing::debug!(error = %e, "client stopped sending the request body");
                } else {
                    tracing::warn!(error = %e, "client stopped sending the request body");
                }
                return error_response(StatusCode::BAD_REQUEST, "failed to read request body");
            }
            Err(Some(e)) => {
                upstream_metric("5xx");
                tracing::warn!(node_id = %plan.node.node_id, endpoint = %plan.node.endpoint, error = ?e, "upstream request failed");
                return upstream_unavailable(&plan.node);
            }
        };
        upstream_metric(status_label(resp.status().as_u16()));
        if let Some(p) = phases.as_mut() {
            p.mark("upstream");
        }

        if resp.status() == StatusCode::SWITCHING_PROTOCOLS
            && let Some(client_upgrade) = client_upgrade
        {
            let upstream_upgrade = hyper::upgrade::on(&mut resp);
            let guard = self.inner.metrics.connection_guard();
            tokio::spawn(async move {
                let _guard = guard;
                match tokio::try_join!(client_upgrade, upstream_upgrade) {
                    Ok((client, upstream)) => {
                        let mut client = TokioIo::new(client);
                        let mut upstream = TokioIo::new(upstream);
                        if let Err(e) =
                            tokio::io::copy_bidirectional(&mut client, &mut upstream).await
                        {
                            tracing::debug!(error = %e, "upgraded connection ended with an error");
                        }
                    }
                    Err(e) => tracing::debug!(error = %e, "upgrade was not completed"),
                }
            });
        }

        let (parts, body) = resp.into_parts();
        let body = match plan.deadline {
            Some(d) => {
                let mut body = DeadlineBody::new(body, d);
                // Wait for the first frame of an ordinary response, so the
                // head and a small body leave in one write instead of two.
                // Streams (no deadline) are relayed as they come.
                if body.is_end_stream() || plan.record {
                    boxed(body)
                } else {
                    match body.frame().await {
                        Some(Ok(first)) => {
                            *body_complete = body.is_end_stream();
                            boxed(ReplayBody::prefixed(first, body))
                        }
                        Some(Err(e)) if e.is::<BodyDeadlineExceeded>() => {
                            return error_response(StatusCode::GATEWAY_TIMEOUT, "upstream timeout");
                        }
                        Some(Err(e)) => {
                            tracing::warn!(node_id = %plan.node.node_id, error = %e, "upstream response body failed");
                            return upstream_unavailable(&plan.node);
                        }
                        None => empty(),
                    }
                }
            }
            None => boxed(body),
        };
        let mut resp = Response::from_parts(parts, body);
        if plan.record && resp.status().is_success() {
            resp = match Box::pin(self.record_created(resp, &plan.node, &method)).await {
                Ok(r) => r,
                Err(err) => return err,
            };
            if let Some(p) = phases.as_mut() {
                p.mark("record");
            }
        }

        let switching = resp.status() == StatusCode::SWITCHING_PROTOCOLS;
        let (mut parts, body) = resp.into_parts();
        rewrite_response_headers(&mut parts.headers, switching);
        if self.inner.opts.debug_mode
            && let Ok(v) = HeaderValue::from_str(&plan.node.node_id)
        {
            parts.headers.insert(NODE_ID_HEADER, v);
        }
        // A create (scheduled here), or an answer the node timed itself.
        if let Some(p) = &phases
            && (p.has("schedule") || parts.headers.contains_key(SERVER_TIMING))
        {
            p.apply(&mut parts.headers);
        }
        Response::from_parts(parts, body)
    }

    /// RecordAssignment for a successful create or fork. The id comes from
    /// the response header, else (best-effort, bounded) from the JSON body.
    async fn record_created(
        &self,
        resp: Response<GatewayBody>,
        node: &pb::Node,
        method: &Method,
    ) -> Result<Response<GatewayBody>, Response<GatewayBody>> {
        let header_id = sandbox_id_from_headers(resp.headers()).map(str::to_string);
        if let Some(id) = header_id {
            self.record(&[id], node).await;
            return Ok(resp);
        }
        let limit = match self.inner.opts.forward_response_size {
            n if n > 0 => usize::try_from(n).unwrap_or(usize::MAX),
            _ => SNIFF_CAP,
        };
        let (mut parts, body) = resp.into_parts();
        let body = match read_prefix(body, limit).await {
            Err(e) if e.is::<BodyDeadlineExceeded>() => {
                return Err(error_response(
                    StatusCode::GATEWAY_TIMEOUT,
                    "upstream timeout",
                ));
            }
            Err(e) => {
                tracing::warn!(error = %e, "reading the create response failed");
                return Err(error_response(
                    StatusCode::BAD_GATEWAY,
                    "failed to read upstream response",
                ));
            }
            Ok((frames, _, Some(rest))) => {
                tracing::warn!(
                    %method,
                    limit,
                    "create response without a sandbox id header is larger than forward_response_size; \
                     the binding is left to the node's next heartbeat"
                );
                boxed(ReplayBody::new(frames, Some(rest)))
            }
            Ok((frames, len, None)) => {
                let bytes = concat(&frames);
                let ids = extract_sandbox_ids(&bytes);
                if ids.is_empty() {
                    tracing::warn!("create response carries no sandbox id; nothing recorded");
                }
                self.record(&ids, node).await;
                if frames.iter().any(|f| f.is_trailers()) {
                    boxed(ReplayBody::new(frames, None))
                } else {
                    parts.headers.remove(header::TRANSFER_ENCODING);
                    parts
                        .headers
                        .insert(header::CONTENT_LENGTH, HeaderValue::from(len));
                    full(bytes)
                }
            }
        };
        Ok(Response::from_parts(parts, body))
    }

    async fn record(&self, ids: &[String], node: &pb::Node) {
        let deadline = Instant::now() + record_timeout(self.inner.opts.request_timeout);
        for id in ids {
            self.keep_route(id, node);
            let call = self.inner.scheduler.record_assignment(id, node.clone());
            if let Err(status) = self.rpc("RecordAssignment", deadline, call).await {
                tracing::warn!(
                    sandbox_id = %id,
                    node_id = %node.node_id,
                    code = ?status.code(),
                    message = status.message(),
                    "RecordAssignment failed; the node's next heartbeat will bind the sandbox"
                );
            }
        }
    }
}

/// Sandbox ids in a create or fork response body: `sandboxID`, `sandboxId`
/// or `sandbox_id` at the top level, in `data`, and in the items of
/// `sandboxes` and `data.sandboxes`. Blanks skipped, order kept, no repeats.
pub fn extract_sandbox_ids(body: &[u8]) -> Vec<String> {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(body) else {
        return Vec::new();
    };
    let mut out: Vec<String> = Vec::new();
    let mut take = |obj: &serde_json::Value| {
        // A fork answers `[{"sandbox": {...}}, {"error": ...}]`.
        let obj = obj.get("sandbox").unwrap_or(obj);
        for key in ["sandboxID", "sandboxId", "sandbox_id"] {
            if let Some(id) = obj.get(key).and_then(|v| v.as_str()).map(str::trim)
                && !id.is_empty()
                && !out.iter().any(|o| o == id)
            {
                out.push(id.to_string());
            }
        }
    };
    let data = value.get("data");
    take(&value);
    if let Some(items) = value.as_array() {
        items.iter().for_each(&mut take);
    }
    if let Some(d) = data {
        take(d);
    }
    for list in [
        value.get("sandboxes"),
        data.and_then(|d| d.get("sandboxes")),
    ]
    .into_iter()
    .flatten()
    {
        if let Some(items) = list.as_array() {
            items.iter().for_each(&mut take);
        }
    }
    out
}

pub(super) fn request_host<B>(req: &Request<B>) -> Option<HeaderValue> {
    req.headers().get(header::HOST).cloned().or_else(|| {
        req.uri()
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_ids_come_from_top_level_data_and_lists_in_order() {
        assert_eq!(extract_sandbox_ids(br#"{"sandboxID":"a"}"#), ["a"]);
        assert_eq!(
            extract_sandbox_ids(
                br#"[{"sandbox":{"sandboxID":"f1"}},{"error":{"code":500,"message":"x"}},{"sandbox":{"sandboxID":"f2"}}]"#
            ),
            ["f1", "f2"]
        );
        assert_eq!(
            extract_sandbox_ids(br#"{"sandboxId":"a","data":{"sandbox_id":"b"}}"#),
            ["a", "b"]
        );
        assert_eq!(
            extract_sandbox_ids(br#"{"sandboxes":[{"sandboxID":"x"},{"sandboxID":" "},{"sandboxID":"y"},{"sandboxID":"x"}]}"#),
            ["x", "y"]
        );
        assert_eq!(
            extract_sandbox_ids(br#"{"data":{"sandboxes":[{"sandboxID":"z"}]}}"#),
            ["z"]
        );
        assert!(extract_sandbox_ids(b"not json").is_empty());
    }
}

//! Test harness: fake runtime nodes (small hyper servers), a real in-process
//! scheduler from agentenv-sched, and the gateway on a loopback port.

#![allow(dead_code)]

pub mod paging_node;

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use agentenv_core::config::{NodeConfig, SchedulerConfig};
use agentenv_core::proto::scheduler_v1 as pb;
use agentenv_core::proto::scheduler_v1::scheduler_server::Scheduler as _;
use agentenv_proxy::body::{BoxError, GatewayBody, boxed, full};
use agentenv_proxy::{Gateway, GatewayOptions, InProcessScheduler, SchedulerClient};
use agentenv_sched::{Scheduler, SchedulerService};
use async_trait::async_trait;
use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub const API_KEY: &str = "e2b_0123456789abcdef0123456789abcdef0123";
pub const DOMAIN: &str = "sandbox-proxy.example.invalid";

/// One request a fake node received.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    /// Origin-form URI as received (escaped path and query).
    pub uri: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

pub type Log = Arc<Mutex<Vec<Seen>>>;

/// A fake runtime node on loopback.
pub struct FakeNode {
    pub addr: SocketAddr,
    pub endpoint: String,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl FakeNode {
    /// Serves `handler` (HTTP/1.1 with upgrades).
    pub async fn start<F, Fut>(handler: F) -> Self
    where
        F: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Response<GatewayBody>> + Send + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let handler = Arc::new(handler);
        let (stop, mut stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            loop {
                let (stream, _) = tokio::select! {
                    _ = &mut stopped => return,
                    a = listener.accept() => a.unwrap(),
                };
                stream.set_nodelay(true).unwrap();
                let handler = handler.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        let handler = handler.clone();
                        async move { Ok::<_, Infallible>(handler(req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .with_upgrades()
                        .await;
                });
            }
        });
        Self {
            addr,
            endpoint: format!("http://{addr}"),
            stop: Some(stop),
            task,
        }
    }

    /// A node that logs each request and answers it with `answer`.
    pub async fn logging<F>(answer: F) -> (Self, Log)
    where
        F: Fn(&Seen) -> Response<GatewayBody> + Send + Sync + 'static,
    {
        let log: Log = Arc::default();
        let l = log.clone();
        let answer = Arc::new(answer);
        let node = Self::start(move |req| {
            let (l, answer) = (l.clone(), answer.clone());
            async move {
                let seen = read_seen(req).await;
                let resp = answer(&seen);
                l.lock().push(seen);
                resp
            }
        })
        .await;
        (node, log)
    }

    /// A node that answers every request with a JSON echo of what it got,
    /// and logs it.
    pub async fn echo() -> (Self, Log) {
        Self::logging(|seen| {
            let mut resp = Response::new(full(echo_json(seen)));
            resp.headers_mut()
                .insert("content-type", "application/json".parse().unwrap());
            resp
        })
        .await
    }

    /// A node that logs each request and answers `status` with the echo.
    pub async fn start_logging(status: StatusCode) -> (Self, Log) {
        Self::logging(move |seen| {
            let mut resp = Response::new(full(echo_json(seen)));
            *resp.status_mut() = status;
            resp
        })
        .await
    }

    /// A node that logs each request and answers with a fixed response.
    pub async fn canned(
        status: StatusCode,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> (Self, Log) {
        let headers: Vec<(http::HeaderName, http::HeaderValue)> = headers
            .iter()
            .map(|(k, v)| (k.parse().unwrap(), v.parse().unwrap()))
            .collect();
        let body: Bytes = body.into();
        Self::logging(move |_| {
            let mut resp = Response::new(full(body.clone()));
            *resp.status_mut() = status;
            for (k, v) in &headers {
                resp.headers_mut().insert(k.clone(), v.clone());
            }
            resp
        })
        .await
    }

    /// A node that accepts requests and never answers them.
    pub async fn hanging() -> Self {
        Self::start(|_req| std::future::pending()).await
    }

    /// Stops accepting connections (the port then refuses).
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = (&mut self.task).await;
    }
}

impl Drop for FakeNode {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A response body that sends `first` (if any), then neither sends more
/// nor ends.
pub fn stalled_body(first: Option<&'static str>) -> GatewayBody {
    let first = first.map(|b| Ok::<_, BoxError>(Frame::data(Bytes::from_static(b.as_bytes()))));
    boxed(StreamBody::new(futures::StreamExt::chain(
        futures::stream::iter(first),
        futures::stream::pending(),
    )))
}

pub async fn read_seen(req: Request<Incoming>) -> Seen {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    Seen {
        method: parts.method.to_string(),
        uri: parts.uri.to_string(),
        headers: parts.headers,
        body,
    }
}

pub fn echo_json(seen: &Seen) -> String {
    let mut headers: HashMap<String, Vec<String>> = HashMap::new();
    for (k, v) in &seen.headers {
        headers
            .entry(k.as_str().to_string())
            .or_default()
            .push(v.to_str().unwrap_or("").to_string());
    }
    serde_json::json!({
        "method": seen.method,
        "uri": seen.uri,
        "headers": headers,
        "body": String::from_utf8_lossy(&seen.body),
    })
    .to_string()
}

/// Every hint the gateway passed to `Schedule`, in order.
#[derive(Default)]
pub struct HintLog {
    pub hints: Mutex<Vec<Option<pb::ScheduleRequestHint>>>,
}

/// Counts the calls the gateway makes, then asks the real scheduler.
pub struct Counting<C> {
    pub inner: C,
    pub counts: Arc<Mutex<HashMap<&'static str, usize>>>,
    pub hints: Arc<HintLog>,
}

impl<C> Counting<C> {
    fn bump(&self, name: &'static str) {
        *self.counts.lock().entry(name).or_default() += 1;
    }
}

#[async_trait]
impl<C: SchedulerClient> SchedulerClient for Counting<C> {
    async fn schedule(
        &self,
        hint: Option<pb::ScheduleRequestHint>,
    ) -> Result<pb::Node, tonic::Status> {
        self.bump("Schedule");
        self.hints.hints.lock().push(hint.clone());
        self.inner.schedule(hint).await
    }
    async fn lookup_node(&self, sandbox_id: &str) -> Result<pb::Node, tonic::Status> {
        self.bump("LookupNode");
        self.inner.lookup_node(sandbox_id).await
    }
    async fn record_assignment(
        &self,
        sandbox_id: &str,
        node: pb::Node,
    ) -> Result<(), tonic::Status> {
        self.bump("RecordAssignment");
        self.inner.record_assignment(sandbox_id, node).await
    }
    async fn list_nodes(&self) -> Result<Vec<pb::Node>, tonic::Status> {
        self.bump("ListNodes");
        self.inner.list_nodes().await
    }
    async fn list_observed_nodes(
        &self,
        cluster_id: &str,
    ) -> Result<Vec<pb::ObservedNode>, tonic::Status> {
        self.bump("ListObservedNodes");
        self.inner.list_observed_nodes(cluster_id).await
    }
    async fn get_node(
        &self,
        node_id: &str,
        cluster_id: &str,
    ) -> Result<pb::ObservedNode, tonic::Status> {
        self.bump("GetNode");
        self.inner.get_node(node_id, cluster_id).await
    }
    async fn set_draining(
        &self,
        node_id: &str,
        draining: bool,
    ) -> Result<Option<pb::ObservedNode>, tonic::Status> {
        self.bump(if draining { "DrainNode" } else { "UndrainNode" });
        self.inner.set_draining(node_id, draining).await
    }
}

pub fn options() -> GatewayOptions {
    GatewayOptions {
        api_key: API_KEY.into(),
        request_timeout: Duration::from_secs(10),
        forward_response_size: 4 * 1024 * 1024,
        sandbox_proxy_domains: vec![DOMAIN.into()],
        debug_mode: true,
        limits: Default::default(),
        console: Default::default(),
        route_cache_ttl: std::time::Duration::ZERO,
    }
}

/// A node speaking raw HTTP/1.1: `answer` gets each request head (as
/// text) and returns the bytes to send back and whether to close after.
pub struct RawNode {
    pub endpoint: String,
    pub accepted: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl RawNode {
    pub async fn start(answer: impl Fn(&str) -> (Vec<u8>, bool) + Send + Sync + 'static) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let accepted = Arc::new(AtomicUsize::new(0));
        let answer = Arc::new(answer);
        let count = accepted.clone();
        let task = tokio::spawn(async move {
            loop {
                let (mut s, _) = listener.accept().await.unwrap();
                count.fetch_add(1, Ordering::SeqCst);
                let answer = answer.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    loop {
                        let end = loop {
                            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                                break i + 4;
                            }
                            let mut b = [0u8; 4096];
                            match s.read(&mut b).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&b[..n]),
                            }
                        };
                        let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                        buf.drain(..end);
                        let (bytes, close) = answer(&head);
                        if s.write_all(&bytes).await.is_err() || close {
                            return;
                        }
                    }
                });
            }
        });
        Self {
            endpoint,
            accepted,
            task,
        }
    }
}

impl Drop for RawNode {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A real scheduler (in-process) with static nodes, and the gateway in
/// front of it on a loopback port.
pub struct Cluster {
    pub scheduler: SchedulerService,
    pub hints: Arc<HintLog>,
    pub counts: Arc<Mutex<HashMap<&'static str, usize>>>,
    pub gateway: Gateway,
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl Cluster {
    /// Nodes as (id, endpoint); none of them has sent a heartbeat yet.
    pub async fn start(nodes: &[(&str, &str)], opts: GatewayOptions) -> Self {
        let config = SchedulerConfig {
            nodes: nodes
                .iter()
                .map(|(id, ep)| NodeConfig {
                    id: id.to_string(),
                    endpoint: ep.to_string(),
                })
                .collect(),
            ..SchedulerConfig::default()
        };
        let hints = Arc::new(HintLog::default());
        let sched = Scheduler::builder(config).build().unwrap();
        let scheduler = sched.service();
        let counts: Arc<Mutex<HashMap<&'static str, usize>>> = Arc::default();
        let client = Counting {
            inner: InProcessScheduler::new(Arc::new(scheduler.clone())),
            counts: counts.clone(),
            hints: hints.clone(),
        };
        let gateway = Gateway::new(client, opts).unwrap();
        let (addr, stop, task) = serve_gateway(gateway.clone()).await;
        Self {
            scheduler,
            hints,
            counts,
            gateway,
            addr,
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// Nodes that have all reported READY.
    pub async fn ready(nodes: &[(&str, &str)], opts: GatewayOptions) -> Self {
        let c = Self::start(nodes, opts).await;
        for (id, _) in nodes {
            c.heartbeat(id, &[]).await;
        }
        c
    }

    /// A gateway in front of two nodes, `node-a` and `node-b`.
    pub async fn two_nodes(node_a: &FakeNode, node_b: &FakeNode) -> Self {
        let nodes = [("node-a", &*node_a.endpoint), ("node-b", &*node_b.endpoint)];
        Self::ready(&nodes, options()).await
    }

    /// A gateway in front of one node, `node-a` at `endpoint`, that holds
    /// sandbox `sbx-1`.
    pub async fn with_sandbox(endpoint: &str, opts: GatewayOptions) -> Self {
        let c = Self::ready(&[("node-a", endpoint)], opts).await;
        c.heartbeat("node-a", &["sbx-1"]).await;
        c
    }

    pub async fn heartbeat(&self, node_id: &str, sandbox_ids: &[&str]) {
        self.heartbeat_in(node_id, "", sandbox_ids).await;
    }

    pub async fn heartbeat_in(&self, node_id: &str, cluster_id: &str, sandbox_ids: &[&str]) {
        self.scheduler
            .heartbeat(tonic::Request::new(pb::HeartbeatRequest {
                node_id: node_id.into(),
                cluster_id: cluster_id.into(),
                service_instance_id: format!("{node_id}-instance"),
                snapshot: Some(pb::NodeSnapshot {
                    status: pb::NodeStatus::Ready as i32,
                    ..Default::default()
                }),
                sandbox_ids: sandbox_ids.iter().map(|s| s.to_string()).collect(),
                ..Default::default()
            }))
            .await
            .unwrap();
    }

    pub async fn lookup(&self, sandbox_id: &str) -> Result<pb::Node, tonic::Status> {
        self.scheduler
            .lookup_node(tonic::Request::new(pb::LookupNodeRequest {
                sandbox_id: sandbox_id.into(),
            }))
            .await
            .map(|r| r.into_inner().node.unwrap_or_default())
    }

    pub fn count(&self, rpc: &str) -> usize {
        self.counts.lock().get(rpc).copied().unwrap_or(0)
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn metrics_text(&self) -> String {
        agentenv_core::metrics::render(&self.gateway.metrics().registry().lock())
    }

    /// Triggers graceful shutdown and waits for the server loop to end.
    pub async fn shutdown(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            t.await.unwrap();
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Some(t) = &self.task {
            t.abort();
        }
    }
}

pub async fn serve_gateway(gateway: Gateway) -> (SocketAddr, oneshot::Sender<()>, JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        gateway
            .serve(listener, async move {
                let _ = stopped.await;
            })
            .await
    });
    (addr, stop, task)
}

pub type TestClient = Client<HttpConnector, Full<Bytes>>;

pub fn client() -> TestClient {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

/// Sends `req` and collects the answer.
pub async fn send(req: Request<Full<Bytes>>) -> (StatusCode, HeaderMap, Bytes) {
    let resp = client().request(req).await.unwrap();
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    (parts.status, parts.headers, body)
}

/// A GET with the API key.
pub async fn get(url: &str) -> (StatusCode, HeaderMap, Bytes) {
    send(
        Request::get(url)
            .header("x-api-key", API_KEY)
            .body(Full::default())
            .unwrap(),
    )
    .await
}

pub fn json(bytes: &[u8]) -> serde_json::Value {
    serde_json::from_slice(bytes)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(bytes)))
}

/// The JSON error body's message.
pub fn message(bytes: &[u8]) -> String {
    json(bytes)["message"].as_str().unwrap().to_string()
}

/// Polls `cond` every 5 ms until it holds, for at most 5 s (see
/// [`agentenv_testkit::Wait`]).
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    agentenv_testkit::Wait::new(what, Duration::from_secs(5))
        .every(Duration::from_millis(5))
        .until(|| std::future::ready(cond()))
        .await
}

/// Sends `req`, asserts a 200 and returns the body, still streaming.
pub async fn open_ok(req: Request<Full<Bytes>>) -> Incoming {
    let resp = client().request(req).await.expect("a response");
    assert_eq!(resp.status(), StatusCode::OK);
    resp.into_body()
}

/// The next data frame of a streaming response body.
pub async fn next_data(body: &mut Incoming) -> Bytes {
    body.frame()
        .await
        .expect("a frame")
        .expect("a readable frame")
        .into_data()
        .expect("a data frame")
}

/// Request-builder shorthands: the routing headers of a request to a sandbox's port, an
/// empty body.
pub trait Route {
    /// E2B's: `e2b-sandbox-id` and `e2b-sandbox-port`.
    fn e2b_route(self, sandbox: &str, port: &str) -> Self;
    /// The gateway's own: `x-agentenv-sandbox-id` and `x-agentenv-target-port`.
    fn agentenv_route(self, sandbox: &str, port: &str) -> Self;
    /// The request with an empty body.
    fn empty(self) -> Request<Full<Bytes>>;
}

impl Route for http::request::Builder {
    fn e2b_route(self, sandbox: &str, port: &str) -> Self {
        self.header("e2b-sandbox-id", sandbox)
            .header("e2b-sandbox-port", port)
    }
    fn agentenv_route(self, sandbox: &str, port: &str) -> Self {
        self.header("x-agentenv-sandbox-id", sandbox)
            .header("x-agentenv-target-port", port)
    }
    fn empty(self) -> Request<Full<Bytes>> {
        self.body(Full::default()).expect("a valid request")
    }
}

/// The value of a gauge or counter line in Prometheus text.
pub fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

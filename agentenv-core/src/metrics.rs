//! Prometheus helpers: the shared histogram buckets, gRPC status labels and a
//! small HTTP server that exposes a registry at `/metrics`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

/// Latency buckets in seconds, shared by every component.
pub const LATENCY_BUCKETS: [f64; 21] = [
    0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
    300.0, 600.0, 900.0, 1200.0, 1800.0,
];

/// A histogram with [`LATENCY_BUCKETS`].
pub fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}

/// The `status` label for a gRPC outcome.
pub fn grpc_status_label(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "ok",
        Cancelled => "canceled",
        InvalidArgument => "invalid_argument",
        NotFound => "not_found",
        FailedPrecondition => "failed_precondition",
        Unavailable => "unavailable",
        DeadlineExceeded => "deadline_exceeded",
        Internal => "internal",
        _ => "other",
    }
}

/// A registry shared between the code that records and the HTTP endpoint.
pub type SharedRegistry = Arc<Mutex<Registry>>;

/// Renders the registry in the Prometheus text format.
pub fn render(registry: &Registry) -> String {
    let mut out = String::new();
    encode(&mut out, registry).expect("writing to a String cannot fail");
    out
}

/// Serves `GET /metrics` for `registry` on `listener` until `shutdown`
/// resolves. Other paths answer 404.
pub async fn serve(
    listener: TcpListener,
    registry: SharedRegistry,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) {
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, _) = tokio::select! {
            _ = &mut shutdown => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "metrics listener accept failed");
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let registry = registry.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                let registry = registry.clone();
                async move {
                    let resp = if req.uri().path() == "/metrics" {
                        let body = render(&registry.lock());
                        Response::builder()
                            .header(
                                "content-type",
                                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                            )
                            .body(Full::new(Bytes::from(body)))
                    } else {
                        Response::builder()
                            .status(StatusCode::NOT_FOUND)
                            .body(Full::new(Bytes::from_static(b"not found\n")))
                    };
                    Ok::<_, Infallible>(resp.expect("static response parts are valid"))
                }
            });
            let _ = crate::serving::server_builder(crate::serving::DEFAULT_HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

/// Binds `addr` and serves the registry on it (see [`serve`]).
pub async fn bind_and_serve(
    addr: SocketAddr,
    registry: SharedRegistry,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let listener = TcpListener::bind(addr).await?;
    Ok(tokio::spawn(serve(listener, registry, shutdown)))
}

/// The `method` label of a request: one of the standard methods, or `OTHER`, so
/// clients cannot grow the number of series by inventing methods.
pub fn method_label(method: &hyper::Method) -> &'static str {
    use hyper::Method;
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::PATCH => "PATCH",
        Method::DELETE => "DELETE",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        _ => "OTHER",
    }
}

/// The `status` label of an HTTP status: its class (`2xx`…), or `other`.
pub fn status_label(status: u16) -> &'static str {
    match status {
        100..=199 => "1xx",
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        500..=599 => "5xx",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_codes_map_to_labels() {
        assert_eq!(grpc_status_label(tonic::Code::Ok), "ok");
        assert_eq!(grpc_status_label(tonic::Code::Unavailable), "unavailable");
        assert_eq!(grpc_status_label(tonic::Code::Cancelled), "canceled");
        assert_eq!(grpc_status_label(tonic::Code::ResourceExhausted), "other");
    }

    #[tokio::test]
    async fn serves_registry_text_at_metrics_path() {
        let mut reg = Registry::default();
        let c = prometheus_client::metrics::counter::Counter::<u64>::default();
        reg.register("agentenv_test_things", "Things", c.clone());
        c.inc();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(serve(listener, Arc::new(Mutex::new(reg)), async move {
            let _ = rx.await;
        }));
        let body = http_get(addr, "/metrics").await;
        assert!(body.contains("agentenv_test_things_total 1"), "{body}");
        let missing = http_get(addr, "/other").await;
        assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
        tx.send(()).unwrap();
        task.await.unwrap();
    }

    async fn http_get(addr: SocketAddr, path: &str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }
}

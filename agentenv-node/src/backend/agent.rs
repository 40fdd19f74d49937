//! Readiness of the guest agent, the same for every backend: `GET /health` answers 204.

use std::net::SocketAddr;
use std::time::Duration;

use http_body_util::Empty;
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::Instant;

/// How long one connection attempt may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_millis(100);

/// Errors while waiting for an agent.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("the agent at {addr} did not answer GET /health with 204 within {timeout:?}: {last}")]
    NotReady {
        addr: SocketAddr,
        timeout: Duration,
        last: String,
    },
}

/// One `GET /health`; `Ok(())` when the agent answers 204.
pub async fn probe_health(addr: SocketAddr) -> Result<(), String> {
    // A SYN lost while a fresh link settles would otherwise wait for the kernel's 1 s
    // retransmission; a new attempt is cheaper.
    let stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| format!("connect: no answer within {CONNECT_TIMEOUT:?}"))?
        .map_err(|e| format!("connect: {e}"))?;
    stream
        .set_nodelay(true)
        .map_err(|e| format!("TCP_NODELAY: {e}"))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    let conn = tokio::spawn(conn);
    let req = hyper::Request::get("/health")
        .header(hyper::header::HOST, addr.to_string())
        .body(Empty::<Bytes>::new())
        .map_err(|e| format!("request: {e}"))?;
    let resp = sender
        .send_request(req)
        .await
        .map_err(|e| format!("request: {e}"));
    conn.abort();
    let resp = resp?;
    if resp.status() == hyper::StatusCode::NO_CONTENT {
        Ok(())
    } else {
        Err(format!("status {}", resp.status()))
    }
}

/// Polls `GET /health` every `poll` until it answers 204 or `timeout` passes.
pub async fn wait_ready(
    addr: SocketAddr,
    timeout: Duration,
    poll: Duration,
) -> Result<(), AgentError> {
    let deadline = Instant::now() + timeout;
    loop {
        let attempt = tokio::time::timeout_at(deadline, probe_health(addr)).await;
        let last = match attempt {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => e,
            Err(_) => "timed out".to_string(),
        };
        if Instant::now() + poll >= deadline {
            return Err(AgentError::NotReady {
                addr,
                timeout,
                last,
            });
        }
        tokio::time::sleep(poll).await;
    }
}

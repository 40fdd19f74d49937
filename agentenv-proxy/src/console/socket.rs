//! The WebSocket side both sockets share: accepting the upgrade (hyper's
//! upgrade, tungstenite's framing), closing with a code, and watching the
//! session that opened the socket.

use std::sync::Arc;
use std::time::Duration;

use futures::SinkExt;
use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::frame::CloseFrame;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};

use super::{Console, Refusal, err};
use crate::body::{GatewayBody, empty};

/// An accepted WebSocket over the client's connection.
pub(crate) type Socket = WebSocketStream<TokioIo<hyper::upgrade::Upgraded>>;

/// The largest message or frame a page may send (a paste into the terminal).
const MAX_MESSAGE: usize = 1024 * 1024;

/// Small buffers: a hundred open pages must stay cheap.
fn config() -> WebSocketConfig {
    WebSocketConfig::default()
        .read_buffer_size(8 * 1024)
        .write_buffer_size(8 * 1024)
        .max_message_size(Some(MAX_MESSAGE))
        .max_frame_size(Some(MAX_MESSAGE))
}

/// How often a socket checks that its session still lives.
const SESSION_CHECK: Duration = Duration::from_secs(5);

/// Checks the upgrade request; the `101` answer and the socket to come.
pub(crate) fn accept(
    req: &mut Request<GatewayBody>,
) -> Result<(Response<GatewayBody>, hyper::upgrade::OnUpgrade), Refusal> {
    if !crate::routing::is_websocket(req.headers()) {
        return Err(Box::new(err(
            StatusCode::BAD_REQUEST,
            "this path is a WebSocket: open it with an upgrade",
        )));
    }
    let version_ok = req
        .headers()
        .get(header::SEC_WEBSOCKET_VERSION)
        .is_some_and(|v| v.as_bytes() == b"13");
    let Some(key) = req.headers().get(header::SEC_WEBSOCKET_KEY).cloned() else {
        return Err(Box::new(err(
            StatusCode::BAD_REQUEST,
            "Sec-WebSocket-Key is missing",
        )));
    };
    if !version_ok {
        return Err(Box::new(err(
            StatusCode::BAD_REQUEST,
            "only WebSocket version 13 is spoken",
        )));
    }
    let on_upgrade = hyper::upgrade::on(req);
    let mut resp = Response::new(empty());
    *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = resp.headers_mut();
    h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    h.insert(
        header::SEC_WEBSOCKET_ACCEPT,
        HeaderValue::from_str(&derive_accept_key(key.as_bytes()))
            .expect("base64 is a valid header"),
    );
    Ok((resp, on_upgrade))
}

/// The socket once the client's connection is upgraded.
pub(crate) async fn upgraded(on: hyper::upgrade::OnUpgrade) -> Option<Socket> {
    match on.await {
        Ok(io) => Some(
            WebSocketStream::from_raw_socket(TokioIo::new(io), Role::Server, Some(config())).await,
        ),
        Err(e) => {
            tracing::debug!(error = %e, "console WebSocket upgrade failed");
            None
        }
    }
}

/// Sends a close frame with `code` and `reason`.
pub(crate) async fn close<S>(sink: &mut S, code: u16, reason: &str)
where
    S: futures::Sink<Message> + Unpin,
{
    let frame = CloseFrame {
        code: CloseCode::from(code),
        reason: reason.to_string().into(),
    };
    let _ = sink.send(Message::Close(Some(frame))).await;
    let _ = sink.close().await;
}

/// Resolves when the session `token` ends (signed out, expired, dropped).
pub(crate) async fn session_ended(console: Arc<Console>, token: String) {
    let Some(mut gone) = console.sessions.watch(&token) else {
        return;
    };
    let mut check = tokio::time::interval(SESSION_CHECK);
    loop {
        tokio::select! {
            changed = gone.changed() => if changed.is_err() { return },
            _ = check.tick() => if !console.sessions.alive(&token) { return },
        }
    }
}

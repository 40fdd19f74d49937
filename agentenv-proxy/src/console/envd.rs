//! Calls the console makes through the gateway itself: control-plane calls
//! with the API key, and calls to a sandbox's agent (envd) as data-plane
//! requests (`LookupNode`, then the sandbox's node), so routing, upstream
//! TLS and connection pools are the ones every client request uses.
//!
//! The agent speaks Connect with the JSON codec: unary calls are
//! `application/json` bodies, server streams `application/connect+json`
//! envelopes (a flag byte, a big-endian length, the message; flag `0x02`
//! marks the end-of-stream message, which may carry an error).

use std::net::SocketAddr;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::BodyExt;

use super::{Refusal, err};
use crate::body::{GatewayBody, empty, full};
use crate::routing::{API_KEY_HEADER, SANDBOX_ID_HEADER, TARGET_PORT_HEADER};
use crate::server::Gateway;

/// The agent's port in a sandbox.
pub(crate) const ENVD_PORT: u16 = 49983;
/// The largest unary answer read from the agent or the API.
const ANSWER_LIMIT: usize = 16 * 1024 * 1024;

/// Sends `method path` to the gateway's own API with its key.
pub(crate) async fn api(
    gateway: &Gateway,
    remote: SocketAddr,
    method: Method,
    path_and_query: &str,
    content_type: Option<HeaderValue>,
    body: GatewayBody,
) -> Response<GatewayBody> {
    let mut req = Request::new(body);
    *req.method_mut() = method;
    *req.uri_mut() = match path_and_query.parse() {
        Ok(u) => u,
        Err(_) => return err(StatusCode::BAD_REQUEST, "invalid API path"),
    };
    let key = HeaderValue::from_str(gateway.api_key()).expect("the API key is a valid header");
    req.headers_mut().insert(API_KEY_HEADER, key);
    if let Some(ct) = content_type {
        req.headers_mut().insert(header::CONTENT_TYPE, ct);
    }
    gateway.internal(req, remote).await
}

/// Reads a whole (bounded) answer body.
pub(crate) async fn read_all(body: GatewayBody) -> Option<Bytes> {
    collect(body, ANSWER_LIMIT).await.ok()
}

/// Why [`collect`] stopped.
pub(crate) enum Collect {
    TooLarge,
    Failed,
}

/// A body's bytes, at most `limit` of them.
pub(crate) async fn collect(mut body: GatewayBody, limit: usize) -> Result<Bytes, Collect> {
    let mut out = BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|_| Collect::Failed)?;
        if let Ok(data) = frame.into_data() {
            if out.len() + data.len() > limit {
                return Err(Collect::TooLarge);
            }
            out.extend_from_slice(&data);
        }
    }
    Ok(out.freeze())
}

/// The `message` of a JSON error body, else the body as text (bounded).
fn message_of(body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            v.get("message")
                .and_then(|m| m.as_str())
                .map(str::to_string)
        })
        .unwrap_or_else(|| String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned())
}

/// A sandbox's agent, reached through the gateway.
#[derive(Clone)]
pub(crate) struct Agent {
    gateway: Gateway,
    remote: SocketAddr,
    id: String,
    token: Option<HeaderValue>,
}

impl Agent {
    /// Looks sandbox `id` up (`GET /sandboxes/{id}`) for its agent's access
    /// token. The error answers: 404 no such sandbox, 409 paused.
    pub(crate) async fn find(
        gateway: &Gateway,
        remote: SocketAddr,
        id: &str,
    ) -> Result<Agent, Refusal> {
        let resp = api(
            gateway,
            remote,
            Method::GET,
            &format!("/sandboxes/{id}"),
            None,
            empty(),
        )
        .await;
        let status = resp.status();
        let body = read_all(resp.into_body()).await.unwrap_or_default();
        if status == StatusCode::NOT_FOUND {
            return Err(Box::new(err(
                StatusCode::NOT_FOUND,
                &format!("no sandbox {id}: it was killed or never existed"),
            )));
        }
        if !status.is_success() {
            return Err(Box::new(err(
                status,
                &format!("looking up sandbox {id} failed: {}", message_of(&body)),
            )));
        }
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        if v["state"] == "paused" {
            return Err(Box::new(err(
                StatusCode::CONFLICT,
                &format!("sandbox {id} is paused: resume it first"),
            )));
        }
        let token = v["envdAccessToken"]
            .as_str()
            .and_then(|t| HeaderValue::from_str(t).ok());
        Ok(Agent {
            gateway: gateway.clone(),
            remote,
            id: id.to_string(),
            token,
        })
    }

    /// A request to the agent's `path_and_query`.
    pub(crate) fn request(
        &self,
        method: Method,
        path_and_query: &str,
        content_type: Option<&'static str>,
        body: GatewayBody,
    ) -> Request<GatewayBody> {
        let mut req = Request::new(body);
        *req.method_mut() = method;
        *req.uri_mut() = path_and_query
            .parse()
            .unwrap_or_else(|_| "/".parse().unwrap());
        let h = req.headers_mut();
        h.insert(
            SANDBOX_ID_HEADER,
            HeaderValue::from_str(&self.id).expect("a checked sandbox id is a valid header"),
        );
        h.insert(TARGET_PORT_HEADER, HeaderValue::from(ENVD_PORT));
        if let Some(t) = &self.token {
            h.insert("x-access-token", t.clone());
        }
        if let Some(ct) = content_type {
            h.insert(header::CONTENT_TYPE, HeaderValue::from_static(ct));
        }
        req
    }

    /// Sends a request made by [`Agent::request`] through the gateway.
    pub(crate) async fn send(&self, req: Request<GatewayBody>) -> Response<GatewayBody> {
        self.gateway.internal(req, self.remote).await
    }

    /// A unary Connect call (`/<service>/<method>`) with a JSON message.
    pub(crate) async fn unary(
        &self,
        procedure: &str,
        msg: &serde_json::Value,
    ) -> Result<serde_json::Value, CallError> {
        let req = self.request(
            Method::POST,
            procedure,
            Some("application/json"),
            full(msg.to_string()),
        );
        let resp = self.send(req).await;
        let status = resp.status();
        let body = read_all(resp.into_body()).await.unwrap_or_default();
        if !status.is_success() {
            return Err(CallError {
                status,
                message: message_of(&body),
            });
        }
        Ok(serde_json::from_slice(&body).unwrap_or_default())
    }

    /// Opens a server-streaming Connect call with a JSON message.
    pub(crate) async fn stream(
        &self,
        procedure: &str,
        msg: &serde_json::Value,
    ) -> Result<Envelopes, CallError> {
        let payload = msg.to_string();
        let mut framed = Vec::with_capacity(payload.len() + 5);
        framed.push(0);
        framed.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        framed.extend_from_slice(payload.as_bytes());
        let req = self.request(
            Method::POST,
            procedure,
            Some("application/connect+json"),
            full(framed),
        );
        let resp = self.send(req).await;
        let status = resp.status();
        if !status.is_success() {
            let body = read_all(resp.into_body()).await.unwrap_or_default();
            return Err(CallError {
                status,
                message: message_of(&body),
            });
        }
        Ok(Envelopes {
            body: resp.into_body(),
            buf: BytesMut::new(),
        })
    }
}

/// A failed call to the agent.
#[derive(Debug)]
pub(crate) struct CallError {
    pub(crate) status: StatusCode,
    pub(crate) message: String,
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.status.as_u16())
    }
}

/// The messages of a Connect server stream.
pub(crate) struct Envelopes {
    body: GatewayBody,
    buf: BytesMut,
}

/// The largest message accepted from a stream.
const MESSAGE_LIMIT: usize = 16 * 1024 * 1024;

impl Envelopes {
    /// The next message: `Ok(Some)` a message, `Ok(None)` the stream ended
    /// cleanly, `Err` it ended with an error or broke.
    pub(crate) async fn next(&mut self) -> Result<Option<serde_json::Value>, String> {
        loop {
            if self.buf.len() >= 5 {
                let flags = self.buf[0];
                let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]])
                    as usize;
                if len > MESSAGE_LIMIT {
                    return Err("the agent sent a message over 16 MiB".into());
                }
                if self.buf.len() >= 5 + len {
                    self.buf.advance(5);
                    let msg = self.buf.split_to(len);
                    let v: serde_json::Value = serde_json::from_slice(&msg)
                        .map_err(|e| format!("the agent sent a message that is not JSON: {e}"))?;
                    if flags & 0x02 != 0 {
                        return match v.get("error") {
                            Some(e) if !e.is_null() => Err(e
                                .get("message")
                                .and_then(|m| m.as_str())
                                .unwrap_or("the agent ended the stream with an error")
                                .to_string()),
                            _ => Ok(None),
                        };
                    }
                    return Ok(Some(v));
                }
            }
            match self.body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
                Some(Err(e)) => return Err(format!("the stream from the agent broke: {e}")),
                None if self.body.is_end_stream() || self.buf.is_empty() => {
                    return Err("the stream from the agent ended early".into());
                }
                None => return Err("the stream from the agent ended mid-message".into()),
            }
        }
    }
}

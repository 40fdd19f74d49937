//! The three Connect call shapes on the client side, binary codec:
//! unary, server streaming (a [`ResponseStream`]), client streaming.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};

use crate::connect::{
    Codec, ConnectError, ConnectMessage, Envelope, FLAG_END_STREAM, MAX_MESSAGE_BYTES,
    encode_envelope, envelope_stream, parse_end_stream,
};

use super::transport::{ClientError, GuestClient, ReqBody, full_body};

impl GuestClient {
    /// One unary call, e.g. `unary("/process.Process/List", &ListRequest{})`.
    pub async fn unary<Req: ConnectMessage, Resp: ConnectMessage>(
        &self,
        path: &str,
        msg: &Req,
    ) -> Result<Resp, ClientError> {
        let body = full_body(msg.encode_to_vec());
        let resp = self.post_connect(path, "application/proto", body).await?;
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|source| ClientError::Body {
                path: path.to_string(),
                source,
            })?
            .to_bytes();
        Codec::Proto
            .decode(&body)
            .map_err(|e| ClientError::Protocol {
                path: path.to_string(),
                reason: e.message,
            })
    }

    /// Opens a streaming call whose request messages are `body`.
    async fn open_stream<Resp: ConnectMessage>(
        &self,
        path: &str,
        body: ReqBody,
    ) -> Result<ResponseStream<Resp>, ClientError> {
        let resp = self
            .post_connect(path, "application/connect+proto", body)
            .await?;
        Ok(ResponseStream {
            inner: envelope_stream(resp.into_body(), MAX_MESSAGE_BYTES),
            path: path.to_string(),
            done: false,
            _t: std::marker::PhantomData,
        })
    }

    /// A server-streaming call.
    pub async fn server_stream<Req: ConnectMessage, Resp: ConnectMessage>(
        &self,
        path: &str,
        msg: &Req,
    ) -> Result<ResponseStream<Resp>, ClientError> {
        let env = encode_envelope(0, &msg.encode_to_vec());
        self.open_stream(path, full_body(env)).await
    }

    /// A client-streaming call: sends every message of `msgs`, then reads
    /// the single response.
    pub async fn client_stream<Req, Resp, S>(
        &self,
        path: &str,
        msgs: S,
    ) -> Result<Resp, ClientError>
    where
        Req: ConnectMessage,
        Resp: ConnectMessage,
        S: Stream<Item = Req> + Send + 'static,
    {
        let frames =
            msgs.map(|m| Ok::<_, io::Error>(Frame::data(encode_envelope(0, &m.encode_to_vec()))));
        let body = StreamBody::new(frames).boxed_unsync();
        let mut rs: ResponseStream<Resp> = self.open_stream(path, body).await?;
        let first = rs.next().await.ok_or_else(|| ClientError::Protocol {
            path: path.to_string(),
            reason: "the response stream ended without a message".into(),
        })??;
        // Drain the end-of-stream envelope (and any error in it).
        while let Some(r) = rs.next().await {
            r?;
        }
        Ok(first)
    }
}

/// Decoded messages of a streaming response; an error in the end-of-stream
/// envelope is yielded as the last item.
pub struct ResponseStream<T> {
    inner: BoxStream<'static, Result<Envelope, ConnectError>>,
    path: String,
    done: bool,
    _t: std::marker::PhantomData<fn() -> T>,
}

impl<T: ConnectMessage> Stream for ResponseStream<T> {
    type Item = Result<T, ClientError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.done {
            return Poll::Ready(None);
        }
        let path = self.path.clone();
        let proto = |reason: String| ClientError::Protocol {
            path: path.clone(),
            reason,
        };
        match self.inner.poll_next_unpin(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(None) => {
                self.done = true;
                Poll::Ready(Some(Err(proto(
                    "the stream ended without an end-of-stream envelope".into(),
                ))))
            }
            Poll::Ready(Some(Err(e))) => {
                self.done = true;
                Poll::Ready(Some(Err(ClientError::Rpc { path, source: e })))
            }
            Poll::Ready(Some(Ok(env))) => {
                if env.flags & FLAG_END_STREAM != 0 {
                    self.done = true;
                    return match parse_end_stream(&env.payload) {
                        Ok(None) => Poll::Ready(None),
                        Ok(Some(e)) => Poll::Ready(Some(Err(ClientError::Rpc { path, source: e }))),
                        Err(r) => Poll::Ready(Some(Err(proto(r)))),
                    };
                }
                Poll::Ready(Some(
                    Codec::Proto
                        .decode::<T>(&env.payload)
                        .map_err(|e| proto(e.message)),
                ))
            }
        }
    }
}

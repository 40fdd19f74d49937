//! Connect streaming framing: the one envelope encoder and decoder of the
//! workspace, for servers and clients alike.
//!
//! A streaming body is a sequence of envelopes: 1 flag byte, a 4-byte
//! big-endian payload length, the payload. A server ends its stream with an
//! end-of-stream envelope (flag [`FLAG_END_STREAM`]) whose JSON payload is
//! `{}` or `{"error":{"code":"...","message":"..."}}`.
//!
//! ```
//! use agentenv_guest::connect::envelope::{
//!     FLAG_END_STREAM, decode_envelopes, encode_envelope, end_stream_envelope,
//!     parse_end_stream,
//! };
//! let mut body = encode_envelope(0, br#"{"a":1}"#).to_vec();
//! body.extend_from_slice(&end_stream_envelope(None));
//! let envs = decode_envelopes(&body, 1024).unwrap();
//! assert_eq!(&envs[0].payload[..], br#"{"a":1}"#);
//! assert_eq!(envs[1].flags, FLAG_END_STREAM);
//! assert!(parse_end_stream(&envs[1].payload).unwrap().is_none());
//! // A cut-off stream is an error, not a shorter list.
//! assert!(decode_envelopes(&body[..3], 1024).is_err());
//! ```

use bytes::{Buf, BufMut, Bytes, BytesMut};
use futures::stream::{BoxStream, StreamExt};
use http_body::Body;
use http_body_util::BodyExt;

use super::error::{Code, ConnectError};

/// Envelope flag: the payload is compressed.
pub const FLAG_COMPRESSED: u8 = 0x01;
/// Envelope flag: end of stream (a JSON trailer message).
pub const FLAG_END_STREAM: u8 = 0x02;

/// Frames one payload as an envelope.
pub fn encode_envelope(flags: u8, payload: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + payload.len());
    b.put_u8(flags);
    b.put_u32(payload.len() as u32);
    b.put_slice(payload);
    b.freeze()
}

/// The end-of-stream envelope: `{}` or `{"error":{...}}`.
pub fn end_stream_envelope(err: Option<&ConnectError>) -> Bytes {
    let json = match err {
        None => serde_json::json!({}),
        Some(e) => serde_json::json!({"error": e.to_json()}),
    };
    encode_envelope(
        FLAG_END_STREAM,
        &serde_json::to_vec(&json).unwrap_or_default(),
    )
}

/// One decoded envelope.
#[derive(Debug, Clone)]
pub struct Envelope {
    /// [`FLAG_COMPRESSED`], [`FLAG_END_STREAM`], or 0 for a plain message.
    pub flags: u8,
    pub payload: Bytes,
}

/// Incremental envelope parser: [`push`](Self::push) bytes as they come,
/// take envelopes with [`next_envelope`](Self::next_envelope), and call
/// [`finish`](Self::finish) at the end of the body.
#[derive(Debug)]
pub struct EnvelopeDecoder {
    buf: BytesMut,
    max: usize,
}

impl EnvelopeDecoder {
    /// A decoder that refuses payloads larger than `max` bytes.
    pub fn new(max: usize) -> Self {
        EnvelopeDecoder {
            buf: BytesMut::new(),
            max,
        }
    }

    /// Buffers more of the body.
    pub fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// The next complete envelope, if one is buffered.
    pub fn next_envelope(&mut self) -> Result<Option<Envelope>, ConnectError> {
        if self.buf.len() < 5 {
            return Ok(None);
        }
        let flags = self.buf[0];
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if len > self.max {
            return Err(ConnectError::new(
                Code::ResourceExhausted,
                format!(
                    "message of {len} bytes is larger than the limit of {} bytes",
                    self.max
                ),
            ));
        }
        if self.buf.len() < 5 + len {
            return Ok(None);
        }
        self.buf.advance(5);
        let payload = self.buf.split_to(len).freeze();
        Ok(Some(Envelope { flags, payload }))
    }

    /// Checks that no partial envelope is left when the body ended.
    pub fn finish(&self) -> Result<(), ConnectError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(ConnectError::invalid_argument(format!(
                "body ended inside an envelope ({} bytes left over): the request was truncated",
                self.buf.len()
            )))
        }
    }
}

/// Every envelope of a whole body held in memory; an error when a payload
/// is larger than `max` or the body ends inside an envelope.
pub fn decode_envelopes(body: &[u8], max: usize) -> Result<Vec<Envelope>, ConnectError> {
    let mut dec = EnvelopeDecoder::new(max);
    dec.push(body);
    let mut out = Vec::new();
    while let Some(env) = dec.next_envelope()? {
        out.push(env);
    }
    dec.finish()?;
    Ok(out)
}

/// The error an end-of-stream payload carries, if any (the inverse of
/// [`end_stream_envelope`]); `Err` with the reason when it is not JSON.
pub fn parse_end_stream(payload: &[u8]) -> Result<Option<ConnectError>, String> {
    if payload.is_empty() {
        return Ok(None);
    }
    let v: serde_json::Value =
        serde_json::from_slice(payload).map_err(|e| format!("end-of-stream is not JSON: {e}"))?;
    match v.get("error") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(e) => {
            let code = e.get("code").and_then(|c| c.as_str()).unwrap_or("unknown");
            let message = e.get("message").and_then(|m| m.as_str()).unwrap_or("");
            Ok(Some(ConnectError::new(Code::parse(code), message)))
        }
    }
}

/// Turns a body into a stream of envelopes, each payload at most `max`
/// bytes; a body that ends inside an envelope ends the stream with an error.
pub fn envelope_stream<B>(body: B, max: usize) -> BoxStream<'static, Result<Envelope, ConnectError>>
where
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: std::fmt::Display,
{
    struct St<B> {
        body: B,
        dec: EnvelopeDecoder,
        done: bool,
    }
    let st = St {
        body,
        dec: EnvelopeDecoder::new(max),
        done: false,
    };
    futures::stream::unfold(st, |mut st| async move {
        if st.done {
            return None;
        }
        loop {
            match st.dec.next_envelope() {
                Ok(Some(env)) => return Some((Ok(env), st)),
                Ok(None) => {}
                Err(e) => {
                    st.done = true;
                    return Some((Err(e), st));
                }
            }
            match st.body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        st.dec.push(&data);
                    }
                }
                Some(Err(e)) => {
                    st.done = true;
                    return Some((
                        Err(ConnectError::new(
                            Code::Canceled,
                            format!("reading request body: {e}"),
                        )),
                        st,
                    ));
                }
                None => {
                    st.done = true;
                    return match st.dec.finish() {
                        Ok(()) => None,
                        Err(e) => Some((Err(e), st)),
                    };
                }
            }
        }
    })
    .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_round_trip_and_partial_input() {
        let a = encode_envelope(0, b"hello");
        let b = end_stream_envelope(None);
        let mut all = BytesMut::new();
        all.extend_from_slice(&a);
        all.extend_from_slice(&b);
        let mut dec = EnvelopeDecoder::new(1024);
        dec.push(&all[..3]);
        assert!(dec.next_envelope().unwrap().is_none());
        dec.push(&all[3..]);
        let e1 = dec.next_envelope().unwrap().unwrap();
        assert_eq!((e1.flags, &e1.payload[..]), (0, &b"hello"[..]));
        let e2 = dec.next_envelope().unwrap().unwrap();
        assert_eq!((e2.flags, &e2.payload[..]), (FLAG_END_STREAM, &b"{}"[..]));
        assert!(dec.finish().is_ok());
    }

    #[test]
    fn oversized_envelope_is_resource_exhausted() {
        let mut dec = EnvelopeDecoder::new(4);
        dec.push(&encode_envelope(0, b"too long"));
        assert_eq!(
            dec.next_envelope().unwrap_err().code,
            Code::ResourceExhausted
        );
    }

    #[test]
    fn truncated_envelope_fails_finish() {
        let mut dec = EnvelopeDecoder::new(1024);
        dec.push(&encode_envelope(0, b"hello")[..6]);
        assert!(dec.next_envelope().unwrap().is_none());
        assert_eq!(dec.finish().unwrap_err().code, Code::InvalidArgument);
        assert_eq!(
            decode_envelopes(&encode_envelope(0, b"hello")[..6], 1024)
                .unwrap_err()
                .code,
            Code::InvalidArgument
        );
    }

    #[test]
    fn end_stream_errors_round_trip() {
        let err = ConnectError::not_found("no such process");
        let env = end_stream_envelope(Some(&err));
        let envs = decode_envelopes(&env, 1024).unwrap();
        let back = parse_end_stream(&envs[0].payload).unwrap().unwrap();
        assert_eq!(
            (back.code, back.message.as_str()),
            (Code::NotFound, "no such process")
        );
        assert!(parse_end_stream(b"").unwrap().is_none());
        assert!(parse_end_stream(b"{\"error\":null}").unwrap().is_none());
        assert!(parse_end_stream(b"not json").is_err());
    }
}

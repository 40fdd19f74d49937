//! The two codecs (JSON and binary protobuf), the content types that select
//! them, and the messages they carry.

use bytes::Bytes;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::error::ConnectError;

/// Largest single message (unary body or envelope payload) accepted.
pub const MAX_MESSAGE_BYTES: usize = 32 * 1024 * 1024;

/// A message type both codecs can carry.
pub trait ConnectMessage:
    prost::Message + Default + Serialize + DeserializeOwned + Send + Sync + 'static
{
}
impl<T> ConnectMessage for T where
    T: prost::Message + Default + Serialize + DeserializeOwned + Send + Sync + 'static
{
}

/// The two codecs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    Json,
    Proto,
}

/// Whether a request's content type names a unary or a streaming call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    Unary,
    Stream,
}

impl Codec {
    /// Parses a request content type (parameters such as `charset` ignored).
    pub fn from_content_type(ct: &str) -> Option<(Codec, Framing)> {
        let base = ct
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        match base.as_str() {
            "application/json" => Some((Codec::Json, Framing::Unary)),
            "application/proto" | "application/protobuf" => Some((Codec::Proto, Framing::Unary)),
            "application/connect+json" => Some((Codec::Json, Framing::Stream)),
            "application/connect+proto" => Some((Codec::Proto, Framing::Stream)),
            _ => None,
        }
    }

    pub fn unary_content_type(self) -> &'static str {
        match self {
            Codec::Json => "application/json",
            Codec::Proto => "application/proto",
        }
    }

    pub fn stream_content_type(self) -> &'static str {
        match self {
            Codec::Json => "application/connect+json",
            Codec::Proto => "application/connect+proto",
        }
    }

    /// Decodes one message.
    pub fn decode<M: ConnectMessage>(self, bytes: &[u8]) -> Result<M, ConnectError> {
        match self {
            Codec::Json => serde_json::from_slice(bytes).map_err(|e| {
                ConnectError::invalid_argument(format!("request is not valid JSON: {e}"))
            }),
            Codec::Proto => M::decode(bytes).map_err(|e| {
                ConnectError::invalid_argument(format!("request is not valid protobuf: {e}"))
            }),
        }
    }

    /// Encodes one message.
    pub fn encode<M: ConnectMessage>(self, msg: &M) -> Result<Bytes, ConnectError> {
        match self {
            Codec::Json => serde_json::to_vec(msg)
                .map(Bytes::from)
                .map_err(|e| ConnectError::internal(format!("encoding JSON response: {e}"))),
            Codec::Proto => Ok(Bytes::from(msg.encode_to_vec())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_types_select_codec_and_framing() {
        assert_eq!(
            Codec::from_content_type("application/json; charset=utf-8"),
            Some((Codec::Json, Framing::Unary))
        );
        assert_eq!(
            Codec::from_content_type("application/connect+proto"),
            Some((Codec::Proto, Framing::Stream))
        );
        assert_eq!(Codec::from_content_type("text/plain"), None);
    }
}

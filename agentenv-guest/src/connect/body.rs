//! The response body type of the agent and its two constructors.

use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};

/// Response body type used throughout the agent.
pub type RespBody = UnsyncBoxBody<Bytes, std::io::Error>;

/// A `Full` body boxed into [`RespBody`].
pub fn full(data: impl Into<Bytes>) -> RespBody {
    Full::new(data.into())
        .map_err(|never: Infallible| match never {})
        .boxed_unsync()
}

/// An empty body.
pub fn empty() -> RespBody {
    full(Bytes::new())
}

//! The Connect protocol (connectrpc.com) on hyper: codecs, envelopes, error
//! codes, timeouts, and the three call shapes the agent serves (unary,
//! server streaming, client streaming).
//!
//! Unary calls use `application/json` or `application/proto` bodies and map
//! errors to HTTP statuses; streaming calls use `application/connect+json` or
//! `application/connect+proto`, a sequence of envelopes (1 flag byte, 4-byte
//! big-endian length, payload) and a final end-of-stream envelope (flag
//! `0x02`) with a JSON body that carries the error, if any.
//!
//! The pieces, each usable on its own (every item is also re-exported here):
//!
//! * [`error`]: [`Code`] and [`ConnectError`];
//! * [`codec`]: the JSON and protobuf [`Codec`]s and their content types;
//! * [`envelope`]: streaming framing, the encoder and decoder that clients
//!   (this crate's [`crate::client`], other crates' tools) use too;
//! * [`serve`]: serving calls on hyper ([`unary`], [`server_stream`],
//!   [`client_stream`]);
//! * [`body`]: the agent's response body type.

pub mod body;
pub mod codec;
pub mod envelope;
pub mod error;
pub mod serve;

pub use body::{RespBody, empty, full};
pub use codec::{Codec, ConnectMessage, Framing, MAX_MESSAGE_BYTES};
pub use envelope::{
    Envelope, EnvelopeDecoder, FLAG_COMPRESSED, FLAG_END_STREAM, decode_envelopes, encode_envelope,
    end_stream_envelope, envelope_stream, parse_end_stream,
};
pub use error::{Code, ConnectError};
pub use serve::{
    CallInfo, MessageStream, client_stream, parse_timeout, server_stream, stream_error_response,
    unary, with_keepalives,
};

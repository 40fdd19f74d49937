//! A Connect client for the agent with the binary protobuf codec, for the
//! runtime node and the `aenv` CLI: processes (start, stream output, input,
//! signals, resize), filesystem calls, and streamed file upload/download.
//!
//! ```no_run
//! # async fn demo() -> Result<(), agentenv_guest::client::ClientError> {
//! use agentenv_guest::client::GuestClient;
//! let client = GuestClient::new("http://127.0.0.1:49983")?.with_access_token("token");
//! let out = client.run("/bin/echo", &["hi"]).await?;
//! assert_eq!(out.stdout, b"hi\n");
//! # Ok(()) }
//! ```
//!
//! [`GuestClient`]'s methods live beside their concern: the connection and
//! `/health`, `/init` (`transport.rs`), the Connect call shapes
//! (`rpc.rs`), `process.Process` (`process.rs`), `filesystem.Filesystem`
//! (`filesystem.rs`), and `/files` transfers (`files.rs`).

mod files;
mod filesystem;
mod process;
mod rpc;
mod transport;

pub use process::{InputSender, ProcessOutput, collect_output};
pub use rpc::ResponseStream;
pub use transport::{ClientError, GuestClient};

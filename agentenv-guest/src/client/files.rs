//! `/files` transfers: streamed uploads and downloads through hyper, and
//! the raw ones on a connection of their own, where a regular file goes
//! from the page cache to the socket with `sendfile(2)` and from the
//! socket into the file with `splice(2)` ([`crate::rawfile`]).

use std::io;
use std::path::Path;

use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt, TryStreamExt};
use http::{HeaderValue, Method, StatusCode, header};
use http_body::Frame;
use http_body_util::{BodyExt, BodyStream, StreamBody};

use crate::fileio::read_stream;
use crate::query::encode_query;
use crate::rawfile;
use crate::splice::ReceiveError;

use super::transport::{ClientError, GuestClient, ReqBody, empty_body};

/// Where a download goes.
enum Dest {
    /// Created once the agent answered with success.
    Path(std::path::PathBuf),
    File(std::fs::File),
}

impl GuestClient {
    /// Uploads a byte stream to `remote_path` (`application/octet-stream`).
    pub async fn upload<S>(&self, remote_path: &str, data: S) -> Result<(), ClientError>
    where
        S: Stream<Item = io::Result<Bytes>> + Send + 'static,
    {
        let body = StreamBody::new(data.map_ok(Frame::data)).boxed_unsync();
        self.upload_body(remote_path, body).await
    }

    async fn upload_body(&self, remote_path: &str, body: ReqBody) -> Result<(), ClientError> {
        let pq = files_path(remote_path);
        let mut req = self.request(Method::POST, &pq, body);
        req.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/octet-stream"),
        );
        let resp = self.send("/files", req).await?;
        if !resp.status().is_success() {
            return Err(Self::error_from("/files", resp).await);
        }
        let _ = resp.into_body().collect().await;
        Ok(())
    }

    /// Uploads a local file. A regular file goes from the page cache to the
    /// socket with `sendfile(2)` on a connection of its own; anything else
    /// (a pipe, a device) is streamed.
    pub async fn upload_file(&self, local: &Path, remote_path: &str) -> Result<(), ClientError> {
        self.upload_file_with_progress(local, remote_path, |_| {})
            .await
    }

    /// [`GuestClient::upload_file`], telling `progress` of every piece sent
    /// (in bytes).
    pub async fn upload_file_with_progress(
        &self,
        local: &Path,
        remote_path: &str,
        mut progress: impl FnMut(u64) + Send + 'static,
    ) -> Result<(), ClientError> {
        let local_err = |source| ClientError::Io {
            path: local.display().to_string(),
            source,
        };
        let file = std::fs::File::open(local).map_err(local_err)?;
        let md = file.metadata().map_err(local_err)?;
        if !md.is_file() {
            let stream = read_stream(file).inspect(move |r| {
                if let Ok(b) = r {
                    progress(b.len() as u64);
                }
            });
            return self.upload(remote_path, stream).await;
        }
        let pq = files_path(remote_path);
        let mut headers = self.headers.clone();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/octet-stream"),
        );
        let authority = self.authority.clone();
        let len = md.len();
        let answer = rawfile::exchange(&self.authority, move |stream| {
            rawfile::write_head(stream, &Method::POST, &pq, &authority, &headers, Some(len))?;
            let sent = rawfile::send_file(stream, &file, len, &mut progress);
            if let Ok(n) = sent
                && n < len
            {
                // The agent waits for bytes that will not come: give up.
                return Ok(Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("the file shrank during the upload ({n} of {len} bytes sent)"),
                )));
            }
            // The agent may answer (and close) before taking the whole body,
            // e.g. when it refuses the upload: its answer says why.
            match (rawfile::read_head(stream), sent) {
                (Ok((head, rest)), _) => {
                    let body = rawfile::read_small_body(stream, &head, rest)?;
                    Ok(Ok((head.status, body)))
                }
                (Err(_), Err(e)) | (Err(e), Ok(_)) => Err(e),
            }
        })
        .await;
        match answer {
            Ok(Ok((status, _))) if status.is_success() => Ok(()),
            Ok(Ok((status, body))) => Err(Self::error_from_body("/files", status, &body)),
            Ok(Err(e)) => Err(local_err(e)),
            Err(source) => Err(transfer_failed(source)),
        }
    }

    /// Downloads `remote_path` as a byte stream.
    pub async fn download(
        &self,
        remote_path: &str,
    ) -> Result<BoxStream<'static, Result<Bytes, ClientError>>, ClientError> {
        let pq = files_path(remote_path);
        let req = self.request(Method::GET, &pq, empty_body());
        let resp = self.send("/files", req).await?;
        if resp.status() != StatusCode::OK {
            return Err(Self::error_from("/files", resp).await);
        }
        Ok(BodyStream::new(resp.into_body())
            .try_filter_map(|f| async move { Ok(f.into_data().ok()) })
            .map_err(|source| ClientError::Body {
                path: "/files".into(),
                source,
            })
            .boxed())
    }

    /// Downloads `remote_path` into a local file; returns the byte count.
    /// The body is spliced from the socket into the file (`splice(2)`), on a
    /// connection of its own. The file is created (or truncated) only once
    /// the agent answered with success.
    pub async fn download_to_file(
        &self,
        remote_path: &str,
        local: &Path,
    ) -> Result<u64, ClientError> {
        self.download_raw(remote_path, Dest::Path(local.to_path_buf()), |_| {})
            .await
    }

    /// Downloads `remote_path` into `file` (written from its current
    /// position), telling `progress` of every piece written; returns the
    /// byte count.
    pub async fn download_into(
        &self,
        remote_path: &str,
        file: std::fs::File,
        progress: impl FnMut(u64) + Send + 'static,
    ) -> Result<u64, ClientError> {
        self.download_raw(remote_path, Dest::File(file), progress)
            .await
    }

    async fn download_raw(
        &self,
        remote_path: &str,
        dest: Dest,
        mut progress: impl FnMut(u64) + Send + 'static,
    ) -> Result<u64, ClientError> {
        let pq = files_path(remote_path);
        let headers = self.headers.clone();
        let authority = self.authority.clone();
        let local = match &dest {
            Dest::Path(p) => p.display().to_string(),
            Dest::File(_) => "the local file".to_string(),
        };
        let answer = rawfile::exchange(&self.authority, move |stream| {
            rawfile::write_head(stream, &Method::GET, &pq, &authority, &headers, None)?;
            let (head, rest) = rawfile::read_head(stream)?;
            if head.status != StatusCode::OK {
                let body = rawfile::read_small_body(stream, &head, rest)?;
                return Ok(Err((head.status, body)));
            }
            let mut file = match dest {
                Dest::File(f) => f,
                Dest::Path(p) => match std::fs::File::create(&p) {
                    Ok(f) => f,
                    Err(e) => return Ok(Ok(Err(e))),
                },
            };
            match rawfile::receive_file(stream, &head, rest, &mut file, &mut progress) {
                Ok(n) => Ok(Ok(Ok(n))),
                Err(ReceiveError::Local(e)) => Ok(Ok(Err(e))),
                Err(ReceiveError::Peer(e)) => Err(e),
            }
        })
        .await;
        match answer {
            Ok(Ok(Ok(n))) => Ok(n),
            Ok(Ok(Err(source))) => Err(ClientError::Io {
                path: local,
                source,
            }),
            Ok(Err((status, body))) => Err(Self::error_from_body("/files", status, &body)),
            Err(source) => Err(transfer_failed(source)),
        }
    }
}

/// `/files?path=<remote_path, encoded>`.
fn files_path(remote_path: &str) -> String {
    format!("/files?path={}", encode_query(remote_path))
}

/// A raw transfer that failed on the connection.
fn transfer_failed(source: io::Error) -> ClientError {
    ClientError::Transfer {
        path: "/files".into(),
        source,
    }
}

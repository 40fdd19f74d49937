//! Schedule hints from create bodies: the body is read up to 64 KiB, parsed
//! best-effort, and handed on unchanged.

use std::collections::HashMap;

use agentenv_core::proto::scheduler_v1 as pb;
use bytes::Bytes;
use http::HeaderMap;
use serde::Deserialize;

use crate::body::{BoxError, GatewayBody, ReplayBody, boxed, concat, full, read_prefix};
use crate::routing::CreateKind;

/// Bodies larger than this are forwarded without a parsed hint.
pub const HINT_BODY_LIMIT: usize = 64 * 1024;

/// The client's create body could not be read.
#[derive(Debug, thiserror::Error)]
#[error("failed to read request body")]
pub struct HintBodyError(#[source] pub BoxError);

#[derive(Deserialize, Default)]
#[serde(default)]
struct CreateBody {
    metadata: Option<HashMap<String, String>>,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct ColdBody {
    cpu_count: u32,
    #[serde(rename = "memoryMB")]
    memory_mb: u64,
    image: String,
    attached_drives: Vec<Drive>,
    metadata: Option<HashMap<String, String>>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Drive {
    source: DriveSource,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct DriveSource {
    image: String,
}

/// Parses a hint of `kind` from a complete body. A malformed or empty body
/// gives an empty hint of the right kind.
pub fn parse_hint(kind: CreateKind, body: &[u8]) -> pb::ScheduleRequestHint {
    use pb::schedule_request_hint::Kind;
    // Only a JSON object counts (serde would also read a struct from an array).
    let body: &[u8] = match serde_json::from_slice::<serde_json::Value>(body) {
        Ok(serde_json::Value::Object(_)) => body,
        _ => b"{}",
    };
    let kind = match kind {
        CreateKind::Sandbox => {
            let parsed: CreateBody = serde_json::from_slice(body).unwrap_or_default();
            Kind::NewSandbox(pb::NewSandboxHint {
                metadata: parsed.metadata.unwrap_or_default(),
            })
        }
        CreateKind::Cold => {
            let parsed: ColdBody = serde_json::from_slice(body).unwrap_or_default();
            let images = std::iter::once(parsed.image)
                .chain(parsed.attached_drives.into_iter().map(|d| d.source.image))
                .filter(|i| !i.is_empty())
                .collect();
            Kind::NewColdSandbox(pb::NewColdSandboxHint {
                cpu_count: parsed.cpu_count,
                memory_mb: parsed.memory_mb,
                images,
                metadata: parsed.metadata.unwrap_or_default(),
            })
        }
    };
    pb::ScheduleRequestHint { kind: Some(kind) }
}

fn empty_hint(kind: CreateKind) -> pb::ScheduleRequestHint {
    parse_hint(kind, b"")
}

/// Reads up to [`HINT_BODY_LIMIT`] bytes of a create body and returns the
/// hint and a body carrying every original byte. A complete body gets an
/// exact `Content-Length`; a longer one is re-streamed as the prefix
/// followed by the rest, with an empty hint.
pub async fn capture_hint(
    kind: CreateKind,
    headers: &mut HeaderMap,
    body: GatewayBody,
) -> Result<(pb::ScheduleRequestHint, GatewayBody), HintBodyError> {
    let (frames, len, rest) = read_prefix(body, HINT_BODY_LIMIT)
        .await
        .map_err(HintBodyError)?;
    match rest {
        None => {
            let has_trailers = frames.iter().any(|f| f.is_trailers());
            let bytes: Bytes = concat(&frames);
            let hint = parse_hint(kind, &bytes);
            if has_trailers {
                return Ok((hint, boxed(ReplayBody::new(frames, None))));
            }
            headers.remove(http::header::TRANSFER_ENCODING);
            headers.insert(http::header::CONTENT_LENGTH, http::HeaderValue::from(len));
            Ok((hint, full(bytes)))
        }
        Some(rest) => Ok((empty_hint(kind), boxed(ReplayBody::new(frames, Some(rest))))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::body::BoxError;
    use http_body::Frame;
    use http_body_util::BodyExt;
    use pb::schedule_request_hint::Kind;

    fn body_of(parts: Vec<Vec<u8>>) -> GatewayBody {
        let frames: Vec<Result<Frame<Bytes>, BoxError>> = parts
            .into_iter()
            .map(|p| Ok(Frame::data(Bytes::from(p))))
            .collect();
        boxed(http_body_util::StreamBody::new(futures::stream::iter(
            frames,
        )))
    }

    #[tokio::test]
    async fn sandbox_hint_carries_metadata_and_body_is_restored() {
        let raw = br#"{"templateID":"base","metadata":{"team":"alpha"}}"#.to_vec();
        let mut headers = HeaderMap::new();
        let (hint, body) = capture_hint(
            CreateKind::Sandbox,
            &mut headers,
            body_of(vec![raw[..10].to_vec(), raw[10..].to_vec()]),
        )
        .await
        .unwrap();
        let Some(Kind::NewSandbox(h)) = hint.kind else {
            panic!("{hint:?}")
        };
        assert_eq!(h.metadata.get("team").map(String::as_str), Some("alpha"));
        assert_eq!(headers["content-length"], raw.len().to_string().as_str());
        assert_eq!(body.collect().await.unwrap().to_bytes(), raw);
    }

    #[test]
    fn cold_hint_lists_the_root_image_then_drive_images_skipping_blanks() {
        let hint = parse_hint(
            CreateKind::Cold,
            br#"{"cpuCount":2,"memoryMB":1024,"image":"ubuntu:24.04","attachedDrives":[{"source":{"image":"data:1"}},{"source":{"image":""}},{"source":{"image":"data:2"}}],"metadata":{"k":"v"}}"#,
        );
        let Some(Kind::NewColdSandbox(h)) = hint.kind else {
            panic!()
        };
        assert_eq!(h.cpu_count, 2);
        assert_eq!(h.memory_mb, 1024);
        assert_eq!(h.images, ["ubuntu:24.04", "data:1", "data:2"]);
        assert_eq!(h.metadata["k"], "v");
    }

    #[test]
    fn malformed_or_empty_bodies_give_an_empty_hint_of_the_right_kind() {
        for body in [&b""[..], b"{not json", b"[1,2]", br#"{"metadata":{"a":1}}"#] {
            let h = parse_hint(CreateKind::Sandbox, body);
            assert_eq!(
                h.kind,
                Some(Kind::NewSandbox(pb::NewSandboxHint::default()))
            );
            let h = parse_hint(CreateKind::Cold, body);
            assert_eq!(
                h.kind,
                Some(Kind::NewColdSandbox(pb::NewColdSandboxHint::default()))
            );
        }
    }

    #[tokio::test]
    async fn a_body_over_64_kib_gives_an_empty_hint_and_is_forwarded_whole() {
        let mut raw = br#"{"image":"ubuntu:24.04","pad":""#.to_vec();
        raw.extend(std::iter::repeat_n(b'x', HINT_BODY_LIMIT));
        raw.extend_from_slice(b"\"}");
        let parts: Vec<Vec<u8>> = raw.chunks(4096).map(<[u8]>::to_vec).collect();
        let mut headers = HeaderMap::new();
        let (hint, body) = capture_hint(CreateKind::Cold, &mut headers, body_of(parts))
            .await
            .unwrap();
        assert_eq!(
            hint.kind,
            Some(Kind::NewColdSandbox(pb::NewColdSandboxHint::default()))
        );
        assert!(headers.get("content-length").is_none());
        assert_eq!(body.collect().await.unwrap().to_bytes(), raw);
    }

    #[tokio::test]
    async fn a_failing_body_is_a_read_error() {
        let frames: Vec<Result<Frame<Bytes>, BoxError>> = vec![
            Ok(Frame::data(Bytes::from_static(b"{"))),
            Err("reset".into()),
        ];
        let body = boxed(http_body_util::StreamBody::new(futures::stream::iter(
            frames,
        )));
        let err = capture_hint(CreateKind::Sandbox, &mut HeaderMap::new(), body)
            .await
            .unwrap_err();
        assert_eq!(err.to_string(), "failed to read request body");
    }
}

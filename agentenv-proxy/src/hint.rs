//! Schedule hints from create bodies: the body is read up to 64 KiB, parsed
//! best-effort, and handed on unchanged.
//!
//! A sandbox create's hint names its template and says whether a node's pool may serve
//! it (`poolable`: what the node's pools require that the gateway can see, see
//! [`poolable`]), so the scheduler can prefer a node holding a pooled sandbox of it.

use std::collections::HashMap;

use agentenv_core::proto::scheduler_v1 as pb;
use bytes::Bytes;
use http::HeaderMap;
use serde::Deserialize;
use serde_json::Value;

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
    // The rest as raw values: a field of an unexpected type must not cost the metadata.
    #[serde(rename = "templateID")]
    template_id: Value,
    #[serde(rename = "cpuCount")]
    cpu_count: Value,
    #[serde(rename = "memoryMB")]
    memory_mb: Value,
    #[serde(rename = "diskSizeMB")]
    disk_size_mb: Value,
    #[serde(rename = "volumeMounts")]
    volume_mounts: Value,
    allow_internet_access: Value,
    network: Value,
}

/// Whether a create asks for nothing a pooled sandbox lacks, as far as its body shows:
/// no `cpuCount`, `memoryMB` or `diskSizeMB`, no volumes, and the default egress (no
/// `allowOut`, `denyOut` or `dnsServers`, internet not turned off). The node has the
/// last word (a template with a start command is never pooled, a given CPU count may be
/// its default); an `Idempotency-Key` header rules pools out too ([`capture_hint`]).
fn poolable(b: &CreateBody) -> bool {
    let unset = |v: &Value| v.is_null();
    let none = |v: &Value| v.is_null() || v.as_array().is_some_and(Vec::is_empty);
    let default_network = match &b.network {
        Value::Null => true,
        Value::Object(n) => {
            n.get("allowOut").is_none_or(none)
                && n.get("denyOut").is_none_or(none)
                && n.get("dnsServers").is_none_or(unset)
        }
        _ => false,
    };
    unset(&b.cpu_count)
        && unset(&b.memory_mb)
        && unset(&b.disk_size_mb)
        && none(&b.volume_mounts)
        && b.allow_internet_access != Value::Bool(false)
        && default_network
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
            let template_id = parsed.template_id.as_str().unwrap_or("").trim().to_string();
            Kind::NewSandbox(pb::NewSandboxHint {
                poolable: !template_id.is_empty() && poolable(&parsed),
                template_id,
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
/// followed by the rest, with an empty hint. A create with an
/// `Idempotency-Key` is not poolable (the node derives its id from the key).
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
            let mut hint = parse_hint(kind, &bytes);
            if headers.contains_key(crate::routing::IDEMPOTENCY_KEY_HEADER)
                && let Some(pb::schedule_request_hint::Kind::NewSandbox(h)) = &mut hint.kind
            {
                h.poolable = false;
            }
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

    fn sandbox_hint(body: &str) -> pb::NewSandboxHint {
        match parse_hint(CreateKind::Sandbox, body.as_bytes()).kind {
            Some(Kind::NewSandbox(h)) => h,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_plain_sdk_create_names_its_template_and_is_poolable() {
        // What the E2B Python SDK sends for `Sandbox.create()`.
        let h = sandbox_hint(
            r#"{"templateID":" base ","metadata":{"i":"0"},"envVars":{"A":"1"},"timeout":300,"secure":true,"allow_internet_access":true,"autoPause":false,"network":{"allowPublicTraffic":true,"allowOut":[],"denyOut":null},"volumeMounts":[]}"#,
        );
        assert_eq!(h.template_id, "base");
        assert!(h.poolable);
        assert_eq!(h.metadata["i"], "0");
        assert!(sandbox_hint(r#"{"templateID":"python"}"#).poolable);
    }

    #[test]
    fn a_create_asking_for_what_a_pool_lacks_is_not_poolable() {
        for extra in [
            r#""cpuCount":2"#,
            r#""memoryMB":512"#,
            r#""diskSizeMB":1024"#,
            r#""volumeMounts":[{"name":"v","path":"/data"}]"#,
            r#""allow_internet_access":false"#,
            r#""network":{"allowOut":["1.1.1.1"]}"#,
            r#""network":{"denyOut":["0.0.0.0/0"]}"#,
            r#""network":{"dnsServers":[]}"#,
            r#""network":"open""#,
            // A field of an unexpected type is not the default either.
            r#""cpuCount":"2""#,
        ] {
            let h = sandbox_hint(&format!(
                r#"{{"templateID":"base","metadata":{{"k":"v"}},{extra}}}"#
            ));
            assert!(!h.poolable, "{extra}");
            assert_eq!(h.template_id, "base", "{extra}");
            assert_eq!(h.metadata["k"], "v", "{extra}");
        }
        // No template named: nothing for a pool to match.
        for body in [r#"{}"#, r#"{"templateID":""}"#, r#"{"templateID":7}"#] {
            let h = sandbox_hint(body);
            assert!(!h.poolable && h.template_id.is_empty(), "{body}");
        }
    }

    #[tokio::test]
    async fn an_idempotent_create_is_not_poolable() {
        let raw = br#"{"templateID":"base"}"#.to_vec();
        for (key, poolable) in [(None, true), (Some("retry-1"), false)] {
            let mut headers = HeaderMap::new();
            if let Some(k) = key {
                headers.insert(crate::routing::IDEMPOTENCY_KEY_HEADER, k.parse().unwrap());
            }
            let (hint, _) = capture_hint(
                CreateKind::Sandbox,
                &mut headers,
                body_of(vec![raw.clone()]),
            )
            .await
            .unwrap();
            let Some(Kind::NewSandbox(h)) = hint.kind else {
                panic!("{hint:?}")
            };
            assert_eq!(
                (h.template_id.as_str(), h.poolable),
                ("base", poolable),
                "{key:?}"
            );
        }
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

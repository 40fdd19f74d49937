//! The JSON bodies of the REST calls `aenv` makes, typed: what it sends and the fields it
//! reads from the answers (E2B's names, camelCase with `ID` and `MB` upper-cased).
//!
//! The node's own API model (`agentenv_node::api`) reads requests and writes answers, the
//! opposite directions, so the CLI's side of the same bodies is written down here.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// `POST /sandboxes` (from a template) and `POST /sandboxes-cold` (from an image).
#[derive(Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NewSandbox {
    #[serde(rename = "templateID", skip_serializing_if = "Option::is_none")]
    pub template_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    pub timeout: u64,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub secure: bool,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_count: Option<u32>,
    #[serde(rename = "memoryMB", skip_serializing_if = "Option::is_none")]
    pub memory_mb: Option<u32>,
    #[serde(rename = "diskSizeMB", skip_serializing_if = "Option::is_none")]
    pub disk_size_mb: Option<u64>,
}

/// `POST /sandboxes/{id}/connect` and `POST /sandboxes/{id}/timeout`.
#[derive(Debug, Serialize)]
pub struct Timeout {
    pub timeout: u64,
}

/// `POST /sandboxes/{id}/refreshes`.
#[derive(Debug, Serialize)]
pub struct Refresh {
    pub duration: u64,
}

/// A created or connected sandbox.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Sandbox {
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    pub envd_access_token: Option<String>,
}

/// `GET /sandboxes/{id}` (the fields the CLI uses).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxDetail {
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    pub state: Option<String>,
    pub envd_access_token: Option<String>,
}

impl SandboxDetail {
    /// Whether the sandbox is paused.
    pub fn is_paused(&self) -> bool {
        self.state.as_deref() == Some("paused")
    }
}

/// A listed sandbox (`GET /v2/sandboxes`); `aenv ls -o json` prints these fields.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ListedSandbox {
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "templateID")]
    pub template_id: Option<String>,
    pub alias: Option<String>,
    pub state: Option<String>,
    pub cpu_count: Option<u64>,
    #[serde(rename = "memoryMB")]
    pub memory_mb: Option<u64>,
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: Option<u64>,
    pub started_at: Option<String>,
    pub end_at: Option<String>,
    pub metadata: Option<BTreeMap<String, String>>,
}

/// `POST /v3/templates`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NewTemplate {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_count: Option<u32>,
    #[serde(rename = "memoryMB", skip_serializing_if = "Option::is_none")]
    pub memory_mb: Option<u32>,
}

/// The answer to `POST /v3/templates`.
#[derive(Debug, Default, Deserialize)]
pub struct TemplateCreated {
    #[serde(rename = "templateID")]
    pub template_id: Option<String>,
    #[serde(rename = "buildID")]
    pub build_id: Option<String>,
}

/// `POST /v2/templates/{templateID}/builds/{buildID}`: what the build starts from
/// (`fromTemplate` or `fromImage`) and does.
#[derive(Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BuildRequest {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from_template: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from_image: Option<String>,
    /// Credentials of the image's registry (`{"type":"registry","username","password"}`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from_image_registry: Option<serde_json::Value>,
    pub steps: Vec<BuildStep>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub start_cmd: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ready_cmd: Option<String>,
}

/// One build step (`RUN`, `COPY`, `ENV`, `WORKDIR`, `USER`), its arguments and, for
/// `COPY`, the hash of the uploaded files.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BuildStep {
    #[serde(rename = "type")]
    pub kind: String,
    pub args: Vec<String>,
    #[serde(rename = "filesHash", skip_serializing_if = "Option::is_none")]
    pub files_hash: Option<String>,
}

/// The answer to `GET /templates/{templateID}/files/{hash}`.
#[derive(Debug, Default, Deserialize)]
pub struct FileLink {
    #[serde(default)]
    pub present: bool,
    pub url: Option<String>,
}

/// `GET /templates/{templateID}/builds/{buildID}/status`.
#[derive(Debug, Default, Deserialize)]
pub struct BuildStatus {
    #[serde(rename = "templateID")]
    pub template_id: Option<String>,
    #[serde(rename = "buildID")]
    pub build_id: Option<String>,
    pub status: Option<String>,
    #[serde(rename = "logEntries", default)]
    pub log_entries: Vec<LogEntry>,
    pub reason: Option<BuildFailure>,
}

/// One line of a build's log.
#[derive(Debug, Default, Deserialize)]
pub struct LogEntry {
    #[serde(default)]
    pub message: String,
    pub level: Option<String>,
}

/// Why a build failed.
#[derive(Debug, Default, Deserialize)]
pub struct BuildFailure {
    pub message: Option<String>,
    pub step: Option<String>,
}

/// `GET /templates/{id or name}`: the template and its builds, newest first.
#[derive(Debug, Default, Deserialize)]
pub struct TemplateDetail {
    #[serde(rename = "templateID")]
    pub template_id: Option<String>,
    #[serde(default)]
    pub builds: Vec<BuildRef>,
}

/// One build of a [`TemplateDetail`].
#[derive(Debug, Default, Deserialize)]
pub struct BuildRef {
    #[serde(rename = "buildID")]
    pub build_id: String,
    pub status: Option<String>,
}

/// `GET /templates/aliases/{alias}`.
#[derive(Debug, Default, Deserialize)]
pub struct TemplateAlias {
    #[serde(rename = "templateID")]
    pub template_id: Option<String>,
}

/// A listed template (`GET /v2/templates`): the fields of `aenv template ls`'s table.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct TemplateInfo {
    pub names: Vec<String>,
    pub aliases: Vec<String>,
    #[serde(rename = "templateID")]
    pub template_id: Option<String>,
    pub build_status: Option<String>,
    pub cpu_count: Option<u64>,
    #[serde(rename = "memoryMB")]
    pub memory_mb: Option<u64>,
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: Option<u64>,
    pub created_at: Option<String>,
    pub updated_at: Option<String>,
}

/// `POST /sandboxes/{id}/snapshots`.
#[derive(Debug, Serialize)]
pub struct NewSnapshot {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// The answer to `POST /sandboxes/{id}/snapshots`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotCreated {
    #[serde(rename = "snapshotID")]
    pub snapshot_id: Option<String>,
    pub image_ref: Option<String>,
}

/// A listed snapshot (`GET /snapshots`): the fields of `aenv snapshot ls`'s table.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct SnapshotInfo {
    #[serde(rename = "snapshotID")]
    pub snapshot_id: Option<String>,
    pub names: Vec<String>,
    pub image_ref: Option<String>,
}

/// One listed item: the typed fields a table shows, and the item as the server sent it
/// (what `-o json` prints, fields the CLI does not know included).
#[derive(Debug)]
pub struct Listed<T> {
    pub item: T,
    pub raw: serde_json::Value,
}

impl<'de, T: serde::de::DeserializeOwned> Deserialize<'de> for Listed<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = serde_json::Value::deserialize(d)?;
        let item = T::deserialize(&raw).map_err(serde::de::Error::custom)?;
        Ok(Listed { item, raw })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_bodies_carry_only_what_was_given() {
        let body = NewSandbox {
            template_id: Some("base".into()),
            timeout: 300,
            ..Default::default()
        };
        assert_eq!(
            serde_json::to_value(&body).unwrap(),
            serde_json::json!({"templateID": "base", "timeout": 300})
        );
        let body = NewSandbox {
            image: Some("ubuntu:22.04".into()),
            timeout: 60,
            secure: true,
            metadata: [("a".to_string(), "b".to_string())].into(),
            cpu_count: Some(2),
            memory_mb: Some(512),
            disk_size_mb: Some(2048),
            ..Default::default()
        };
        assert_eq!(
            serde_json::to_value(&body).unwrap(),
            serde_json::json!({"image": "ubuntu:22.04", "timeout": 60, "secure": true,
                "metadata": {"a": "b"}, "cpuCount": 2, "memoryMB": 512, "diskSizeMB": 2048})
        );
        let build = BuildRequest {
            from_image: Some("python:3.12".into()),
            steps: vec![
                BuildStep {
                    kind: "RUN".into(),
                    args: vec!["true".into()],
                    files_hash: None,
                },
                BuildStep {
                    kind: "COPY".into(),
                    args: vec!["a".into(), "/a".into(), "".into(), "".into()],
                    files_hash: Some("ab".into()),
                },
            ],
            ready_cmd: Some("true".into()),
            ..Default::default()
        };
        assert_eq!(
            serde_json::to_value(&build).unwrap(),
            serde_json::json!({"fromImage": "python:3.12",
                "steps": [{"type": "RUN", "args": ["true"]},
                    {"type": "COPY", "args": ["a", "/a", "", ""], "filesHash": "ab"}],
                "readyCmd": "true"})
        );
        assert_eq!(
            serde_json::to_value(BuildRequest {
                from_template: Some("base".into()),
                ..Default::default()
            })
            .unwrap(),
            serde_json::json!({"fromTemplate": "base", "steps": []})
        );
        assert_eq!(
            serde_json::to_value(NewSnapshot { name: None }).unwrap(),
            serde_json::json!({})
        );
    }

    #[test]
    fn listed_items_keep_what_the_server_sent() {
        let v: Vec<Listed<SnapshotInfo>> =
            serde_json::from_str(r#"[{"snapshotID":"s1","names":["a","b"],"extra":1}]"#).unwrap();
        assert_eq!(v[0].item.snapshot_id.as_deref(), Some("s1"));
        assert_eq!(v[0].item.names, ["a", "b"]);
        assert_eq!(v[0].raw["extra"], 1);
        assert_eq!(v[0].item.image_ref, None);
        let s: ListedSandbox = serde_json::from_str(r#"{"sandboxID":"x"}"#).unwrap();
        assert_eq!(
            (s.sandbox_id.as_str(), s.state, s.metadata),
            ("x", None, None)
        );
        assert!(serde_json::from_str::<ListedSandbox>("{}").is_err());
        let st: BuildStatus = serde_json::from_str(r#"{"status":"error","reason":{}}"#).unwrap();
        assert_eq!(st.status.as_deref(), Some("error"));
        assert!(st.reason.is_some_and(|r| r.message.is_none()));
    }
}

//! The control plane's routes: which request is which operation, and its metrics label.

use http::Method;

pub(super) use super::volume_content::ContentOp;

/// Control-plane routes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Route {
    Health,
    Metrics,
    Create,
    ListV1,
    ListV2,
    Get(String),
    Delete(String),
    Pause(String),
    Resume(String),
    Connect(String),
    Timeout(String),
    Refresh(String),
    /// `POST /sandboxes/{id}/fork`.
    Fork(String),
    /// `PUT /sandboxes/{id}/network`.
    Network(String),
    /// `POST /sandboxes/{id}/export` (true) and `DELETE` (false: the move is cancelled).
    Export(String, bool),
    /// `POST /sandboxes/{id}/import`: a sandbox exported by another node.
    Import(String),
    /// `GET /sandboxes/{id}/metrics`.
    SandboxMetrics(String),
    /// `GET /sandboxes/metrics?sandbox_ids=…`.
    MetricsMany,
    /// `GET /sandboxes/{id}/logs` (false) and `/v2/sandboxes/{id}/logs` (true).
    Logs(String, bool),
    VolumeCreate,
    VolumeList,
    VolumeGet(String),
    VolumeDelete(String),
    /// `/volumecontent/{id}/dir|path|file` (the volume's token, not the API key).
    VolumeContent(String, ContentOp),
    Nodes,
    Node(String),
    Snapshot(String),
    Snapshots,
    SnapshotGet(String),
    TemplateDelete(String),
    TemplateAlias(String),
    TemplateCreate,
    TemplateList,
    TemplateListV2,
    DefaultTemplates,
    TemplateGet(String),
    TemplatePatch(String, bool),
    TemplateFile(String, String),
    TemplateUpload(String, String),
    BuildStart(String, String),
    BuildStatus(String, String),
    BuildLogs(String, String),
    TagsAssign,
    TagsRemove,
    Tags(String),
}

impl Route {
    /// The route's path pattern, the `route` label of the request metrics.
    pub(super) fn label(&self) -> &'static str {
        match self {
            Route::Health => "/health",
            Route::Metrics => "/metrics",
            Route::Create => "/sandboxes",
            Route::ListV1 => "/sandboxes",
            Route::ListV2 => "/v2/sandboxes",
            Route::Get(_) | Route::Delete(_) => "/sandboxes/{sandbox_id}",
            Route::Pause(_) => "/sandboxes/{sandbox_id}/pause",
            Route::Resume(_) => "/sandboxes/{sandbox_id}/resume",
            Route::Connect(_) => "/sandboxes/{sandbox_id}/connect",
            Route::Timeout(_) => "/sandboxes/{sandbox_id}/timeout",
            Route::Refresh(_) => "/sandboxes/{sandbox_id}/refreshes",
            Route::Fork(_) => "/sandboxes/{sandbox_id}/fork",
            Route::Network(_) => "/sandboxes/{sandbox_id}/network",
            Route::Export(..) => "/sandboxes/{sandbox_id}/export",
            Route::Import(_) => "/sandboxes/{sandbox_id}/import",
            Route::SandboxMetrics(_) => "/sandboxes/{sandbox_id}/metrics",
            Route::MetricsMany => "/sandboxes/metrics",
            Route::Logs(_, false) => "/sandboxes/{sandbox_id}/logs",
            Route::Logs(_, true) => "/v2/sandboxes/{sandbox_id}/logs",
            Route::VolumeCreate | Route::VolumeList => "/volumes",
            Route::VolumeGet(_) | Route::VolumeDelete(_) => "/volumes/{volume_id}",
            Route::VolumeContent(_, op) => match op {
                ContentOp::List | ContentOp::MakeDir => "/volumecontent/{volume_id}/dir",
                ContentOp::Stat | ContentOp::SetMeta | ContentOp::Remove => {
                    "/volumecontent/{volume_id}/path"
                }
                ContentOp::Read | ContentOp::Write => "/volumecontent/{volume_id}/file",
            },
            Route::Nodes => "/nodes",
            Route::Node(_) => "/nodes/{node_id}",
            Route::Snapshot(_) => "/sandboxes/{sandbox_id}/snapshots",
            Route::Snapshots => "/snapshots",
            Route::SnapshotGet(_) => "/snapshots/{snapshot_id}",
            Route::TemplateDelete(_) => "/templates/{template_id}",
            Route::TemplateAlias(_) => "/templates/aliases/{alias}",
            Route::TemplateCreate => "/v3/templates",
            Route::TemplateList => "/templates",
            Route::TemplateListV2 => "/v2/templates",
            Route::DefaultTemplates => "/default-templates",
            Route::TemplateGet(_) => "/templates/{template_id}",
            Route::TemplatePatch(_, false) => "/templates/{template_id}",
            Route::TemplatePatch(_, true) => "/v2/templates/{template_id}",
            Route::TemplateFile(..) | Route::TemplateUpload(..) => {
                "/templates/{template_id}/files/{hash}"
            }
            Route::BuildStart(..) => "/v2/templates/{template_id}/builds/{build_id}",
            Route::BuildStatus(..) => "/templates/{template_id}/builds/{build_id}/status",
            Route::BuildLogs(..) => "/templates/{template_id}/builds/{build_id}/logs",
            Route::TagsAssign | Route::TagsRemove => "/templates/tags",
            Route::Tags(_) => "/templates/{template_id}/tags",
        }
    }
}

/// The route of `method` and `path`, if any (sandbox ids lowercase).
pub(super) fn match_route(method: &Method, path: &str) -> Option<Route> {
    let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let m = method.clone();
    Some(match (m, segs.as_slice()) {
        (Method::GET, ["health"]) => Route::Health,
        (Method::GET, ["metrics"]) => Route::Metrics,
        (Method::POST, ["sandboxes"]) | (Method::POST, ["v2", "sandboxes"]) => Route::Create,
        (Method::GET, ["sandboxes"]) => Route::ListV1,
        (Method::GET, ["v2", "sandboxes"]) => Route::ListV2,
        (Method::GET, ["sandboxes", "metrics"]) => Route::MetricsMany,
        (Method::GET, ["sandboxes", id]) if !id.is_empty() => Route::Get(id.to_ascii_lowercase()),
        (Method::DELETE, ["sandboxes", id]) if !id.is_empty() => {
            Route::Delete(id.to_ascii_lowercase())
        }
        (Method::POST, ["sandboxes", id, "pause"]) => Route::Pause(id.to_ascii_lowercase()),
        (Method::POST, ["sandboxes", id, "resume"]) => Route::Resume(id.to_ascii_lowercase()),
        (Method::POST, ["sandboxes", id, "connect"])
        | (Method::POST, ["v2", "sandboxes", id, "connect"]) => {
            Route::Connect(id.to_ascii_lowercase())
        }
        (Method::POST, ["sandboxes", id, "timeout"]) => Route::Timeout(id.to_ascii_lowercase()),
        (Method::POST, ["sandboxes", id, "refreshes"]) => Route::Refresh(id.to_ascii_lowercase()),
        (Method::POST, ["sandboxes", id, "fork"]) => Route::Fork(id.to_ascii_lowercase()),
        (Method::PUT, ["sandboxes", id, "network"]) => Route::Network(id.to_ascii_lowercase()),
        (Method::POST, ["sandboxes", id, "export"]) => Route::Export(id.to_ascii_lowercase(), true),
        (Method::DELETE, ["sandboxes", id, "export"]) => {
            Route::Export(id.to_ascii_lowercase(), false)
        }
        (Method::POST, ["sandboxes", id, "import"]) => Route::Import(id.to_ascii_lowercase()),
        (Method::GET, ["sandboxes", id, "metrics"]) => {
            Route::SandboxMetrics(id.to_ascii_lowercase())
        }
        (Method::GET, ["sandboxes", id, "logs"]) => Route::Logs(id.to_ascii_lowercase(), false),
        (Method::GET, ["v2", "sandboxes", id, "logs"]) => {
            Route::Logs(id.to_ascii_lowercase(), true)
        }
        (Method::POST, ["volumes"]) => Route::VolumeCreate,
        (Method::GET, ["volumes"]) => Route::VolumeList,
        (Method::GET, ["volumes", id]) if !id.is_empty() => Route::VolumeGet(id.to_string()),
        (Method::DELETE, ["volumes", id]) if !id.is_empty() => Route::VolumeDelete(id.to_string()),
        (m, ["volumecontent", id, what]) if !id.is_empty() => {
            let op = match (m, *what) {
                (Method::GET, "dir") => ContentOp::List,
                (Method::POST, "dir") => ContentOp::MakeDir,
                (Method::GET, "path") => ContentOp::Stat,
                (Method::PATCH, "path") => ContentOp::SetMeta,
                (Method::DELETE, "path") => ContentOp::Remove,
                (Method::GET, "file") => ContentOp::Read,
                (Method::PUT, "file") => ContentOp::Write,
                _ => return None,
            };
            Route::VolumeContent(id.to_string(), op)
        }
        (Method::POST, ["sandboxes", id, "snapshots"]) => Route::Snapshot(id.to_ascii_lowercase()),
        (Method::GET, ["snapshots"]) => Route::Snapshots,
        (Method::GET, ["snapshots", id]) if !id.is_empty() => Route::SnapshotGet(id.to_string()),
        (Method::GET, ["templates", "aliases", alias]) if !alias.is_empty() => {
            Route::TemplateAlias(alias.to_string())
        }
        (Method::POST, ["templates", "tags"]) => Route::TagsAssign,
        (Method::DELETE, ["templates", "tags"]) => Route::TagsRemove,
        (Method::DELETE, ["templates", id]) if !id.is_empty() => {
            Route::TemplateDelete(id.to_string())
        }
        (Method::POST, ["v3", "templates"]) | (Method::POST, ["v2", "templates"]) => {
            Route::TemplateCreate
        }
        (Method::GET, ["templates"]) => Route::TemplateList,
        (Method::GET, ["v2", "templates"]) => Route::TemplateListV2,
        (Method::GET, ["default-templates"]) => Route::DefaultTemplates,
        (Method::GET, ["templates", id]) if !id.is_empty() => Route::TemplateGet(id.to_string()),
        (Method::PATCH, ["templates", id]) if !id.is_empty() => {
            Route::TemplatePatch(id.to_string(), false)
        }
        (Method::PATCH, ["v2", "templates", id]) if !id.is_empty() => {
            Route::TemplatePatch(id.to_string(), true)
        }
        (Method::GET, ["templates", id, "files", hash]) => {
            Route::TemplateFile(id.to_string(), hash.to_string())
        }
        (Method::PUT, ["templates", id, "files", hash]) => {
            Route::TemplateUpload(id.to_string(), hash.to_string())
        }
        (Method::POST, ["v2", "templates", id, "builds", b])
        | (Method::POST, ["templates", id, "builds", b]) => {
            Route::BuildStart(id.to_string(), b.to_string())
        }
        (Method::GET, ["templates", id, "builds", b, "status"]) => {
            Route::BuildStatus(id.to_string(), b.to_string())
        }
        (Method::GET, ["templates", id, "builds", b, "logs"]) => {
            Route::BuildLogs(id.to_string(), b.to_string())
        }
        (Method::GET, ["templates", id, "tags"]) => Route::Tags(id.to_string()),
        (Method::GET, ["nodes"]) => Route::Nodes,
        (Method::GET, ["nodes", id]) if !id.is_empty() => Route::Node(id.to_string()),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_match_v1_and_v2_paths() {
        let id = "01936f8e-72f5-7000-8000-000000000001";
        assert_eq!(
            match_route(&Method::POST, "/v2/sandboxes"),
            Some(Route::Create)
        );
        assert_eq!(
            match_route(&Method::POST, "/sandboxes"),
            Some(Route::Create)
        );
        assert_eq!(
            match_route(&Method::POST, &format!("/v2/sandboxes/{id}/connect")),
            Some(Route::Connect(id.into()))
        );
        assert_eq!(
            match_route(&Method::POST, &format!("/sandboxes/{id}/connect")),
            Some(Route::Connect(id.into()))
        );
        assert_eq!(match_route(&Method::PUT, "/sandboxes"), None);
        assert_eq!(
            match_route(&Method::POST, &format!("/sandboxes/{id}/snapshots")),
            Some(Route::Snapshot(id.into()))
        );
        assert_eq!(
            match_route(&Method::GET, "/snapshots"),
            Some(Route::Snapshots)
        );
        assert_eq!(
            match_route(&Method::GET, "/snapshots/web"),
            Some(Route::SnapshotGet("web".into()))
        );
        assert_eq!(
            match_route(&Method::GET, "/templates/aliases/web"),
            Some(Route::TemplateAlias("web".into()))
        );
        assert_eq!(
            match_route(&Method::DELETE, "/templates/web"),
            Some(Route::TemplateDelete("web".into()))
        );
        assert_eq!(match_route(&Method::POST, "/process.Process/Start"), None);
        assert_eq!(
            match_route(&Method::GET, "/sandboxes/metrics"),
            Some(Route::MetricsMany)
        );
        assert_eq!(
            match_route(&Method::GET, &format!("/v2/sandboxes/{id}/logs")),
            Some(Route::Logs(id.into(), true))
        );
        assert_eq!(
            match_route(&Method::PUT, &format!("/sandboxes/{id}/network")),
            Some(Route::Network(id.into()))
        );
        assert_eq!(
            match_route(&Method::DELETE, "/volumes/v1"),
            Some(Route::VolumeDelete("v1".into()))
        );
        assert_eq!(
            match_route(&Method::PUT, "/volumecontent/v1/file"),
            Some(Route::VolumeContent("v1".into(), ContentOp::Write))
        );
        assert_eq!(
            match_route(&Method::PATCH, "/volumecontent/v1/path"),
            Some(Route::VolumeContent("v1".into(), ContentOp::SetMeta))
        );
        assert_eq!(match_route(&Method::PUT, "/volumecontent/v1/dir"), None);
        assert_eq!(
            match_route(&Method::POST, "/v3/templates"),
            Some(Route::TemplateCreate)
        );
        assert_eq!(
            match_route(&Method::GET, "/templates/t1/builds/b1/status"),
            Some(Route::BuildStatus("t1".into(), "b1".into()))
        );
        assert_eq!(
            match_route(&Method::PUT, "/templates/t1/files/h"),
            Some(Route::TemplateUpload("t1".into(), "h".into()))
        );
        assert_eq!(
            match_route(&Method::DELETE, "/templates/tags"),
            Some(Route::TagsRemove)
        );
    }
}

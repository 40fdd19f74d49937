//! `aenv template ls|rm|watch`, and what `pull` and `build` share with them: creating a
//! template and starting its build, resolving a name to an ID, following a build.

use clap::Subcommand;
use http::Method;
use serde::de::IgnoredAny;

use crate::cli::api::{self, Api, ApiError};
use crate::cli::args::{OutputOpt, TemplateSize};
use crate::cli::model::{
    BuildRequest, BuildStatus, Listed, NewTemplate, TemplateAlias, TemplateCreated, TemplateDetail,
    TemplateInfo,
};
use crate::cli::{CliError, io_err, output};

/// `aenv template` subcommands.
#[derive(Debug, Subcommand)]
pub enum TemplateCmd {
    /// List templates.
    #[command(
        visible_alias = "ls",
        after_help = "Example:\n  aenv template ls -o json"
    )]
    List {
        #[command(flatten)]
        output: OutputOpt,
    },
    /// Delete a template or a snapshot (name or ID).
    #[command(
        visible_alias = "rm",
        after_help = "Example:\n  aenv template rm my-template"
    )]
    Delete { template: String },
    /// Follow the latest build of a template (name or ID): print its log until it is
    /// ready (exit 0) or fails (exit 1).
    #[command(after_help = "Example:\n  aenv template watch my-template")]
    Watch { template: String },
}

/// Runs one template subcommand.
pub async fn run(api: &Api, cmd: TemplateCmd) -> Result<i32, CliError> {
    match cmd {
        TemplateCmd::List { output } => {
            let items: Vec<Listed<TemplateInfo>> = api.get_json("/v2/templates").await?;
            output::templates(&items, output.format()).map_err(io_err("writing the list"))?;
            Ok(0)
        }
        TemplateCmd::Delete { template } => {
            let (id, what) = resolve(api, &template).await?;
            let path = format!("/templates/{}", api::seg(&id));
            api.send::<IgnoredAny>(Method::DELETE, &path, None::<&()>)
                .await?;
            println!("Deleted {what} {template} ({id})");
            Ok(0)
        }
        TemplateCmd::Watch { template } => {
            let detail = detail(api, &template).await?;
            let tid = detail.template_id.unwrap_or_else(|| template.clone());
            let Some(build) = detail.builds.first() else {
                return Err(CliError::Usage(format!(
                    "template {template} has no builds to watch"
                )));
            };
            watch_build(api, &tid, &build.build_id, &template, None).await
        }
    }
}

/// Whether `t` looks like a UUID (a snapshot ID; template IDs are 20 characters).
fn is_uuid(t: &str) -> bool {
    t.len() == 36
        && t.char_indices().all(|(i, c)| {
            if matches!(i, 8 | 13 | 18 | 23) {
                c == '-'
            } else {
                c.is_ascii_hexdigit()
            }
        })
}

/// "template X not found" for a 404 (or a name the server refuses) on `t`.
fn not_found(t: &str, e: ApiError) -> CliError {
    match e {
        ApiError::Status {
            status: 404 | 400, ..
        } => CliError::Usage(format!(
            "template {t} not found; list templates with `aenv template ls`"
        )),
        e => CliError::Api(e),
    }
}

/// `GET /templates/{t}`: the template (by name, `name:tag` or ID) and its builds.
async fn detail(api: &Api, t: &str) -> Result<TemplateDetail, CliError> {
    let path = format!("/templates/{}", api::seg(t));
    let d: Option<TemplateDetail> = api.get_json(&path).await.map_err(|e| not_found(t, e))?;
    Ok(d.unwrap_or_default())
}

/// The ID of template or snapshot `t` (name or ID), and which of the two it is.
async fn resolve(api: &Api, t: &str) -> Result<(String, &'static str), CliError> {
    if is_uuid(t) {
        return Ok((t.to_ascii_lowercase(), "snapshot"));
    }
    match detail(api, t).await {
        Ok(d) => {
            return Ok((d.template_id.unwrap_or_else(|| t.to_string()), "template"));
        }
        Err(CliError::Usage(_)) => {}
        Err(e) => return Err(e),
    }
    // Snapshots are templates to the SDKs; their names resolve here.
    let path = format!("/templates/aliases/{}", api::seg(t));
    let alias: Option<TemplateAlias> = api.get_json(&path).await.map_err(|e| not_found(t, e))?;
    match alias.and_then(|a| a.template_id) {
        Some(id) => Ok((id, "snapshot")),
        None => Err(not_found(
            t,
            ApiError::Status {
                status: 404,
                message: String::new(),
            },
        )),
    }
}

/// Creates template `name` of `size` (or a new build of the template of that name)
/// and returns its template and build IDs.
pub async fn create_template(
    api: &Api,
    name: String,
    size: &TemplateSize,
) -> Result<(String, String), CliError> {
    let new = NewTemplate {
        name,
        cpu_count: size.cpu,
        memory_mb: size.memory,
    };
    const PATH: &str = "/v3/templates";
    let created: Option<TemplateCreated> = api.send(Method::POST, PATH, Some(&new)).await?;
    let created = created.unwrap_or_default();
    let missing = |k: &str| {
        CliError::Api(ApiError::BadResponse {
            path: PATH.into(),
            reason: format!("no {k}"),
        })
    };
    let tid = created.template_id.ok_or_else(|| missing("templateID"))?;
    let bid = created.build_id.ok_or_else(|| missing("buildID"))?;
    Ok((tid, bid))
}

/// Starts build `bid` of template `tid` with `build`.
pub async fn start_build(
    api: &Api,
    tid: &str,
    bid: &str,
    build: &BuildRequest,
) -> Result<(), CliError> {
    let path = format!("/v2/templates/{}/builds/{}", api::seg(tid), api::seg(bid));
    api.send::<IgnoredAny>(Method::POST, &path, Some(build))
        .await?;
    Ok(())
}

/// Creates template `name` of `size`, starts its build; prints and returns the
/// template and build IDs.
pub async fn create_and_build(
    api: &Api,
    name: String,
    size: TemplateSize,
    build: BuildRequest,
) -> Result<(String, String), CliError> {
    let (tid, bid) = create_template(api, name, &size).await?;
    start_build(api, &tid, &bid, &build).await?;
    println!("Created template {tid} (build {bid})");
    Ok((tid, bid))
}

/// How often a followed build is polled.
const POLL: std::time::Duration = std::time::Duration::from_millis(250);

/// Follows a build: prints its log lines as they come (stdout), a spinner with its
/// status on a terminal (stderr); 0 when it is ready, an error naming the reason and
/// the step when it failed, or when `limit` seconds pass.
pub async fn watch_build(
    api: &Api,
    tid: &str,
    bid: &str,
    name: &str,
    limit: Option<u64>,
) -> Result<i32, CliError> {
    let base = format!(
        "/templates/{}/builds/{}/status",
        api::seg(tid),
        api::seg(bid)
    );
    let bar = output::spinner("Build status: ...");
    let finish = || {
        if let Some(b) = &bar {
            b.finish_and_clear();
        }
    };
    let print = |line: &str| match &bar {
        Some(b) => b.suspend(|| println!("{line}")),
        None => println!("{line}"),
    };
    let deadline = limit.map(|s| tokio::time::Instant::now() + std::time::Duration::from_secs(s));
    let mut offset = 0usize;
    let mut unknown_seen = std::collections::BTreeSet::new();
    loop {
        let path = format!("{base}?logsOffset={offset}");
        let st: Option<BuildStatus> = match api.get_json(&path).await {
            Ok(st) => st,
            Err(e) => {
                finish();
                return Err(match e {
                    ApiError::Status { status: 404, .. } => {
                        CliError::Usage(format!("build {bid} of template {name} not found"))
                    }
                    e => CliError::Api(e),
                });
            }
        };
        let st = st.unwrap_or_default();
        if st.template_id.as_ref().is_some_and(|t| t != tid)
            || st.build_id.as_ref().is_some_and(|b| b != bid)
        {
            finish();
            return Err(CliError::Usage("Build status response mismatch".into()));
        }
        let got = st.log_entries.len();
        for e in &st.log_entries {
            print(&e.message);
        }
        offset += got;
        let status = st.status.as_deref().unwrap_or("");
        match status {
            // Finished: drain the log first (the last answer carries no entries).
            "ready" | "error" if got > 0 => continue,
            "ready" => {
                finish();
                println!("Build succeeded: template {name} ({tid}) is ready.");
                return Ok(0);
            }
            "error" => {
                finish();
                let reason = st.reason.unwrap_or_default();
                let msg = reason.message.as_deref().unwrap_or("unknown reason");
                let step = reason
                    .step
                    .map(|s| format!(" (step: {s})"))
                    .unwrap_or_default();
                return Err(CliError::Usage(format!("Build failed: {msg}{step}")));
            }
            s @ ("waiting" | "building") => {
                if let Some(b) = &bar {
                    b.set_message(format!("Build status: {s}"));
                }
            }
            other => {
                if unknown_seen.insert(other.to_string()) {
                    eprintln!("Build returned unknown status: {other}");
                }
            }
        }
        if deadline.is_some_and(|d| tokio::time::Instant::now() >= d) {
            finish();
            return Err(CliError::Usage(format!(
                "Timed out waiting for build. Resume with: aenv template watch {name}"
            )));
        }
        if got == 0 {
            tokio::time::sleep(POLL).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_ids_are_not_uuids() {
        assert!(is_uuid("0b5c3a5e-1c2d-4e5f-8a9b-0c1d2e3f4a5b"));
        assert!(!is_uuid("abcdefghij0123456789"));
        assert!(!is_uuid("my-template"));
    }
}

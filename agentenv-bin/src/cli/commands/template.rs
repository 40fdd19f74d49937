//! `aenv template ls|rm|watch`, and what `pull` and `build` share with them: creating a
//! template and starting its build, resolving a name to an ID, following a build.

use clap::Subcommand;
use http::Method;
use serde::de::IgnoredAny;

use crate::cli::api::{self, Api, ApiError};
use crate::cli::args::{OutputOpt, TemplateSize};
use crate::cli::model::{
    BuildRequest, BuildStatus, Listed, NewTemplate, TemplateAlias, TemplateCreated, TemplateInfo,
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
    /// Delete a template (name or ID); also deletes snapshots.
    #[command(
        visible_alias = "rm",
        after_help = "Example:\n  aenv template rm my-template"
    )]
    Delete { template: String },
    /// Follow a template build until it is ready or fails.
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
            let id = resolve(api, &template).await?;
            let path = format!("/templates/{}", api::seg(&id));
            api.send::<IgnoredAny>(Method::DELETE, &path, None::<&()>)
                .await?;
            println!("Deleted template {id}");
            Ok(0)
        }
        TemplateCmd::Watch { template } => {
            let id = resolve(api, &template).await?;
            // The build ID of a template is its template ID.
            watch_build(api, &id, &id, &template, None).await
        }
    }
}

/// The ID of template `t`: `t` itself when it is a UUID, else what its alias names.
async fn resolve(api: &Api, t: &str) -> Result<String, CliError> {
    let is_uuid = t.len() == 36 && t.bytes().filter(|b| *b == b'-').count() == 4;
    if is_uuid {
        return Ok(t.to_string());
    }
    let path = format!("/templates/aliases/{}", api::seg(t));
    let alias: Option<TemplateAlias> = api.get_json(&path).await?;
    alias.and_then(|a| a.template_id).ok_or_else(|| {
        CliError::Api(ApiError::BadResponse {
            path,
            reason: "no templateID".into(),
        })
    })
}

/// Creates template `name` of `size` and starts its build; prints and returns the
/// template and build IDs.
pub async fn create_and_build(
    api: &Api,
    name: String,
    size: TemplateSize,
    build: BuildRequest,
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
    let path = format!("/v2/templates/{}/builds/{}", api::seg(&tid), api::seg(&bid));
    api.send::<IgnoredAny>(Method::POST, &path, Some(&build))
        .await?;
    println!("Created template {tid} (build {bid})");
    Ok((tid, bid))
}

/// Polls a build's status once a second until it is ready, fails or `limit` passes.
pub async fn watch_build(
    api: &Api,
    tid: &str,
    bid: &str,
    name: &str,
    limit: Option<u64>,
) -> Result<i32, CliError> {
    let path = format!(
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
    let deadline = limit.map(|s| tokio::time::Instant::now() + std::time::Duration::from_secs(s));
    let mut unknown_seen = std::collections::BTreeSet::new();
    loop {
        let st: Option<BuildStatus> = api.get_json(&path).await?;
        let st = st.unwrap_or_default();
        if st.template_id.is_some_and(|t| t != tid) || st.build_id.is_some_and(|b| b != bid) {
            finish();
            return Err(CliError::Usage("Build status response mismatch".into()));
        }
        match st.status.as_deref().unwrap_or("") {
            "ready" => {
                finish();
                println!("Build succeeded: template {tid} is ready.");
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
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
}

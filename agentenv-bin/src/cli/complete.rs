//! Shell completion: the registration script `aenv completion <shell>` prints calls
//! back into `aenv` (`COMPLETE=<shell> aenv -- …`), which completes commands and flags
//! and offers live sandbox IDs (running ones for exec, pause, timeout, upload,
//! download and snapshot create; paused ones for resume; all for connect and delete),
//! and node IDs for `aenv node drain|undrain`.

use std::io::Write;
use std::time::Duration;

use clap_complete::CompletionCandidate;
use clap_complete::env::EnvCompleter;

use super::api::Api;
use super::credentials;

/// The environment variable that switches `aenv` into completion mode.
pub const VAR: &str = "COMPLETE";
const BUDGET: Duration = Duration::from_secs(1);

/// Writes the registration script for `shell`, calling back into `completer`.
pub fn write_registration(
    shell: clap_complete::Shell,
    completer: &str,
    out: &mut dyn Write,
) -> std::io::Result<()> {
    let s: &dyn EnvCompleter = match shell {
        clap_complete::Shell::Bash => &clap_complete::env::Bash,
        clap_complete::Shell::Zsh => &clap_complete::env::Zsh,
        clap_complete::Shell::Fish => &clap_complete::env::Fish,
        clap_complete::Shell::Elvish => &clap_complete::env::Elvish,
        _ => &clap_complete::env::Powershell,
    };
    s.write_registration(VAR, "aenv", "aenv", completer, out)
}

/// What `ask` finds on the saved server, sorted, as candidates; empty when there are no
/// credentials or the server does not answer within [`BUDGET`] (completion must never
/// hang a shell).
fn candidates<F, Fut>(ask: F) -> Vec<CompletionCandidate>
where
    F: FnOnce(Api) -> Fut,
    Fut: std::future::Future<Output = Option<Vec<String>>>,
{
    let Ok(creds) = credentials::load() else {
        return Vec::new();
    };
    let Ok(api) = Api::new(&creds) else {
        return Vec::new();
    };
    let Ok(rt) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        return Vec::new();
    };
    let mut v = rt
        .block_on(async { tokio::time::timeout(BUDGET, ask(api)).await })
        .ok()
        .flatten()
        .unwrap_or_default();
    v.sort();
    v.into_iter().map(CompletionCandidate::new).collect()
}

/// Live sandbox IDs in `state` (any state when `None`).
fn ids(state: Option<&'static str>) -> Vec<CompletionCandidate> {
    candidates(|api| async move {
        let items = api.list_all(&[], 100).await.ok()?;
        Some(
            items
                .into_iter()
                .filter(|s| state.is_none() || s.state.as_deref() == state)
                .map(|s| s.sandbox_id)
                .collect(),
        )
    })
}

/// The IDs of the nodes `GET /nodes` lists.
pub fn nodes() -> Vec<CompletionCandidate> {
    #[derive(serde::Deserialize)]
    struct Node {
        id: String,
    }
    candidates(|api| async move {
        let nodes = api.get_json::<Vec<Node>>("/nodes").await.ok()?;
        Some(nodes.into_iter().map(|n| n.id).collect())
    })
}

/// Running sandboxes.
pub fn running() -> Vec<CompletionCandidate> {
    ids(Some("running"))
}

/// Paused sandboxes.
pub fn paused() -> Vec<CompletionCandidate> {
    ids(Some("paused"))
}

/// Every sandbox.
pub fn any() -> Vec<CompletionCandidate> {
    ids(None)
}

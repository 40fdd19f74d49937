//! What the commands that reach into a sandbox share: the agent client of a running
//! sandbox, process selectors, exit codes as a shell reports them, and telling whether a
//! broken process stream means the sandbox was paused or deleted.

use agentenv_guest::client::GuestClient;
use agentenv_guest::proto::process as pr;

use super::CliError;
use super::api::Api;

/// The agent client of a running sandbox (with its access token), acting as `user`.
pub async fn agent_for(api: &Api, id: &str, user: Option<&str>) -> Result<GuestClient, CliError> {
    let d = api.get(id).await?;
    if d.is_paused() {
        return Err(CliError::Paused(id.to_string()));
    }
    let mut c = api.agent(id, d.envd_access_token.as_deref())?;
    if let Some(u) = user {
        c = c.with_user(u);
    }
    Ok(c)
}

/// Selects process `pid`.
pub fn selector(pid: u32) -> pr::ProcessSelector {
    pr::ProcessSelector {
        selector: Some(pr::process_selector::Selector::Pid(pid)),
    }
}

/// The local exit code for a remote end event: the code, or 128+signal when a signal
/// ended the process (as a shell reports it).
pub fn exit_code(e: &pr::process_event::EndEvent) -> i32 {
    if e.exited || e.exit_code >= 0 {
        return e.exit_code.clamp(0, 255);
    }
    let sig = match e.status.strip_prefix("signal: ").unwrap_or("") {
        "hangup" => 1,
        "interrupt" => 2,
        "quit" => 3,
        "aborted" => 6,
        "killed" => 9,
        "segmentation fault" => 11,
        "broken pipe" => 13,
        "terminated" => 15,
        _ => 0,
    };
    if sig == 0 { 1 } else { 128 + sig }
}

/// Where a sandbox went when its process stream broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gone {
    Deleted,
    Paused,
}

/// Whether sandbox `id` was deleted or paused; `None` when it still runs, or when the
/// server cannot tell.
pub async fn gone(api: &Api, id: &str) -> Option<Gone> {
    match api.get_opt(id).await {
        Ok(None) => Some(Gone::Deleted),
        Ok(Some(d)) if d.is_paused() => Some(Gone::Paused),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_follow_shell_conventions() {
        let end = |code, exited, status: &str| pr::process_event::EndEvent {
            exit_code: code,
            exited,
            status: status.into(),
            error: None,
        };
        assert_eq!(exit_code(&end(7, true, "exit status 7")), 7);
        assert_eq!(exit_code(&end(-1, false, "signal: killed")), 137);
        assert_eq!(exit_code(&end(-1, false, "signal: terminated")), 143);
        assert_eq!(exit_code(&end(-1, false, "weird")), 1);
    }
}

//! `aenv node move`: the paused sandboxes of a node move to other nodes through the
//! gateway (`POST /nodes/{id}/move`), with each sandbox's outcome printed as it comes.

use std::time::Duration;

use http::Method;
use serde::{Deserialize, Serialize};

use crate::cli::CliError;
use crate::cli::api::{self, Api};

/// The longest the gateway may take over one step of one sandbox's move (it reports after
/// each sandbox).
const IDLE: Duration = Duration::from_secs(15 * 60);

#[derive(Debug, Serialize)]
struct MoveBody {
    #[serde(rename = "sandboxIDs", skip_serializing_if = "Option::is_none")]
    sandbox_ids: Option<Vec<String>>,
    #[serde(rename = "targetNodeID", skip_serializing_if = "Option::is_none")]
    target_node_id: Option<String>,
}

/// One progress line of the gateway.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Event {
    event: String,
    #[serde(rename = "sandboxID")]
    sandbox_id: String,
    sandboxes: Vec<String>,
    to: String,
    ms: u64,
    message: String,
    moved: u64,
    failed: u64,
}

/// Moves the paused sandboxes of `node_id`; exit code 1 when any stayed.
pub async fn run(
    api: &Api,
    node_id: &str,
    to: Option<String>,
    sandboxes: Vec<String>,
    json: bool,
) -> Result<i32, CliError> {
    let id = node_id.trim();
    if id.is_empty() {
        return Err(CliError::Usage(
            "the node ID is empty; list nodes with `aenv node ls`".into(),
        ));
    }
    let body = MoveBody {
        sandbox_ids: (!sandboxes.is_empty()).then_some(sandboxes),
        target_node_id: to.map(|t| t.trim().to_string()),
    };
    let mut failed = 0u64;
    let mut finished = false;
    let mut bad_line = None;
    let path = format!("/nodes/{}/move", api::seg(id));
    api.stream_lines(Method::POST, &path, &body, IDLE, |line| {
        if json {
            println!("{}", String::from_utf8_lossy(line));
        }
        let ev: Event = match serde_json::from_slice(line) {
            Ok(e) => e,
            Err(e) => {
                bad_line = Some(format!("{e}: {}", String::from_utf8_lossy(line)));
                return;
            }
        };
        match ev.event.as_str() {
            "failed" | "error" => failed += 1,
            "done" => finished = true,
            _ => {}
        }
        if !json && let Some(text) = describe(id, &ev) {
            println!("{text}");
        }
    })
    .await?;
    if let Some(b) = bad_line {
        return Err(CliError::Usage(format!(
            "the gateway sent a line this aenv does not read ({b}); upgrade aenv"
        )));
    }
    if !finished {
        eprintln!(
            "the move of {id} ended early (the gateway went away?): run `aenv node move {id}` again for the rest"
        );
        return Ok(1);
    }
    Ok(i32::from(failed > 0))
}

/// What one progress line says, for a person.
fn describe(node_id: &str, ev: &Event) -> Option<String> {
    Some(match ev.event.as_str() {
        "start" if ev.sandboxes.is_empty() => format!("{node_id} has no paused sandbox to move"),
        "start" => format!(
            "moving {} paused sandbox{} of {node_id}",
            ev.sandboxes.len(),
            if ev.sandboxes.len() == 1 { "" } else { "es" }
        ),
        "moved" => format!("moved  {} -> {} ({} ms)", ev.sandbox_id, ev.to, ev.ms),
        "failed" => format!("FAILED {}: {}", ev.sandbox_id, ev.message),
        "error" => format!("error: {}", ev.message),
        "done" => format!("done: {} moved, {} failed", ev.moved, ev.failed),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(json: &str) -> Event {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn progress_lines_read_as_sentences() {
        let start = ev(r#"{"event":"start","nodeID":"n1","sandboxes":["a","b"]}"#);
        assert_eq!(
            describe("n1", &start).unwrap(),
            "moving 2 paused sandboxes of n1"
        );
        let none = ev(r#"{"event":"start","nodeID":"n1","sandboxes":[]}"#);
        assert_eq!(
            describe("n1", &none).unwrap(),
            "n1 has no paused sandbox to move"
        );
        let moved = ev(r#"{"event":"moved","sandboxID":"a","to":"n2","ms":41}"#);
        assert_eq!(describe("n1", &moved).unwrap(), "moved  a -> n2 (41 ms)");
        let failed = ev(r#"{"event":"failed","sandboxID":"b","message":"n2 did not take it"}"#);
        assert_eq!(
            describe("n1", &failed).unwrap(),
            "FAILED b: n2 did not take it"
        );
        let done = ev(r#"{"event":"done","moved":1,"failed":1}"#);
        assert_eq!(describe("n1", &done).unwrap(), "done: 1 moved, 1 failed");
        assert!(describe("n1", &ev(r#"{"event":"later"}"#)).is_none());
    }
}

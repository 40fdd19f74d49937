//! `aenv node ls|drain|undrain|move`: the runtime nodes as the scheduler sees them,
//! taking one out of placement (and back) without touching its sandboxes, and moving its
//! paused sandboxes to other nodes.

use std::time::{SystemTime, UNIX_EPOCH};

use clap::Subcommand;
use clap_complete::ArgValueCandidates;
use http::Method;
use serde::Deserialize;
use serde::de::IgnoredAny;

use crate::cli::api::{self, Api};
use crate::cli::args::{OutputArg, OutputOpt};
use crate::cli::model::Listed;
use crate::cli::output::{self, Format};
use crate::cli::{CliError, complete, io_err};

/// `aenv node` subcommands.
#[derive(Debug, Subcommand)]
pub enum NodeCmd {
    /// List the runtime nodes.
    ///
    /// Each node's status (ready, connecting, unhealthy, draining; unspecified while it
    /// leaves the node list), its running and paused sandboxes, CPU and memory allocated
    /// to sandboxes, and the age of its last heartbeat. Nodes that never sent a
    /// heartbeat are not listed.
    #[command(
        visible_alias = "ls",
        after_help = "Examples:\n  aenv node ls\n  aenv node ls --json | jq '.[] | select(.status == \"draining\") | .id'"
    )]
    List {
        #[command(flatten)]
        output: OutputOpt,
        /// Print JSON (the same as `-o json`).
        #[arg(long, conflicts_with = "output")]
        json: bool,
    },
    /// Stop placing new sandboxes on a node.
    ///
    /// Its sandboxes keep running and stay reachable; the node shows as `draining`
    /// until `aenv node undrain`. A scheduler restart forgets drains (drain again).
    #[command(after_help = "Example:\n  aenv node drain node-b")]
    Drain {
        /// The node's ID (see `aenv node ls`).
        #[arg(add = ArgValueCandidates::new(complete::nodes))]
        node_id: String,
    },
    /// Move a node's paused sandboxes to other nodes.
    ///
    /// Each paused sandbox is published to the shared snapshot repository, taken over
    /// by a ready node (the least loaded first; draining nodes take none) under the same
    /// ID, and deleted from this node; the gateway routes it to its new node at once. A
    /// moved sandbox starts afresh on its files when resumed. Running sandboxes stay:
    /// pause them first. Progress is printed as each sandbox moves; the exit code is 1
    /// when any could not be moved (it then stays where it was, paused).
    #[command(
        after_help = "Examples:\n  aenv node drain node-b && aenv node move node-b\n  aenv node move node-b --to node-c --sandbox <id>"
    )]
    Move {
        /// The node's ID (see `aenv node ls`).
        #[arg(add = ArgValueCandidates::new(complete::nodes))]
        node_id: String,
        /// Only to this node (default: the least loaded ready nodes, in turn).
        #[arg(long, value_name = "NODE_ID", add = ArgValueCandidates::new(complete::nodes))]
        to: Option<String>,
        /// Only this sandbox (repeat for more; default: every paused sandbox of the node).
        #[arg(long = "sandbox", value_name = "SANDBOX_ID")]
        sandboxes: Vec<String>,
        /// Print the progress as JSON lines, as the gateway sends them.
        #[arg(long)]
        json: bool,
    },
    /// Let a drained node take new sandboxes again.
    #[command(after_help = "Example:\n  aenv node undrain node-b")]
    Undrain {
        /// The node's ID (see `aenv node ls`).
        #[arg(add = ArgValueCandidates::new(complete::nodes))]
        node_id: String,
    },
}

/// The fields of a `GET /nodes` item the table shows.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct NodeInfo {
    pub id: String,
    pub status: String,
    pub sandbox_count: u64,
    pub sandbox_paused_count: u64,
    /// Started sandboxes the node keeps ready for creates.
    pub sandbox_pooled_count: u64,
    pub metrics: NodeMetrics,
    pub last_heartbeat_unix_ms: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct NodeMetrics {
    #[serde(rename = "allocatedCPU")]
    pub allocated_cpu: u64,
    #[serde(rename = "cpuCount")]
    pub cpu_count: u64,
    #[serde(rename = "allocatedMemoryBytes")]
    pub allocated_memory_bytes: u64,
    #[serde(rename = "memoryTotalBytes")]
    pub memory_total_bytes: u64,
}

/// Runs one node subcommand.
pub async fn run(api: &Api, cmd: NodeCmd) -> Result<i32, CliError> {
    match cmd {
        NodeCmd::List { output, json } => {
            let format = if json {
                OutputOpt {
                    output: Some(OutputArg::Json),
                }
                .format()
            } else {
                output.format()
            };
            let nodes = list(api).await?;
            print_nodes(&nodes, format).map_err(io_err("writing the list"))?;
            Ok(0)
        }
        NodeCmd::Drain { node_id } => {
            set_draining(api, &node_id, true).await?;
            let node = find(api, &node_id).await?;
            println!("{}", drained_message(&node_id, node.as_ref()));
            Ok(0)
        }
        NodeCmd::Move {
            node_id,
            to,
            sandboxes,
            json,
        } => super::node_move::run(api, &node_id, to, sandboxes, json).await,
        NodeCmd::Undrain { node_id } => {
            set_draining(api, &node_id, false).await?;
            let node = find(api, &node_id).await?;
            let status = node.map_or_else(|| "no heartbeat yet".into(), |n| n.status);
            println!("{node_id} takes new sandboxes again (status: {status})");
            Ok(0)
        }
    }
}

async fn set_draining(api: &Api, node_id: &str, drain: bool) -> Result<(), CliError> {
    let id = node_id.trim();
    if id.is_empty() {
        return Err(CliError::Usage(
            "the node ID is empty; list nodes with `aenv node ls`".into(),
        ));
    }
    let path = format!("/nodes/{}/drain", api::seg(id));
    let method = if drain { Method::POST } else { Method::DELETE };
    api.send::<IgnoredAny>(method, &path, None::<&()>).await?;
    Ok(())
}

/// Every node, sorted by id.
async fn list(api: &Api) -> Result<Vec<Listed<NodeInfo>>, CliError> {
    let mut nodes: Vec<Listed<NodeInfo>> = api.get_json("/nodes").await?;
    nodes.sort_by(|a, b| a.item.id.cmp(&b.item.id));
    Ok(nodes)
}

async fn find(api: &Api, node_id: &str) -> Result<Option<NodeInfo>, CliError> {
    Ok(list(api)
        .await?
        .into_iter()
        .map(|l| l.item)
        .find(|n| n.id == node_id.trim()))
}

/// What `aenv node drain` prints.
fn drained_message(node_id: &str, node: Option<&NodeInfo>) -> String {
    let head = format!("{node_id} is draining: no new sandboxes are placed there");
    match node {
        Some(n) => format!(
            "{head}; {} running, {} paused remain",
            n.sandbox_count, n.sandbox_paused_count
        ),
        None => format!("{head} (it has not sent a heartbeat yet)"),
    }
}

fn print_nodes(nodes: &[Listed<NodeInfo>], f: Format) -> std::io::Result<()> {
    if f == Format::Json {
        let raw: Vec<&serde_json::Value> = nodes.iter().map(|l| &l.raw).collect();
        return output::write_json(&raw);
    }
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    let rows: Vec<Vec<String>> = nodes.iter().map(|l| row(&l.item, now_ms)).collect();
    output::write_stdout(&output::table(
        &[
            "NODE",
            "STATUS",
            "RUNNING",
            "PAUSED",
            "POOLED",
            "CPU (ALLOC/TOTAL)",
            "MEMORY (ALLOC/TOTAL)",
            "LAST HEARTBEAT",
        ],
        &rows,
    ))
}

fn row(n: &NodeInfo, now_ms: i64) -> Vec<String> {
    let m = &n.metrics;
    vec![
        n.id.clone(),
        n.status.clone(),
        n.sandbox_count.to_string(),
        n.sandbox_paused_count.to_string(),
        n.sandbox_pooled_count.to_string(),
        format!("{}/{}", m.allocated_cpu, m.cpu_count),
        format!(
            "{}/{}",
            gib(m.allocated_memory_bytes),
            gib(m.memory_total_bytes)
        ),
        n.last_heartbeat_unix_ms
            .filter(|ms| *ms > 0)
            .map_or_else(|| "-".into(), |ms| ago(now_ms - ms)),
    ]
}

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

fn ago(ms: i64) -> String {
    let s = ms.max(0) / 1000;
    match s {
        0..60 => format!("{s}s ago"),
        60..3600 => format!("{}m{}s ago", s / 60, s % 60),
        _ => format!("{}h{}m ago", s / 3600, (s % 3600) / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(json: &str) -> NodeInfo {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn a_row_shows_counts_pooled_allocation_and_heartbeat_age() {
        let n = node(
            r#"{"id":"node-b","status":"draining","sandboxCount":3,"sandboxPausedCount":1,
                "sandboxPooledCount":2,"metrics":{"allocatedCPU":2,"cpuCount":8,"allocatedMemoryBytes":1073741824,
                "memoryTotalBytes":17179869184},"lastHeartbeatUnixMs":1000}"#,
        );
        assert_eq!(
            row(&n, 4_500),
            [
                "node-b",
                "draining",
                "3",
                "1",
                "2",
                "2/8",
                "1.0 GiB/16.0 GiB",
                "3s ago"
            ]
        );
        // An older gateway sends no heartbeat time.
        let n = node(r#"{"id":"node-a","status":"ready"}"#);
        assert_eq!(row(&n, 0)[7], "-");
        assert_eq!(
            row(&n, 0)[4],
            "0",
            "an older gateway reports no pooled sandboxes"
        );
        assert_eq!(ago(125_000), "2m5s ago");
    }

    #[test]
    fn drain_says_what_remains_on_the_node() {
        let n = node(r#"{"id":"node-b","sandboxCount":3,"sandboxPausedCount":2}"#);
        assert_eq!(
            drained_message("node-b", Some(&n)),
            "node-b is draining: no new sandboxes are placed there; 3 running, 2 paused remain"
        );
        assert!(drained_message("node-c", None).ends_with("(it has not sent a heartbeat yet)"));
    }
}

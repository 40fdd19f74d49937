//! `aenv ls`: every sandbox, filtered by state and metadata.

use clap::Args;

use crate::cli::api::{self, Api};
use crate::cli::args::{OutputOpt, parse_kv};
use crate::cli::model::ListedSandbox;
use crate::cli::{CliError, io_err, output};

/// List sandboxes (every page).
#[derive(Debug, Args)]
#[command(
    visible_alias = "ls",
    after_help = "\
Examples:
  aenv ls
  aenv ls --state paused
  aenv ls --metadata team=ml --metadata env=dev -o json | jq '.[].sandboxID'"
)]
pub struct ListArgs {
    #[command(flatten)]
    pub output: OutputOpt,
    /// Only sandboxes in this state (running or paused); repeatable.
    #[arg(long, value_parser = ["running", "paused"])]
    pub state: Vec<String>,
    /// Only sandboxes whose metadata has KEY=VALUE; repeatable (all must match).
    #[arg(long, value_name = "KEY=VALUE", value_parser = parse_kv)]
    pub metadata: Vec<(String, String)>,
    /// Sandboxes per request (every page is fetched either way).
    #[arg(long, hide = true, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub page_size: u32,
}

/// Lists with the filters in the query, and applies them here too.
pub async fn run(api: &Api, args: ListArgs) -> Result<i32, CliError> {
    let mut q = Vec::new();
    if !args.state.is_empty() {
        q.push(("state".to_string(), args.state.join(",")));
    }
    if !args.metadata.is_empty() {
        q.push(("metadata".to_string(), api::encode_query(&args.metadata)));
    }
    let mut items = api.list_all(&q, args.page_size).await?;
    // Older servers ignore filters; apply them here as well.
    items.retain(|s| matches(&args.state, &args.metadata, s));
    output::sandboxes(&items, args.output.format()).map_err(io_err("writing the list"))?;
    Ok(0)
}

/// Whether `s` is in one of `states` (any when empty) and has every metadata pair.
fn matches(states: &[String], metadata: &[(String, String)], s: &ListedSandbox) -> bool {
    let in_state = states.is_empty() || s.state.as_ref().is_some_and(|st| states.contains(st));
    let md = s.metadata.as_ref();
    in_state
        && metadata
            .iter()
            .all(|(k, v)| md.and_then(|m| m.get(k)) == Some(v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_filters_match_all_pairs_locally() {
        let s = ListedSandbox {
            sandbox_id: "id".into(),
            template_id: None,
            alias: None,
            state: Some("running".into()),
            cpu_count: None,
            memory_mb: None,
            disk_size_mb: None,
            started_at: None,
            end_at: None,
            metadata: Some([("a".to_string(), "x=y".to_string())].into()),
        };
        let pairs = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        assert!(matches(&[], &pairs(&[("a", "x=y")]), &s));
        assert!(!matches(&[], &pairs(&[("a", "x=y"), ("b", "1")]), &s));
        assert!(matches(&[], &[], &s));
        assert!(matches(&["paused".into(), "running".into()], &[], &s));
        assert!(!matches(&["paused".into()], &[], &s));
    }
}

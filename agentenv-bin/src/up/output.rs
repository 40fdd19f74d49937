//! What the user of `agentenv up` sees: progress lines, the children's log lines worth
//! showing (warnings, errors, template build progress), and the banner of the running
//! cluster.

use std::io::Write as _;
use std::sync::Arc;

use serde::Deserialize;

use super::{ClusterInfo, ENVD_PORT};

/// Where the user sees progress; stdout in the binary, captured in tests.
pub type Out = Arc<dyn Fn(&str) + Send + Sync>;

/// An out that prints to stdout.
pub fn stdout_out() -> Out {
    Arc::new(|line| {
        let mut o = std::io::stdout().lock();
        let _ = writeln!(o, "{line}");
        let _ = o.flush();
    })
}

/// The fields of a child's JSON log line that `agentenv up` reads.
#[derive(Debug, Clone, Default, Deserialize)]
pub(crate) struct LogLine {
    #[serde(default)]
    pub message: String,
    #[serde(default)]
    pub level: String,
    #[serde(default)]
    pub target: String,
    /// The scheduler's gRPC address, in its "scheduler listening" line.
    #[serde(default)]
    pub grpc_addr: Option<String>,
    /// The gateway's HTTP address, in its "gateway listening" line.
    #[serde(default)]
    pub http_addr: Option<String>,
}

/// The banner: gateway URL, key and first commands. With `--tls`, the URL is
/// `https://` and clients are told to trust the cluster's CA (`SSL_CERT_FILE` for
/// the E2B SDKs and `aenv`, `--cacert` for curl).
pub(crate) fn banner(info: &ClusterInfo) -> String {
    let gw = info.gateway_url();
    let key = &info.api_key;
    let (ca_line, ca_export, curl) = match &info.tls {
        Some(t) => (
            format!("\n  CA        {} (trust it: SSL_CERT_FILE)", t.ca.display()),
            format!(" SSL_CERT_FILE={}", t.ca.display()),
            "curl --cacert $SSL_CERT_FILE",
        ),
        None => (String::new(), String::new(), "curl"),
    };
    format!(
        "\nAgentENV is up: {n} nodes behind one gateway.\n\n  Gateway   {gw}\n  API key   {key}{ca_line}\n  Logs      {logs}\n\nTry it (another terminal):\n\n  export AENV_URL={gw} AENV_API_KEY={key}{ca_export}\n  {curl} -s -H \"X-API-Key: $AENV_API_KEY\" $AENV_URL/nodes\n  read -r ID TOKEN < <({curl} -s -X POST -H \"X-API-Key: $AENV_API_KEY\" -H 'content-type: application/json' \\\n       -d '{{\"templateID\":\"base\"}}' $AENV_URL/sandboxes | python3 -c 'import json,sys; s=json.load(sys.stdin); print(s[\"sandboxID\"], s[\"envdAccessToken\"])')\n  {curl} -s -H \"E2b-Sandbox-Id: $ID\" -H \"E2b-Sandbox-Port: {port}\" -H \"X-Access-Token: $TOKEN\" \"$AENV_URL/files?path=/etc/os-release\"\n  {curl} -s -X DELETE -H \"X-API-Key: $AENV_API_KEY\" $AENV_URL/sandboxes/$ID\n\nE2B SDKs: E2B_API_URL={gw} E2B_SANDBOX_URL={gw} E2B_API_KEY={key}{ca_export}\naenv CLI: with the exports above, `aenv auth` saves them; then `aenv start base`\n\nCtrl-C stops everything (sandboxes included).",
        n = info.nodes.len(),
        logs = info.data_dir.join("logs").display(),
        port = ENVD_PORT,
    )
}

/// Condenses debootstrap's per-package lines (`I: Retrieving x`, `I: Validating x`, ...):
/// within a stretch of such lines only the first of each kind is shown, so a template
/// build shows a dozen lines, not hundreds.
#[derive(Default)]
pub(crate) struct Progress {
    seen: std::collections::HashSet<String>,
}

impl Progress {
    /// Whether `line` is one more per-package line of a kind already shown.
    pub fn repeats(&mut self, line: &str) -> bool {
        let verb = line
            .strip_prefix("I: ")
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_default();
        let per_package = matches!(
            verb,
            "Retrieving" | "Validating" | "Extracting" | "Unpacking" | "Configuring" | "Installing"
        );
        if !per_package {
            self.seen.clear();
            return false;
        }
        !self.seen.insert(verb.to_string())
    }
}

/// Which child log lines the user sees: warnings, errors, template build progress, and
/// anything that is not a JSON log line (a fatal error printed on stderr).
pub(crate) fn shown_line(log: Option<&LogLine>, raw: &str, verbose: bool) -> Option<String> {
    let Some(l) = log else {
        return (!raw.trim().is_empty()).then(|| raw.to_string());
    };
    let (msg, level) = (&l.message, &l.level);
    if verbose {
        return Some(format!("{level} {msg}"));
    }
    if l.target.ends_with("::template") {
        return Some(msg.to_string());
    }
    matches!(level.as_str(), "WARN" | "ERROR" | "warn" | "error").then(|| format!("{level} {msg}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_progress_shows_the_first_line_of_each_debootstrap_stage() {
        let mut p = Progress::default();
        let shown: Vec<&str> = [
            "building template base: debootstrap --variant=minbase bookworm",
            "I: Retrieving InRelease",
            "I: Checking Release signature",
            "I: Retrieving adduser 3.134",
            "I: Validating adduser 3.134",
            "I: Retrieving apt 2.6.1",
            "I: Validating apt 2.6.1",
            "I: Extracting bash",
            "I: Extracting dash",
            "I: Base system installed successfully.",
        ]
        .into_iter()
        .filter(|l| !p.repeats(l))
        .collect();
        assert_eq!(
            shown,
            [
                "building template base: debootstrap --variant=minbase bookworm",
                "I: Retrieving InRelease",
                "I: Checking Release signature",
                "I: Retrieving adduser 3.134",
                "I: Validating adduser 3.134",
                "I: Extracting bash",
                "I: Base system installed successfully.",
            ]
        );
    }

    #[test]
    fn warnings_errors_template_progress_and_plain_text_are_shown() {
        let line = |s: &str| serde_json::from_str::<LogLine>(s).unwrap();
        let warn = line(r#"{"level":"WARN","message":"careful","target":"x"}"#);
        assert_eq!(
            shown_line(Some(&warn), "", false).as_deref(),
            Some("WARN careful")
        );
        let info = line(r#"{"level":"INFO","message":"fine","target":"x"}"#);
        assert_eq!(shown_line(Some(&info), "", false), None);
        assert_eq!(
            shown_line(Some(&info), "", true).as_deref(),
            Some("INFO fine")
        );
        let tpl = line(r#"{"level":"INFO","message":"I: x","target":"agentenv_node::template"}"#);
        assert_eq!(shown_line(Some(&tpl), "", false).as_deref(), Some("I: x"));
        assert_eq!(shown_line(None, "panic!", false).as_deref(), Some("panic!"));
        assert_eq!(shown_line(None, "  ", false), None);
    }
}

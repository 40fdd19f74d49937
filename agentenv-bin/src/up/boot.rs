//! Bringing the cluster up: the scheduler, then each node (reporting to it), then the
//! gateway; every node listed ready by the gateway; and a first sandbox through the
//! gateway, which builds the `base` template on the very first run.

use std::path::Path;
use std::time::Duration;

use agentenv_guest::client::GuestClient;
use serde::Deserialize;
use tokio::process::Command;

use super::config::{NodeSetup, fs_err};
use super::{ENVD_PORT, Up, UpError};
use crate::cli::model::Sandbox;
use crate::http_client::{Target, request};

/// A node as the gateway's `GET /nodes` lists it (the field `agentenv up` reads).
#[derive(Debug, Deserialize)]
struct ListedNode {
    #[serde(default)]
    status: Option<String>,
}

impl Up {
    /// Starts the processes in order, each once the one before is ready.
    pub(super) async fn boot(&mut self, cfg_path: &Path, guest: &Path) -> Result<(), UpError> {
        let say = self.out.clone();
        let data = self.info.data_dir.clone();
        say(&format!("state and logs: {}", data.display()));

        let mut cmd = Command::new(self.opts.bin_dir.join("agentenv-scheduler"));
        cmd.arg("-config").arg(cfg_path);
        let s = self.procs.spawn("scheduler", cmd)?;
        let l = self
            .procs
            .wait_logged(s, "scheduler listening", Duration::from_secs(30))
            .await?;
        let grpc = l.grpc_addr.unwrap_or_default();
        self.info.scheduler = grpc.parse().unwrap_or(self.info.scheduler);
        say(&format!("scheduler  grpc {grpc}"));

        for (i, (id, addr)) in self.info.nodes.clone().into_iter().enumerate() {
            let home = data.join(id.as_str());
            std::fs::create_dir_all(&home).map_err(fs_err("creating", &home))?;
            let node = NodeSetup {
                index: i as u8,
                id: &id,
                addr,
                home: &home,
                api_key: &self.info.api_key,
                guest,
                data_dir: &data,
                scheduler_grpc: &grpc,
                cluster_token: &data.join("secrets").join("cluster-token"),
                certs: self.certs.as_ref(),
            };
            let cmd = node.command(&self.opts);
            let pool = node.pool(&self.opts);
            let n = self.procs.spawn(&id, cmd)?;
            self.procs
                .wait_logged(n, "node listening", Duration::from_secs(120))
                .await?;
            say(&format!(
                "{id}     api  {addr}  sandboxes in {pool}  data {}",
                home.display()
            ));
        }

        let mut cmd = Command::new(self.opts.bin_dir.join("agentenv-gateway"));
        cmd.arg("-config")
            .arg(cfg_path)
            .env("AENV_API_KEY", &self.info.api_key)
            .env("GATEWAY_SCHEDULER_ADDR", &grpc);
        let g = self.procs.spawn("gateway", cmd)?;
        let l = self
            .procs
            .wait_logged(g, "gateway listening", Duration::from_secs(30))
            .await?;
        if let Some(a) = l.http_addr.and_then(|a| a.parse().ok()) {
            self.info.gateway = a;
        }
        say(&format!("gateway    {}", self.info.gateway_url()));

        self.wait_nodes_ready(Duration::from_secs(60)).await?;
        say(&format!("all {} nodes are ready", self.info.nodes.len()));
        if self.opts.check {
            self.first_sandbox().await?;
        }
        Ok(())
    }

    /// Polls the gateway's `GET /nodes` until every node is listed ready.
    async fn wait_nodes_ready(&mut self, limit: Duration) -> Result<(), UpError> {
        let deadline = tokio::time::Instant::now() + limit;
        let want = self.info.nodes.len();
        let mut last;
        loop {
            let gw = self.info.gateway_target();
            let headers = self.key_headers();
            match request(gw, "GET", "/nodes", &headers, b"", Duration::from_secs(5)).await {
                Ok(r) => {
                    let ready = r
                        .json::<Vec<ListedNode>>()
                        .unwrap_or_default()
                        .iter()
                        .filter(|n| n.status.as_deref() == Some("ready"))
                        .count();
                    if r.status == 200 && ready == want {
                        return Ok(());
                    }
                    last = format!("{} {}", r.status, r.text());
                }
                Err(e) => last = e.to_string(),
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(UpError::NodesNotReady {
                    want,
                    limit,
                    last,
                    logs: self.info.data_dir.join("logs"),
                });
            }
            self.procs.drain();
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Creates a sandbox from `base` through the gateway, runs a command in it and deletes
    /// it. The first run builds the `base` template (its progress is shown).
    async fn first_sandbox(&mut self) -> Result<(), UpError> {
        let say = self.out.clone();
        let base_built = self
            .opts
            .template_dir
            .join("base")
            .join("template.json")
            .is_file();
        if base_built {
            say("starting a first sandbox from template base");
        } else {
            say(&format!(
                "building template base in {} (debootstrap, about 2 minutes; cached for the next runs)",
                self.opts.template_dir.display()
            ));
        }
        let gw = self.info.gateway_target();
        // The log reader tasks keep showing build progress while the create runs.
        let r = request(
            gw.clone(),
            "POST",
            "/sandboxes",
            &self.key_headers(),
            br#"{"templateID":"base","timeout":120}"#,
            Duration::from_secs(900),
        )
        .await?;
        self.procs.drain();
        let created = r
            .json::<Sandbox>()
            .filter(|_| r.status == 201 || r.status == 200);
        let Some(sb) = created else {
            return Err(UpError::FirstSandbox(format!(
                "POST /sandboxes answered {}: {}",
                r.status,
                r.text()
            )));
        };
        let id = sb.sandbox_id;
        let token = sb.envd_access_token.unwrap_or_default();
        let result = run_command(&gw, &id, &token, "echo hello from $(hostname)").await;
        let del = request(
            gw,
            "DELETE",
            &format!("/sandboxes/{id}"),
            &self.key_headers(),
            b"",
            Duration::from_secs(60),
        )
        .await?;
        let output = result?;
        if del.status >= 300 {
            return Err(UpError::FirstSandbox(format!(
                "DELETE /sandboxes/{id} answered {}: {}",
                del.status,
                del.text()
            )));
        }
        say(&format!("first sandbox {id} ran: {}", output.trim_end()));
        Ok(())
    }
}

/// How long the first command may take.
const COMMAND_LIMIT: Duration = Duration::from_secs(60);

/// Runs `sh -c script` in sandbox `id` through the gateway at `gw` (the agent's Connect
/// API, routed by the E2B sandbox headers, with the sandbox's access `token` if any) and
/// returns its stdout.
pub async fn run_command(
    gw: &Target,
    id: &str,
    token: &str,
    script: &str,
) -> Result<String, UpError> {
    let failed = |e: agentenv_guest::client::ClientError| {
        UpError::FirstSandbox(format!("process.Process/Start: {e}"))
    };
    let agent = match gw.tls_config() {
        Some(tls) => GuestClient::with_tls(&gw.url(), tls.clone()),
        None => GuestClient::new(&gw.url()),
    };
    let mut agent = agent
        .and_then(|c| c.with_header("e2b-sandbox-id", id))
        .and_then(|c| c.with_header("e2b-sandbox-port", ENVD_PORT))
        .map_err(failed)?;
    if !token.is_empty() {
        agent = agent.with_access_token(token);
    }
    let out = tokio::time::timeout(COMMAND_LIMIT, agent.run("/bin/sh", &["-c", script]))
        .await
        .map_err(|_| {
            UpError::FirstSandbox(format!(
                "process.Process/Start: no answer within {COMMAND_LIMIT:?}"
            ))
        })?
        .map_err(failed)?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    match out.end.map(|e| e.exit_code) {
        Some(0) => Ok(stdout),
        other => Err(UpError::FirstSandbox(format!(
            "the command ended with {other:?}; output: {stdout}"
        ))),
    }
}

//! The build sandbox: started on the base with the cached layer, the steps run in it
//! through the guest agent, its layer captured; and a template's start and ready
//! commands, in a build and at a create.

use super::*;
use crate::observe::output::{DRAIN_PAUSE, Feed};
use crate::observe::{Level, SandboxLog};

/// The running build sandbox.
pub(in crate::lifecycle) struct BuildBox {
    pub(super) id: String,
    pub(super) addr: SandboxAddress,
    pub(super) token: String,
}

pub(super) fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// `path` resolved against `workdir` (absolute stays).
pub(super) fn resolve_path(workdir: Option<&str>, path: &str) -> String {
    if path.starts_with('/') {
        path.to_string()
    } else {
        let base = workdir.unwrap_or("/").trim_end_matches('/');
        format!("{base}/{path}")
    }
}

/// The shell script that copies `src` (a path or glob in the unpacked archive) to
/// `dest` with Docker's `COPY` rules, then applies owner and mode.
pub(super) fn copy_script(
    archive: &str,
    src: &str,
    dest: &str,
    user: Option<&str>,
    mode: Option<u32>,
) -> String {
    let src = src.trim_start_matches("./").trim_end_matches('/');
    // The glob stays unquoted so the shell expands it; everything else is quoted.
    let glob: String = src
        .split('/')
        .map(|seg| {
            if seg.contains(['*', '?', '[']) {
                seg.to_string()
            } else {
                shell_quote(seg)
            }
        })
        .collect::<Vec<_>>()
        .join("/");
    let chown = match user {
        Some(u) => format!("chown -R -h {} \"$t\"", shell_quote(u)),
        None => ":".into(),
    };
    let chmod = match mode {
        Some(m) => format!("chmod -R {m:o} \"$t\""),
        None => ":".into(),
    };
    format!(
        r#"set -eu
ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
tar --no-same-owner -xf {archive} -C "$ctx"
dest={dest}
cd "$ctx"
set -- {glob}
[ -e "$1" ] || [ -L "$1" ] || {{ echo "COPY: no file matches {src_q} in the uploaded files" >&2; exit 1; }}
if [ $# -gt 1 ] || [ -d "$1" ] && [ ! -L "$1" ] || [ "${{dest%/}}" != "$dest" ] || [ -d "$dest" ]; then
  mkdir -p "$dest"
  for s in "$@"; do
    if [ -d "$s" ] && [ ! -L "$s" ]; then
      for e in "$s"/* "$s"/.[!.]* "$s"/..?*; do
        [ -e "$e" ] || [ -L "$e" ] || continue
        t="$dest/${{e##*/}}"; rm -rf "$t"; cp -a "$e" "$t"; {chown}; {chmod}
      done
    else
      t="$dest/${{s##*/}}"; rm -rf "$t"; cp -a "$s" "$t"; {chown}; {chmod}
    fi
  done
else
  mkdir -p "$(dirname "$dest")"
  t="$dest"; rm -rf "$t"; cp -a "$1" "$t"; {chown}; {chmod}
fi
rm -f {archive}
"#,
        archive = shell_quote(archive),
        dest = shell_quote(dest),
        src_q = src.replace(['\'', '"', '$', '`', '\\'], "_"),
    )
}

impl Orchestrator {
    pub(in crate::lifecycle) async fn start_build_box(
        &self,
        t: &Arc<Templates>,
        build: &BuildRecord,
        local_base: &str,
        layer: Option<&LayerRef>,
        state: &RunState,
    ) -> Result<BuildBox, String> {
        let id = format!("build-{}", build.build_id);
        let mut spec = SandboxSpec::new(&id, local_base);
        spec.cpu_count = build.cpu_count.max(1);
        spec.memory_mb = build.memory_mb.max(crate::backend::MIN_MEMORY_MB);
        spec.env = state.env.clone();
        spec.allow_internet_access = true;
        if let Some(layer) = layer {
            let staging = t.staging_dir().map_err(|f| f.message)?;
            t.catalog
                .get_layer(
                    layer,
                    &staging.0.join(crate::backend::jail::snapshot::LAYER_FILE),
                )
                .await
                .map_err(|e| e.to_string())?;
            let capture = SnapshotCapture::new(
                BackendKind::Jail,
                vec![crate::backend::jail::snapshot::LAYER_FILE.to_string()],
            );
            spec.kept = Some(
                self.backend
                    .import_snapshot(&capture, &staging.0)
                    .await
                    .map_err(|e| format!("starting from the cached layer: {e}"))?,
            );
        }
        let kept = spec.kept.clone();
        let info = match self.backend.create(spec).await {
            Ok(i) => i,
            Err(e) => {
                if let Some(k) = &kept {
                    let _ = self.backend.discard_kept(k).await;
                }
                return Err(format!("starting the build sandbox: {e}"));
            }
        };
        let addr = info.address;
        let token = self.tokens.envd_token(&id);
        let ready = async {
            wait_ready(
                addr.agent(),
                self.cfg.agent_ready_timeout,
                Duration::from_millis(5),
            )
            .await
            .map_err(|e| e.to_string())?;
            self.init_agent_for(&id, &state.env, addr).await
        }
        .await;
        if let Err(e) = ready {
            self.release(&id, "removing a build sandbox").await;
            return Err(format!("the build sandbox's agent did not start: {e}"));
        }
        Ok(BuildBox { id, addr, token })
    }

    pub(in crate::lifecycle) fn guest(
        &self,
        bx: &BuildBox,
        user: &str,
    ) -> Result<agentenv_guest::client::GuestClient, String> {
        Ok(
            agentenv_guest::client::GuestClient::new(&format!("http://{}", bx.addr.agent()))
                .map_err(|e| e.to_string())?
                .with_access_token(&bx.token)
                .with_user(user),
        )
    }

    /// Runs `cmd` with `/bin/sh -c` in the build sandbox; output goes to the log (and
    /// the last lines into the error).
    #[allow(clippy::too_many_arguments)]
    pub(in crate::lifecycle) async fn sh(
        &self,
        bx: &BuildBox,
        user: &str,
        cwd: Option<&str>,
        env: &BTreeMap<String, String>,
        cmd: &str,
        log: Option<(&BuildLog, &str)>,
    ) -> Result<(), String> {
        use agentenv_guest::proto::process as pr;
        use pr::process_event::Event;
        use pr::process_event::data_event::Output;
        let client = self.guest(bx, user)?;
        let req = pr::StartRequest {
            process: Some(pr::ProcessConfig {
                cmd: "/bin/sh".into(),
                args: vec!["-c".into(), cmd.into()],
                envs: env.clone().into_iter().collect(),
                cwd: cwd.map(str::to_string),
            }),
            stdin: Some(false),
            ..Default::default()
        };
        let mut stream = client
            .start(&req)
            .await
            .map_err(|e| format!("starting the command: {e}"))?;
        let mut tail: std::collections::VecDeque<String> = std::collections::VecDeque::new();
        let mut partial: [Vec<u8>; 2] = [Vec::new(), Vec::new()];
        let mut end = None;
        let emit = |line: &[u8], err: bool, tail: &mut std::collections::VecDeque<String>| {
            let s = String::from_utf8_lossy(line)
                .trim_end_matches('\r')
                .to_string();
            if let Some((log, step)) = log {
                log.line(if err { "warn" } else { "info" }, Some(step), s.clone());
            }
            if tail.len() == 10 {
                tail.pop_front();
            }
            tail.push_back(s);
        };
        while let Some(msg) = stream.next().await {
            let msg = msg.map_err(|e| format!("the command's output: {e}"))?;
            match msg.event.and_then(|e| e.event) {
                Some(Event::Data(d)) => {
                    let (buf, err, idx) = match d.output {
                        Some(Output::Stdout(b)) => (b, false, 0),
                        Some(Output::Stderr(b)) => (b, true, 1),
                        Some(Output::Pty(b)) => (b, false, 0),
                        None => continue,
                    };
                    partial[idx].extend_from_slice(&buf);
                    while let Some(pos) = partial[idx].iter().position(|&b| b == b'\n') {
                        let line: Vec<u8> = partial[idx].drain(..=pos).collect();
                        emit(&line[..line.len() - 1], err, &mut tail);
                    }
                    if partial[idx].len() > MAX_LINE {
                        let line = std::mem::take(&mut partial[idx]);
                        emit(&line, err, &mut tail);
                    }
                }
                Some(Event::End(e)) => end = Some(e),
                _ => {}
            }
        }
        for (idx, p) in partial.iter().enumerate() {
            if !p.is_empty() {
                emit(&p.clone(), idx == 1, &mut tail);
            }
        }
        let end = end.ok_or("the command's output ended without an exit status")?;
        if end.exited && end.exit_code == 0 {
            return Ok(());
        }
        let status = if end.exited {
            format!("exit code {}", end.exit_code)
        } else {
            end.status.clone()
        };
        let tail: Vec<String> = tail.into_iter().collect();
        Err(format!(
            "the command failed with {status}{}",
            if tail.is_empty() {
                String::new()
            } else {
                format!("; last output:\n{}", tail.join("\n"))
            }
        ))
    }

    #[allow(clippy::too_many_arguments)]
    pub(in crate::lifecycle) async fn run_step(
        &self,
        t: &Arc<Templates>,
        log: &BuildLog,
        bx: &BuildBox,
        build: &BuildRecord,
        step: &Step,
        state: &mut RunState,
        label: &str,
    ) -> Result<(), String> {
        let current_user = state.user.clone().unwrap_or_else(|| "root".into());
        match step {
            Step::Run { cmd, user } => {
                let user = user.clone().unwrap_or(current_user);
                self.sh(
                    bx,
                    &user,
                    state.workdir.as_deref(),
                    &state.env,
                    cmd,
                    Some((log, label)),
                )
                .await
            }
            Step::Env(kv) => {
                crate::template::steps::apply_env(&mut state.env, kv);
                Ok(())
            }
            Step::Workdir(p) => {
                let p = resolve_path(state.workdir.as_deref(), p);
                let owner = match &state.user {
                    Some(u) if u != "root" => {
                        format!(" && chown {} {}", shell_quote(u), shell_quote(&p))
                    }
                    _ => String::new(),
                };
                self.sh(
                    bx,
                    "root",
                    None,
                    &state.env,
                    &format!("mkdir -p {}{owner}", shell_quote(&p)),
                    Some((log, label)),
                )
                .await?;
                state.workdir = Some(p);
                Ok(())
            }
            Step::User(u) => {
                let name = u.split(':').next().unwrap_or(u);
                let q = shell_quote(name);
                let script = format!(
                    "id -u {q} >/dev/null 2>&1 || useradd -m -s /bin/bash {q} 2>/dev/null || useradd -m {q} || adduser -D {q}"
                );
                self.sh(bx, "root", None, &state.env, &script, Some((log, label)))
                    .await?;
                state.user = Some(u.clone());
                Ok(())
            }
            Step::Copy {
                src,
                dest,
                user,
                mode,
                files_hash,
            } => {
                let staging = t.staging_dir().map_err(|f| f.message)?;
                let local = staging.0.join("files.tar");
                let key = TemplateCatalog::file_key(&build.template_id, files_hash);
                match t.catalog.storage().get_file(&key, &local).await {
                    Ok(_) => {}
                    Err(agentenv_core::storage::StorageError::NotFound { .. }) => {
                        return Err(format!(
                            "the files of COPY {src} (hash {files_hash}) were never uploaded: upload them (GET /templates/{}/files/{files_hash} gives the link) and build again",
                            build.template_id
                        ));
                    }
                    Err(e) => return Err(format!("reading the uploaded files: {e}")),
                }
                // A gzip archive is unpacked here: the build image needs no gzip.
                let local = {
                    let uploaded = local.clone();
                    let plain = staging.0.join("files.plain.tar");
                    tokio::task::spawn_blocking(move || -> std::io::Result<PathBuf> {
                        use std::io::Read;
                        let mut magic = [0u8; 2];
                        let mut f = std::fs::File::open(&uploaded)?;
                        let n = f.read(&mut magic)?;
                        if n < 2 || magic != [0x1f, 0x8b] {
                            return Ok(uploaded);
                        }
                        let mut gz =
                            flate2::read::MultiGzDecoder::new(std::fs::File::open(&uploaded)?);
                        let mut out = std::fs::File::create(&plain)?;
                        std::io::copy(&mut gz, &mut out)?;
                        Ok(plain)
                    })
                    .await
                    .map_err(|e| e.to_string())?
                    .map_err(|e| {
                        format!("the uploaded files of COPY {src} are not a readable tar.gz: {e}")
                    })?
                };
                let remote = format!("/tmp/.agentenv-copy-{files_hash}.tar");
                let client = self.guest(bx, "root")?;
                client
                    .upload_file(&local, &remote)
                    .await
                    .map_err(|e| format!("sending the files into the build sandbox: {e}"))?;
                let dest = resolve_path(state.workdir.as_deref(), dest);
                let script = copy_script(&remote, src, &dest, user.as_deref(), *mode);
                self.sh(
                    bx,
                    "root",
                    None,
                    &BTreeMap::new(),
                    &script,
                    Some((log, label)),
                )
                .await
            }
        }
    }

    pub(in crate::lifecycle) async fn capture_layer(
        &self,
        t: &Arc<Templates>,
        bx: &BuildBox,
    ) -> Result<Option<LayerRef>, String> {
        let staging = t.staging_dir().map_err(|f| f.message)?;
        let cap = self
            .backend
            .snapshot(&bx.id, &staging.0)
            .await
            .map_err(|e| format!("capturing the layer: {e}"))?;
        let file = cap
            .files
            .iter()
            .find(|f| f.ends_with(".tar.zst"))
            .ok_or("the capture holds no layer archive")?;
        let layer = t
            .catalog
            .put_layer(&staging.0.join(file))
            .await
            .map_err(|e| format!("saving the layer: {e}"))?;
        Ok(Some(layer))
    }

    /// Starts `start` in the background (as the template's user, in its workdir, with
    /// its env) and waits until `ready` succeeds; a start command that ends first fails.
    pub(in crate::lifecycle) async fn start_and_wait_ready_at(
        &self,
        sandbox_id: &str,
        addr: SandboxAddress,
        state: &RunState,
        start: Option<&str>,
        ready: Option<&str>,
        timeout: Duration,
    ) -> Result<(), String> {
        let bx = BuildBox {
            id: sandbox_id.to_string(),
            addr,
            token: self.tokens.envd_token(sandbox_id),
        };
        let log = self.sandbox_log_book().and_then(|b| b.open(sandbox_id));
        self.start_and_wait_ready(&bx, state, start, ready, timeout, None, log)
            .await
    }

    /// Starts `start` and waits for `ready`, as [`Self::start_and_wait_ready_at`]. With
    /// `sandbox_log`, the start command's output goes on into that log for as long as
    /// the command runs (stdout `info`, stderr `error`); without, its stream goes once
    /// the sandbox is ready.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::lifecycle) async fn start_and_wait_ready(
        &self,
        bx: &BuildBox,
        state: &RunState,
        start: Option<&str>,
        ready: Option<&str>,
        timeout: Duration,
        log: Option<&BuildLog>,
        sandbox_log: Option<Arc<SandboxLog>>,
    ) -> Result<(), String> {
        use agentenv_guest::proto::process as pr;
        let user = state.user.clone().unwrap_or_else(|| "root".into());
        let ended: Arc<Mutex<Option<String>>> = Arc::new(Mutex::new(None));
        let mut pump = None;
        if let Some(start) = start {
            if let Some(log) = log {
                log.info(Some("finalize"), format!("Starting: {start}"));
            }
            let client = self.guest(bx, &user)?;
            let req = pr::StartRequest {
                process: Some(pr::ProcessConfig {
                    cmd: "/bin/sh".into(),
                    args: vec!["-c".into(), start.into()],
                    envs: state.env.clone().into_iter().collect(),
                    cwd: state.workdir.clone(),
                }),
                stdin: Some(false),
                tag: Some("start-cmd".into()),
                ..Default::default()
            };
            let stream = client
                .start(&req)
                .await
                .map_err(|e| format!("starting the start command: {e}"))?;
            let ended = ended.clone();
            let feeds = sandbox_log.clone().map(start_cmd_feeds);
            pump = Some(tokio::spawn(pump_start_cmd(stream, ended, feeds)));
        }
        let keep_pumping = sandbox_log.is_some();
        let Some(ready) = ready else {
            if let Some(p) = pump {
                // The process keeps running in the sandbox; only the stream goes (or
                // goes on into the sandbox's log).
                tokio::time::sleep(Duration::from_millis(100)).await;
                keep_or_abort(p, sandbox_log.as_deref(), ended.lock().is_none());
            }
            return match ended.lock().take() {
                Some(s) if s != "exit code 0" => Err(format!("the start command ended with {s}")),
                _ => Ok(()),
            };
        };
        if let Some(log) = log {
            log.info(
                Some("finalize"),
                format!("Waiting for the ready command: {ready}"),
            );
        }
        let deadline = tokio::time::Instant::now() + timeout;
        let result = loop {
            if let Some(s) = ended.lock().clone()
                && s != "exit code 0"
            {
                break Err(format!(
                    "the start command ended with {s} before it was ready"
                ));
            }
            match self
                .sh(bx, &user, state.workdir.as_deref(), &state.env, ready, None)
                .await
            {
                Ok(()) => break Ok(()),
                Err(_) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(READY_POLL).await;
                }
                Err(e) => {
                    break Err(format!(
                        "the ready command did not succeed within {} s: {e}",
                        timeout.as_secs()
                    ));
                }
            }
        };
        if let Some(p) = pump {
            keep_or_abort(p, sandbox_log.as_deref(), result.is_ok() && keep_pumping);
        }
        if result.is_ok()
            && let Some(log) = log
        {
            log.info(Some("finalize"), "Ready");
        }
        result
    }
}

/// The feeds of a start command's stdout (`info`) and stderr (`error`) into `log`.
fn start_cmd_feeds(log: Arc<SandboxLog>) -> [Feed; 2] {
    [
        Feed::new(
            log.clone(),
            &[("source", "start-cmd"), ("stream", "stdout")],
            |_| Level::Info,
        ),
        Feed::new(
            log,
            &[("source", "start-cmd"), ("stream", "stderr")],
            |_| Level::Error,
        ),
    ]
}

/// Reads a start command's stream until it ends: its exit into `ended`, its output into
/// `feeds` (when given).
async fn pump_start_cmd(
    mut stream: agentenv_guest::client::ResponseStream<
        agentenv_guest::proto::process::StartResponse,
    >,
    ended: Arc<Mutex<Option<String>>>,
    mut feeds: Option<[Feed; 2]>,
) {
    use agentenv_guest::proto::process::process_event::Event;
    use agentenv_guest::proto::process::process_event::data_event::Output;
    while let Some(Ok(msg)) = stream.next().await {
        match msg.event.and_then(|e| e.event) {
            Some(Event::Data(d)) => {
                let Some(feeds) = feeds.as_mut() else {
                    continue;
                };
                let dropped = match d.output {
                    Some(Output::Stdout(b)) | Some(Output::Pty(b)) => {
                        feeds[0].push(&b, tokio::time::Instant::now())
                    }
                    Some(Output::Stderr(b)) => feeds[1].push(&b, tokio::time::Instant::now()),
                    None => false,
                };
                if dropped {
                    // Past the budget: slow down, so the agent's stream pushes back.
                    tokio::time::sleep(DRAIN_PAUSE).await;
                }
            }
            Some(Event::End(e)) => {
                let how = if e.exited {
                    format!("exit code {}", e.exit_code)
                } else {
                    e.status
                };
                if let Some(mut feeds) = feeds.take() {
                    for f in feeds.iter_mut() {
                        f.finish();
                    }
                    feeds[0].log().push(
                        Level::Info,
                        format!("the start command ended with {how}"),
                        &[("source", "start-cmd")],
                    );
                }
                *ended.lock() = Some(how);
            }
            _ => {}
        }
    }
    // The stream broke without an end: what is left of a line still goes in.
    for f in feeds.iter_mut().flatten() {
        f.finish();
    }
}

/// Leaves the start command's pump running (`keep`, with a log to feed: the log stops
/// it when the sandbox goes), else stops it.
fn keep_or_abort(pump: tokio::task::JoinHandle<()>, log: Option<&SandboxLog>, keep: bool) {
    match log {
        Some(log) if keep => log.attach(pump.abort_handle()),
        _ => pump.abort(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_resolve_against_the_workdir() {
        assert_eq!(resolve_path(Some("/app"), "x"), "/app/x");
        assert_eq!(resolve_path(None, "x"), "/x");
        assert_eq!(resolve_path(Some("/app"), "/y"), "/y");
    }

    #[test]
    fn the_copy_script_quotes_what_it_is_given() {
        let s = copy_script(
            "/tmp/a.tar",
            "it's/*.txt",
            "/d'x/",
            Some("user:user"),
            Some(0o644),
        );
        assert!(s.contains(r"'it'\''s'/*.txt"), "{s}");
        assert!(s.contains(r"dest='/d'\''x/'"), "{s}");
        assert!(s.contains("chmod -R 644"), "{s}");
        assert!(s.contains("chown -R -h 'user:user'"), "{s}");
    }
}

//! Template builds and the templates sandboxes start from.
//!
//! A build runs in a sandbox of its own (not listed, not reported, not counted as a
//! tenant's): it starts on the build's base (the built-in template, another template's
//! result, or an OCI image) with the cached layer of the longest unchanged prefix of
//! steps, runs the remaining steps through the guest agent, and after each step that
//! changes files captures the sandbox's writable layer into the catalog's layer cache.
//! Logs go to the catalog in chunks, so any node answers a build's status. A failed or
//! interrupted build publishes nothing: only a finished build's record names a result,
//! and only then do the template's tags move to it.
//!
//! A sandbox starts from a template on any node: the node materializes the build's
//! result once (its base, then the layer applied over a copy of it) as a local template
//! `tpl-<build id>`, and keeps it.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use parking_lot::Mutex;
use tokio::sync::Semaphore;

use super::{LifecycleError, Orchestrator};
use crate::backend::agent::wait_ready;
use crate::backend::{SandboxAddress, SandboxSpec, SnapshotCapture};
use crate::clock::{ms_since_epoch, time_rfc3339};
use crate::config::BackendKind;
use crate::template::catalog::{
    BaseRef, BuildReason, BuildRecord, BuildResult, BuildStatus, CacheEntry, CatalogError,
    ImageLayer, ImageRecord, LayerRef, LogLine, RunState, TemplateCatalog, TemplateRecord,
};
use crate::template::oci::LayerMediaType;
use crate::template::steps::{BaseSpec, BuildSpec, Step, split_reference};
use crate::template::{BASE_TEMPLATE, Progress, TemplateStore};

/// The tag a reference without one means.
pub const DEFAULT_TAG: &str = "default";

/// A build whose node has not said it is alive for this long is taken as interrupted.
pub const BUILD_STALE_AFTER: Duration = Duration::from_secs(60);

const HEARTBEAT_EVERY: Duration = Duration::from_secs(10);
const LOG_FLUSH_EVERY: Duration = Duration::from_millis(250);
const READY_POLL: Duration = Duration::from_millis(250);
/// Longest a step's output line kept in the log.
const MAX_LINE: usize = 4096;

/// Settings of template builds on a node.
#[derive(Debug, Clone)]
pub struct BuildSettings {
    /// This node's id, recorded in the builds it runs.
    pub node_id: String,
    /// Builds this node runs at once (more wait, with status `waiting`).
    pub max_concurrent: usize,
    /// Longest one step may run.
    pub step_timeout: Duration,
    /// Longest the ready command may take to succeed, in a build and at a create.
    pub ready_timeout: Duration,
    /// Node-local directory for downloads and captures.
    pub staging: PathBuf,
    /// Node-local cache of OCI image layers, by digest.
    pub oci_cache: PathBuf,
    /// Registry of image names that name none (`AENV_OCI_DEFAULT_REGISTRY` when unset).
    pub default_registry: Option<String>,
    /// Registries reached over plain HTTP (e.g. a local registry on loopback).
    pub insecure_registries: Vec<String>,
}

impl BuildSettings {
    pub fn new(node_id: impl Into<String>, data_dir: &Path) -> Self {
        Self {
            node_id: node_id.into(),
            max_concurrent: 2,
            step_timeout: Duration::from_secs(30 * 60),
            ready_timeout: Duration::from_secs(120),
            staging: data_dir.join("template-staging"),
            oci_cache: data_dir.join("oci-layers"),
            default_registry: None,
            insecure_registries: Vec::new(),
        }
    }
}

/// Templates of one node: the shared catalog, the local store, the builds running here.
pub struct Templates {
    pub catalog: Arc<TemplateCatalog>,
    pub store: TemplateStore,
    pub settings: BuildSettings,
    slots: Semaphore,
    running: Mutex<HashSet<String>>,
}

impl Templates {
    pub fn new(
        catalog: Arc<TemplateCatalog>,
        store: TemplateStore,
        settings: BuildSettings,
    ) -> Result<Self, LifecycleError> {
        std::fs::create_dir_all(&settings.staging).map_err(|e| {
            LifecycleError::Internal(format!("creating {}: {e}", settings.staging.display()))
        })?;
        // Leftovers of an earlier process.
        if let Ok(entries) = std::fs::read_dir(&settings.staging) {
            for e in entries.flatten() {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
        Ok(Self {
            slots: Semaphore::new(settings.max_concurrent.max(1)),
            catalog,
            store,
            settings,
            running: Mutex::new(HashSet::new()),
        })
    }

    fn staging_dir(&self) -> Result<Staging, BuildFailure> {
        let p = self.settings.staging.join(uuid::Uuid::now_v7().to_string());
        std::fs::create_dir_all(&p)
            .map_err(|e| BuildFailure::internal(format!("creating {}: {e}", p.display())))?;
        Ok(Staging(p))
    }

    /// The status a build shows: one whose node went silent is an error.
    pub fn effective_status(b: &BuildRecord) -> (BuildStatus, Option<BuildReason>) {
        let stale = !b.status.is_final()
            && ms_since_epoch(SystemTime::now()).saturating_sub(b.heartbeat_at_ms)
                > BUILD_STALE_AFTER.as_millis() as u64;
        if stale {
            (
                BuildStatus::Error,
                Some(BuildReason {
                    message: format!(
                        "the build was interrupted: node {} stopped reporting on it; start the build again",
                        b.node_id.as_deref().unwrap_or("?")
                    ),
                    step: None,
                }),
            )
        } else {
            (b.status, b.reason.clone())
        }
    }
}

/// A directory removed on drop.
struct Staging(PathBuf);

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Why a build failed, and at which step (`base`, a 1-based number, `finalize`).
#[derive(Debug)]
pub struct BuildFailure {
    pub step: Option<String>,
    pub message: String,
}

impl BuildFailure {
    fn at(step: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            step: Some(step.into()),
            message: message.into(),
        }
    }

    fn internal(message: impl Into<String>) -> Self {
        Self {
            step: None,
            message: message.into(),
        }
    }
}

impl From<CatalogError> for BuildFailure {
    fn from(e: CatalogError) -> Self {
        Self::internal(e.to_string())
    }
}

/// Collects a build's log lines and writes them to the catalog in chunks.
struct BuildLog {
    catalog: Arc<TemplateCatalog>,
    build_id: String,
    pending: Mutex<Vec<LogLine>>,
    seq: tokio::sync::Mutex<u64>,
    total: Mutex<usize>,
}

impl BuildLog {
    fn line(&self, level: &str, step: Option<&str>, message: impl Into<String>) {
        let mut total = self.total.lock();
        *total += 1;
        if *total > crate::template::catalog::MAX_LOG_LINES {
            return;
        }
        let mut message: String = message.into();
        if message.len() > MAX_LINE {
            let mut cut = MAX_LINE;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
            message.push_str(" [line cut]");
        }
        if *total == crate::template::catalog::MAX_LOG_LINES {
            message = "[more log lines were dropped]".into();
        }
        self.pending.lock().push(LogLine {
            timestamp: time_rfc3339(SystemTime::now()),
            level: level.to_string(),
            message,
            step: step.map(str::to_string),
        });
    }

    fn info(&self, step: Option<&str>, message: impl Into<String>) {
        self.line("info", step, message)
    }

    async fn flush(&self) {
        let mut seq = self.seq.lock().await;
        let lines = std::mem::take(&mut *self.pending.lock());
        if lines.is_empty() {
            return;
        }
        match self.catalog.append_logs(&self.build_id, *seq, &lines).await {
            Ok(()) => *seq += 1,
            Err(e) => {
                tracing::warn!(build = %self.build_id, error = %e, "writing build logs");
                // Keep them for the next flush.
                let mut p = self.pending.lock();
                let later = std::mem::take(&mut *p);
                *p = lines;
                p.extend(later);
            }
        }
    }
}

/// The running build sandbox.
struct BuildBox {
    id: String,
    addr: SandboxAddress,
    token: String,
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// `path` resolved against `workdir` (absolute stays).
fn resolve_path(workdir: Option<&str>, path: &str) -> String {
    if path.starts_with('/') {
        path.to_string()
    } else {
        let base = workdir.unwrap_or("/").trim_end_matches('/');
        format!("{base}/{path}")
    }
}

/// The shell script that copies `src` (a path or glob in the unpacked archive) to
/// `dest` with Docker's `COPY` rules, then applies owner and mode.
fn copy_script(
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
    /// The templates of this node (set once, at startup).
    pub fn set_templates(&self, t: Arc<Templates>) {
        let _ = self.templates.set(t);
    }

    pub fn templates(&self) -> Result<&Arc<Templates>, LifecycleError> {
        self.templates.get().ok_or_else(|| {
            LifecycleError::BadRequest(
                "this node serves no templates: it has no template catalog".into(),
            )
        })
    }

    /// Starts build `build` of `template` in the background; the build's record says how
    /// it goes. A template builds once at a time.
    pub fn start_build(
        self: &Arc<Self>,
        template: &TemplateRecord,
        mut build: BuildRecord,
        spec: BuildSpec,
    ) -> Result<(), LifecycleError> {
        self.admit(None)?;
        if self.kind != BackendKind::Jail {
            return Err(LifecycleError::BadRequest(format!(
                "template builds run in jail sandboxes; this node runs the {} backend: build on a node with AENV_BACKEND=jail",
                self.kind
            )));
        }
        let t = self.templates()?.clone();
        if !t.running.lock().insert(template.template_id.clone()) {
            return Err(LifecycleError::Conflict(format!(
                "template {} is being built on this node: wait for that build to finish",
                template.template_id
            )));
        }
        let this = self.clone();
        let tid = template.template_id.clone();
        tokio::spawn(async move {
            let log = Arc::new(BuildLog {
                catalog: t.catalog.clone(),
                build_id: build.build_id.clone(),
                pending: Mutex::new(Vec::new()),
                seq: tokio::sync::Mutex::new(0),
                total: Mutex::new(0),
            });
            let flusher = {
                let log = log.clone();
                tokio::spawn(async move {
                    loop {
                        tokio::time::sleep(LOG_FLUSH_EVERY).await;
                        log.flush().await;
                    }
                })
            };
            build.node_id = Some(t.settings.node_id.clone());
            build.heartbeat_at_ms = ms_since_epoch(SystemTime::now());
            build.status = BuildStatus::Waiting;
            let _ = t.catalog.save_build(&build).await;
            let permit = t.slots.acquire().await;
            build.status = BuildStatus::Building;
            build.heartbeat_at_ms = ms_since_epoch(SystemTime::now());
            build.updated_at_ms = build.heartbeat_at_ms;
            let _ = t.catalog.save_build(&build).await;
            let heartbeat = {
                let t = t.clone();
                let b = build.clone();
                tokio::spawn(async move {
                    let mut b = b;
                    loop {
                        tokio::time::sleep(HEARTBEAT_EVERY).await;
                        b.heartbeat_at_ms = ms_since_epoch(SystemTime::now());
                        let _ = t.catalog.save_build(&b).await;
                    }
                })
            };
            log.info(
                None,
                format!("Building template {tid} (build {})", build.build_id),
            );
            let started = tokio::time::Instant::now();
            let result = this.run_build(&t, &log, &build, &spec).await;
            heartbeat.abort();
            let _ = heartbeat.await;
            let now = ms_since_epoch(SystemTime::now());
            build.updated_at_ms = now;
            build.finished_at_ms = Some(now);
            build.heartbeat_at_ms = now;
            match result {
                Ok(res) => {
                    // The result first, then the tags, then `ready`: a client that sees
                    // `ready` finds the template by its tags at once.
                    build.result = Some(res);
                    let published = async {
                        t.catalog.save_build(&build).await?;
                        // Tags move to the new build only now.
                        let mut rec = t
                            .catalog
                            .record(&tid)
                            .await?
                            .ok_or_else(|| CatalogError::NotFound(tid.clone()))?;
                        for tag in
                            std::iter::once(DEFAULT_TAG.to_string()).chain(build.tags.clone())
                        {
                            rec.tags.insert(tag, build.build_id.clone());
                        }
                        rec.updated_at_ms = now;
                        t.catalog.save_record(&rec).await?;
                        build.status = BuildStatus::Ready;
                        t.catalog.save_build(&build).await
                    }
                    .await;
                    match published {
                        Ok(()) => log.info(
                            None,
                            format!("Build finished in {:.1} s", started.elapsed().as_secs_f64()),
                        ),
                        Err(e) => {
                            build.status = BuildStatus::Error;
                            build.result = None;
                            build.reason = Some(BuildReason {
                                message: format!("publishing the template failed: {e}"),
                                step: Some("finalize".into()),
                            });
                            log.line(
                                "error",
                                Some("finalize"),
                                format!("publishing the template failed: {e}"),
                            );
                            let _ = t.catalog.save_build(&build).await;
                        }
                    }
                }
                Err(f) => {
                    log.line(
                        "error",
                        f.step.as_deref(),
                        format!("Build failed: {}", f.message),
                    );
                    build.status = BuildStatus::Error;
                    build.reason = Some(BuildReason {
                        message: f.message,
                        step: f.step,
                    });
                    if let Err(e) = t.catalog.save_build(&build).await {
                        tracing::warn!(build = %build.build_id, error = %e, "recording a failed build");
                    }
                }
            }
            drop(permit);
            flusher.abort();
            log.flush().await;
            t.running.lock().remove(&tid);
            tracing::info!(template = %tid, build = %build.build_id, status = build.status.as_str(), "template build ended");
        });
        Ok(())
    }

    async fn run_build(
        &self,
        t: &Arc<Templates>,
        log: &Arc<BuildLog>,
        build: &BuildRecord,
        spec: &BuildSpec,
    ) -> Result<BuildResult, BuildFailure> {
        // The base.
        let progress = log_progress(log.clone(), "base");
        let (base, base_state) = self
            .resolve_base(t, &spec.base, progress.clone())
            .await
            .map_err(|m| BuildFailure::at("base", m))?;
        let local_base = self
            .materialize_base(t, &base, progress)
            .await
            .map_err(|m| BuildFailure::at("base", m))?;
        // The longest cached prefix.
        let keys = spec.step_keys(&BuildSpec::base_key(&base));
        let n = spec.steps.len();
        let mut state = base_state;
        let mut layer: Option<LayerRef> = None;
        let mut first = 0;
        for (i, (step, forced)) in spec.steps.iter().enumerate() {
            if *forced {
                break;
            }
            match t.catalog.cache_entry(&keys[i]).await? {
                Some(e) => {
                    log.info(
                        Some(&(i + 1).to_string()),
                        format!("CACHED [{}/{n}] {}", i + 1, step.describe()),
                    );
                    state = e.state;
                    layer = e.layer;
                    first = i + 1;
                }
                None => break,
            }
        }
        let needs_box = spec.steps[first..].iter().any(|(s, _)| s.changes_files())
            || spec.start_cmd.is_some()
            || spec.ready_cmd.is_some();
        if !needs_box {
            for (i, (step, _)) in spec.steps.iter().enumerate().skip(first) {
                if let Step::Env(kv) = step {
                    crate::template::steps::apply_env(&mut state.env, kv);
                }
                log.info(
                    Some(&(i + 1).to_string()),
                    format!("[{}/{n}] {}", i + 1, step.describe()),
                );
                t.catalog
                    .save_cache_entry(&CacheEntry {
                        key: keys[i].clone(),
                        layer: layer.clone(),
                        state: state.clone(),
                    })
                    .await?;
            }
            return Ok(BuildResult {
                base,
                layer,
                state,
                start_cmd: spec.start_cmd.clone(),
                ready_cmd: spec.ready_cmd.clone(),
            });
        }
        let bx = self
            .start_build_box(t, build, &local_base, layer.as_ref(), &state)
            .await
            .map_err(|m| {
                BuildFailure::at(
                    if first == 0 {
                        "base".to_string()
                    } else {
                        first.to_string()
                    },
                    m,
                )
            })?;
        let result = async {
            for (i, (step, _)) in spec.steps.iter().enumerate().skip(first) {
                let label = (i + 1).to_string();
                log.info(Some(&label), format!("[{}/{n}] {}", i + 1, step.describe()));
                let run = self.run_step(t, log, &bx, build, step, &mut state, &label);
                match tokio::time::timeout(t.settings.step_timeout, run).await {
                    Ok(r) => r.map_err(|m| BuildFailure::at(label.clone(), m))?,
                    Err(_) => {
                        return Err(BuildFailure::at(
                            label,
                            format!(
                                "step {} ({}) ran longer than the step time limit of {} s",
                                i + 1,
                                step.describe(),
                                t.settings.step_timeout.as_secs()
                            ),
                        ));
                    }
                }
                if step.changes_files() {
                    layer = self
                        .capture_layer(t, &bx)
                        .await
                        .map_err(|m| BuildFailure::at(label.clone(), m))?;
                }
                t.catalog
                    .save_cache_entry(&CacheEntry {
                        key: keys[i].clone(),
                        layer: layer.clone(),
                        state: state.clone(),
                    })
                    .await?;
            }
            if spec.start_cmd.is_some() || spec.ready_cmd.is_some() {
                self.start_and_wait_ready(
                    &bx,
                    &state,
                    spec.start_cmd.as_deref(),
                    spec.ready_cmd.as_deref(),
                    t.settings.ready_timeout,
                    Some(log),
                )
                .await
                .map_err(|m| BuildFailure::at("finalize", m))?;
            }
            Ok(())
        }
        .await;
        self.release(&bx.id, "removing a build sandbox").await;
        result?;
        Ok(BuildResult {
            base,
            layer,
            state,
            start_cmd: spec.start_cmd.clone(),
            ready_cmd: spec.ready_cmd.clone(),
        })
    }

    /// What a build's `fromTemplate` or `fromImage` names, and the state it starts with.
    async fn resolve_base(
        &self,
        t: &Arc<Templates>,
        base: &BaseSpec,
        progress: Progress,
    ) -> Result<(BaseRef, RunState), String> {
        match base {
            BaseSpec::Template(r) => {
                let (name, tag) = split_reference(r);
                if name == BASE_TEMPLATE && tag.is_none_or(|t| t == DEFAULT_TAG || t == "latest") {
                    return Ok((
                        BaseRef::Builtin {
                            name: BASE_TEMPLATE.into(),
                        },
                        RunState::default(),
                    ));
                }
                let (_, b) = self
                    .resolve_build(t, r)
                    .await
                    .map_err(|e| e.to_string())?
                    .ok_or_else(|| {
                        format!("the base template {r:?} does not exist: build it first, or start from \"base\"")
                    })?;
                let res = b
                    .result
                    .clone()
                    .ok_or_else(|| format!("the base template {r:?} has no finished build"))?;
                Ok((
                    BaseRef::Build {
                        template_id: b.template_id.clone(),
                        build_id: b.build_id.clone(),
                    },
                    res.state,
                ))
            }
            BaseSpec::Image {
                reference,
                username,
                password,
            } => {
                let pulled = self
                    .pull_image(
                        t,
                        reference,
                        username.clone(),
                        password.clone(),
                        progress.clone(),
                    )
                    .await?;
                let state = RunState {
                    env: pulled
                        .config
                        .env
                        .iter()
                        .filter_map(|e| e.split_once('='))
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                    workdir: pulled.config.working_dir.clone().filter(|w| !w.is_empty()),
                    user: pulled.config.user.clone().filter(|u| !u.is_empty()),
                };
                // Into the store: other nodes make the base from there, without the
                // registry or its credentials.
                if t.catalog
                    .image(&pulled.manifest_digest)
                    .await
                    .ok()
                    .flatten()
                    .is_none()
                {
                    progress(&format!(
                        "storing image {reference} ({} layers) in {}",
                        pulled.layers.len(),
                        t.catalog.describe()
                    ));
                    let mut layers = Vec::with_capacity(pulled.layers.len());
                    for l in &pulled.layers {
                        let hex = l.digest.trim_start_matches("sha256:").to_string();
                        t.catalog
                            .put_blob(&hex, l.size, &l.path)
                            .await
                            .map_err(|e| format!("storing layer {}: {e}", l.digest))?;
                        layers.push(ImageLayer {
                            sha256: hex,
                            size: l.size,
                            compression: match l.media_type {
                                LayerMediaType::Plain => "plain",
                                LayerMediaType::Gzip => "gzip",
                                LayerMediaType::Zstd => "zstd",
                            }
                            .into(),
                        });
                    }
                    t.catalog
                        .save_image(&ImageRecord {
                            reference: reference.clone(),
                            manifest_digest: pulled.manifest_digest.clone(),
                            layers,
                        })
                        .await
                        .map_err(|e| e.to_string())?;
                }
                Ok((
                    BaseRef::Image {
                        reference: reference.clone(),
                        manifest_digest: pulled.manifest_digest.clone(),
                    },
                    state,
                ))
            }
        }
    }

    /// The template and ready build a reference (`name`, `name:tag`, id) names.
    pub async fn resolve_build(
        &self,
        t: &Templates,
        reference: &str,
    ) -> Result<Option<(TemplateRecord, BuildRecord)>, CatalogError> {
        let (name, tag) = split_reference(reference);
        let Some(rec) = t.catalog.resolve(name).await? else {
            return Ok(None);
        };
        let tag = tag.unwrap_or(DEFAULT_TAG);
        let build_id = match rec.tags.get(tag) {
            Some(b) => b.clone(),
            // `latest` means the newest ready build when no tag has that name.
            None if tag == "latest" => match rec.tags.get(DEFAULT_TAG) {
                Some(b) => b.clone(),
                None => return Ok(None),
            },
            None => return Ok(None),
        };
        let Some(b) = t.catalog.build(&rec.template_id, &build_id).await? else {
            return Ok(None);
        };
        // A build's result is there only once it succeeded (its status turns `ready`
        // just after its tags move to it).
        if b.result.is_none() || b.status == BuildStatus::Error {
            return Ok(None);
        }
        Ok(Some((rec, b)))
    }

    async fn pull_image(
        &self,
        t: &Arc<Templates>,
        reference: &str,
        username: Option<String>,
        password: Option<String>,
        progress: Progress,
    ) -> Result<crate::template::oci::PulledImage, String> {
        use crate::template::oci;
        let mut opts = oci::PullOptions {
            default_registry: t.settings.default_registry.clone(),
            insecure_registries: t.settings.insecure_registries.clone(),
            ..Default::default()
        };
        if let (Some(u), Some(p)) = (username, password) {
            opts.auth = Some(oci::RegistryAuth {
                username: u,
                password: p,
            });
        }
        let cache = oci::LayerCache::new(&t.settings.oci_cache);
        oci::pull(reference, &opts, &cache, progress)
            .await
            .map_err(|e| e.to_string())
    }

    /// The local template a base is, made on this node when it is not there yet.
    fn materialize_base<'a>(
        &'a self,
        t: &'a Arc<Templates>,
        base: &'a BaseRef,
        progress: Progress,
    ) -> futures::future::BoxFuture<'a, Result<String, String>> {
        Box::pin(async move {
            match base {
                BaseRef::Builtin { name } => {
                    t.store
                        .ensure(name, progress)
                        .await
                        .map_err(|e| e.to_string())?;
                    Ok(name.clone())
                }
                BaseRef::Build {
                    template_id,
                    build_id,
                } => {
                    let b = t
                        .catalog
                        .build(template_id, build_id)
                        .await
                        .map_err(|e| e.to_string())?
                        .ok_or_else(|| {
                            format!("build {build_id} of template {template_id} is gone")
                        })?;
                    self.materialize(t, &b, progress).await
                }
                BaseRef::Image {
                    reference,
                    manifest_digest,
                } => {
                    let hex = manifest_digest.trim_start_matches("sha256:");
                    let name = format!("oci-{}", &hex[..hex.len().min(48)]);
                    if t.store.get(&name).is_ok() {
                        return Ok(name);
                    }
                    let image = t
                        .catalog
                        .image(manifest_digest)
                        .await
                        .map_err(|e| e.to_string())?
                        .ok_or_else(|| {
                            format!("image {reference} ({manifest_digest}) is not in the store: build the template again")
                        })?;
                    // Layers from the node's image cache, else from the store.
                    let cache = crate::template::oci::LayerCache::new(&t.settings.oci_cache);
                    let staging = t.staging_dir().map_err(|f| f.message)?;
                    let mut files = Vec::with_capacity(image.layers.len());
                    for (i, l) in image.layers.iter().enumerate() {
                        let digest = format!("sha256:{}", l.sha256);
                        let path = match cache.lookup(&digest, l.size) {
                            Some(p) => p,
                            None => {
                                progress(&format!(
                                    "fetching image layer {}/{} {} ({:.1} MiB) from {}",
                                    i + 1,
                                    image.layers.len(),
                                    &l.sha256[..12],
                                    l.size as f64 / (1 << 20) as f64,
                                    t.catalog.describe()
                                ));
                                let p = staging.0.join(&l.sha256);
                                t.catalog
                                    .get_blob(&l.sha256, &p)
                                    .await
                                    .map_err(|e| e.to_string())?;
                                p
                            }
                        };
                        files.push((path, l.compression.clone()));
                    }
                    t.store
                        .ensure_derived(
                            &name,
                            &format!("image {reference} ({manifest_digest})"),
                            progress,
                            move |rootfs| async move {
                                tokio::task::spawn_blocking(move || -> Result<(), String> {
                                    for (path, compression) in &files {
                                        let f =
                                            std::fs::File::open(path).map_err(|e| e.to_string())?;
                                        let opts = crate::template::apply::ApplyOptions::default();
                                        let applied = match compression.as_str() {
                                            "gzip" => crate::template::apply::apply_layer(
                                                flate2::read::MultiGzDecoder::new(f),
                                                &rootfs,
                                                &opts,
                                            ),
                                            "zstd" => crate::template::apply::apply_layer(
                                                zstd::stream::read::Decoder::new(f)
                                                    .map_err(|e| e.to_string())?,
                                                &rootfs,
                                                &opts,
                                            ),
                                            _ => crate::template::apply::apply_layer(
                                                f, &rootfs, &opts,
                                            ),
                                        };
                                        applied.map_err(|e| {
                                            format!("unpacking image layer {}: {e}", path.display())
                                        })?;
                                    }
                                    // What the jail mounts over, and the agent's directory.
                                    for d in ["agentenv", "proc", "sys", "dev", "tmp"] {
                                        let p = rootfs.join(d);
                                        if std::fs::symlink_metadata(&p).is_err() {
                                            std::fs::create_dir_all(&p)
                                                .map_err(|e| e.to_string())?;
                                        }
                                    }
                                    drop(staging);
                                    Ok(())
                                })
                                .await
                                .map_err(|e| e.to_string())?
                            },
                        )
                        .await
                        .map_err(|e| e.to_string())?;
                    Ok(name)
                }
            }
        })
    }

    /// The local template of a finished build: its base with its layer applied, made on
    /// this node once (the layer fetched from the catalog, with progress).
    pub async fn materialize(
        &self,
        t: &Arc<Templates>,
        b: &BuildRecord,
        progress: Progress,
    ) -> Result<String, String> {
        let res = b
            .result
            .as_ref()
            .ok_or_else(|| format!("build {} has no result", b.build_id))?;
        let base = self
            .materialize_base(t, &res.base, progress.clone())
            .await?;
        let Some(layer) = res.layer.clone() else {
            return Ok(base);
        };
        let name = format!("tpl-{}", b.build_id);
        if t.store.get(&name).is_ok() {
            return Ok(name);
        }
        let base_rootfs = t.store.get(&base).map_err(|e| e.to_string())?.rootfs;
        let staging = t.staging_dir().map_err(|f| f.message)?;
        let archive = staging.0.join("layer.tar.zst");
        progress(&format!(
            "fetching template layer {} ({:.1} MiB) from {}",
            &layer.sha256[..12],
            layer.size as f64 / (1 << 20) as f64,
            t.catalog.describe()
        ));
        t.catalog
            .get_layer(&layer, &archive)
            .await
            .map_err(|e| e.to_string())?;
        t.store
            .ensure_derived(
                &name,
                &format!("build {} of template {}", b.build_id, b.template_id),
                progress,
                move |rootfs| async move {
                    let out = tokio::process::Command::new("cp")
                        .arg("-a")
                        .arg("--reflink=auto")
                        .arg(format!("{}/.", base_rootfs.display()))
                        .arg(&rootfs)
                        .output()
                        .await
                        .map_err(|e| format!("copying the base template: {e}"))?;
                    if !out.status.success() {
                        return Err(format!(
                            "copying the base template failed: {}",
                            String::from_utf8_lossy(&out.stderr).trim()
                        ));
                    }
                    tokio::task::spawn_blocking(move || -> Result<(), String> {
                        let f = std::fs::File::open(&archive).map_err(|e| e.to_string())?;
                        let z = zstd::stream::read::Decoder::new(f).map_err(|e| e.to_string())?;
                        crate::template::apply::apply_layer(
                            z,
                            &rootfs,
                            &crate::template::apply::ApplyOptions::default(),
                        )
                        .map_err(|e| format!("applying the template layer: {e}"))?;
                        drop(staging);
                        Ok(())
                    })
                    .await
                    .map_err(|e| e.to_string())?
                },
            )
            .await
            .map_err(|e| e.to_string())?;
        Ok(name)
    }

    async fn start_build_box(
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

    fn guest(
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
    async fn sh(
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
    async fn run_step(
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

    async fn capture_layer(
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
    pub(super) async fn start_and_wait_ready_at(
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
        self.start_and_wait_ready(&bx, state, start, ready, timeout, None)
            .await
    }

    async fn start_and_wait_ready(
        &self,
        bx: &BuildBox,
        state: &RunState,
        start: Option<&str>,
        ready: Option<&str>,
        timeout: Duration,
        log: Option<&BuildLog>,
    ) -> Result<(), String> {
        use agentenv_guest::proto::process as pr;
        use pr::process_event::Event;
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
            let mut stream = client
                .start(&req)
                .await
                .map_err(|e| format!("starting the start command: {e}"))?;
            let ended = ended.clone();
            pump = Some(tokio::spawn(async move {
                while let Some(Ok(msg)) = stream.next().await {
                    if let Some(Event::End(e)) = msg.event.and_then(|e| e.event) {
                        *ended.lock() = Some(if e.exited {
                            format!("exit code {}", e.exit_code)
                        } else {
                            e.status
                        });
                    }
                }
            }));
        }
        let Some(ready) = ready else {
            if let Some(p) = pump {
                // The process keeps running in the sandbox; only the stream goes.
                tokio::time::sleep(Duration::from_millis(100)).await;
                p.abort();
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
            p.abort();
        }
        if result.is_ok()
            && let Some(log) = log
        {
            log.info(Some("finalize"), "Ready");
        }
        result
    }
}

/// What a create from a custom template starts with.
#[derive(Debug, Clone)]
pub struct FromTemplate {
    /// The local template the backend stacks the sandbox on.
    pub local: String,
    pub template_id: String,
    pub name: Option<String>,
    pub state: RunState,
    pub start_cmd: Option<String>,
    pub ready_cmd: Option<String>,
}

impl Orchestrator {
    /// The custom template `reference` names (`name`, `name:tag`, an id), made local on
    /// this node when it is not yet: `None` when it names none (`base`, a snapshot).
    pub(super) async fn resolve_custom_template(
        &self,
        reference: &str,
    ) -> Result<Option<FromTemplate>, LifecycleError> {
        let Some(t) = self.templates.get() else {
            return Ok(None);
        };
        let (name, tag) = split_reference(reference);
        if name == BASE_TEMPLATE || crate::ids::is_uuid(name) {
            return Ok(None);
        }
        let Some((rec, b)) = self.resolve_build(t, reference).await? else {
            if tag.is_some() && t.catalog.resolve(name).await?.is_some() {
                return Err(LifecycleError::NotFound(format!(
                    "template {reference} (the template has no ready build with tag {:?})",
                    tag.unwrap_or(DEFAULT_TAG)
                )));
            }
            return Ok(None);
        };
        let res = b
            .result
            .clone()
            .expect("resolve_build returns ready builds");
        let timer = self.metrics.start("create_warm", "template_fetch");
        let local = self
            .materialize(t, &b, crate::template::log_progress())
            .await
            .map_err(|e| LifecycleError::Internal(format!("preparing template {reference}: {e}")));
        timer.finish(local.is_ok());
        Ok(Some(FromTemplate {
            local: local?,
            template_id: rec.template_id.clone(),
            name: rec
                .names
                .iter()
                .find(|n| *n == name)
                .or(rec.names.first())
                .cloned(),
            state: res.state,
            start_cmd: res.start_cmd,
            ready_cmd: res.ready_cmd,
        }))
    }
}

/// A progress callback writing into a build's log.
fn log_progress(log: Arc<BuildLog>, step: &'static str) -> Progress {
    Arc::new(move |line| log.info(Some(step), line.to_string()))
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

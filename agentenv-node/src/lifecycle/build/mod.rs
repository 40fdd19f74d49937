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
//!
//! The rooms: `log` (a build's log lines, written to the store in chunks), `source`
//! (what a build starts from, and templates made local), `sandbox` (the build sandbox and
//! the steps run in it).

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
mod log;
mod sandbox;
mod source;

use log::BuildLog;

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
                    None,
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
}

/// A progress callback writing into a build's log.
fn log_progress(log: Arc<BuildLog>, step: &'static str) -> Progress {
    Arc::new(move |line| log.info(Some(step), line.to_string()))
}

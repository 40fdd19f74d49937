//! What a build starts from (the built-in template, another build, an OCI image kept in
//! the store) and templates made local on a node, for builds and for creates.

use super::*;

impl Orchestrator {
    /// What a build's `fromTemplate` or `fromImage` names, and the state it starts with.
    pub(in crate::lifecycle) async fn resolve_base(
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

    pub(in crate::lifecycle) async fn pull_image(
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
    pub(in crate::lifecycle) fn materialize_base<'a>(
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
    pub(in crate::lifecycle) async fn resolve_custom_template(
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

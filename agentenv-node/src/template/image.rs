//! Disk images of templates for microVM sandboxes: a template's root filesystem as an ext4
//! image with the guest agent installed as the VM's init.
//!
//! The image is built with `mkfs.ext4 -d <rootfs>` (e2fsprogs), then the agent binary is
//! written into it with `debugfs -w` at [`AGENT_IMAGE_PATH`]; the kernel starts it with
//! `init=` ([`init_cmdline`]). Images are cached per template under the cache directory as
//! `<template>-<key>.ext4`, where the key hashes the template's metadata (a rebuilt
//! template has a new build time) and the agent binary's contents, so a changed template
//! or agent gets a new image and older images of that template are removed. A build
//! happens in a staging file renamed into place when complete, under a per-template lock
//! shared by every node process: no half-built image is ever visible.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use nix::fcntl::{Flock, FlockArg};
use sha2::{Digest, Sha256};

use super::{Progress, Template};

/// Where the agent lives inside the image.
pub const AGENT_IMAGE_PATH: &str = "/agentenv/agentenv-guest";

/// Bumped when the image layout changes, so old cached images are rebuilt.
const IMAGE_FORMAT: u32 = 1;

/// Free room added to the root filesystem's size, in MiB.
const SLACK_MIB: u64 = 64;

/// Errors of the image builder.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error(
        "{tool} not found: install e2fsprogs (`apt-get install e2fsprogs`, listed in scripts/apt-packages.txt)"
    )]
    ToolMissing { tool: &'static str },
    #[error("{tool} failed for template {template:?} ({status}): {output}")]
    ToolFailed {
        tool: &'static str,
        template: String,
        status: String,
        output: String,
    },
    #[error(
        "the image of template {template:?} does not hold the agent after writing it: {output}"
    )]
    AgentMissing { template: String, output: String },
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> ImageError {
    let context = context.into();
    move |source| ImageError::Io { context, source }
}

/// The kernel command line part that starts the agent from the image as PID 1 in init
/// mode. The kernel hands an argument it does not know and that has no `=` to init, so
/// `--init` reaches the agent; no `--` separator is used, because the VMM appends its
/// console and device arguments after the configured command line and the kernel would
/// pass everything after `--` to init.
pub fn init_cmdline() -> String {
    format!("init={AGENT_IMAGE_PATH} --init")
}

/// The cache key of an image: template metadata, agent contents, image format.
pub fn image_key(template: &Template, agent_binary: &Path) -> Result<String, ImageError> {
    let mut h = Sha256::new();
    h.update(format!(
        "format {IMAGE_FORMAT}\nname {}\nbuilt {}\nsource {}\n",
        template.name, template.meta.built_at, template.meta.source
    ));
    let mut f =
        File::open(agent_binary).map_err(io_err(format!("opening {}", agent_binary.display())))?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .map_err(io_err(format!("reading {}", agent_binary.display())))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(&h.finalize()[..8]))
}

/// The path of the image of `template` (present only once built).
pub fn image_path(
    cache_dir: &Path,
    template: &Template,
    agent_binary: &Path,
) -> Result<PathBuf, ImageError> {
    Ok(cache_dir.join(format!(
        "{}-{}.ext4",
        template.name,
        image_key(template, agent_binary)?
    )))
}

/// Bytes the files under `dir` occupy (allocated blocks, each hard link once).
fn tree_bytes(dir: &Path) -> u64 {
    let mut total = 0u64;
    let mut seen = std::collections::HashSet::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let Ok(md) = std::fs::symlink_metadata(e.path()) else {
                continue;
            };
            if md.nlink() > 1 && !md.is_dir() && !seen.insert((md.dev(), md.ino())) {
                continue;
            }
            total += md.blocks() * 512 + 4096;
            if md.is_dir() {
                stack.push(e.path());
            }
        }
    }
    total
}

fn find_tool(name: &'static str) -> Result<PathBuf, ImageError> {
    super::resolve_program(Path::new(name))
        .or_else(|| {
            ["/usr/sbin", "/sbin"]
                .iter()
                .map(|d| Path::new(d).join(name))
                .find(|p| p.exists())
        })
        .ok_or(ImageError::ToolMissing { tool: name })
}

async fn run_tool(
    tool: &'static str,
    path: &Path,
    args: &[&std::ffi::OsStr],
    template: &str,
) -> Result<String, ImageError> {
    let out = tokio::process::Command::new(path)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(io_err(format!("running {tool}")))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        return Err(ImageError::ToolFailed {
            tool,
            template: template.to_string(),
            status: out.status.to_string(),
            output: text.trim().to_string(),
        });
    }
    Ok(text)
}

/// Returns the ext4 image of `template` with `agent_binary` as init, building it first when
/// the cache has none for this template and agent. Concurrent callers (also in other
/// processes) wait for one build.
pub async fn ensure_image(
    template: &Template,
    agent_binary: &Path,
    cache_dir: &Path,
    progress: Progress,
) -> Result<PathBuf, ImageError> {
    let target = image_path(cache_dir, template, agent_binary)?;
    if target.exists() {
        return Ok(target);
    }
    std::fs::create_dir_all(cache_dir)
        .map_err(io_err(format!("creating {}", cache_dir.display())))?;
    let lock_path = cache_dir.join(format!(".{}.image.lock", template.name));
    let lock = tokio::task::spawn_blocking(move || -> Result<Flock<File>, ImageError> {
        let f = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io_err(format!("opening {}", lock_path.display())))?;
        Flock::lock(f, FlockArg::LockExclusive)
            .map_err(|(_, e)| io_err(format!("locking {}", lock_path.display()))(e.into()))
    })
    .await
    .map_err(|e| ImageError::Io {
        context: "waiting for the image build lock".into(),
        source: std::io::Error::other(e),
    })??;
    if target.exists() {
        drop(lock);
        return Ok(target);
    }
    let staging = cache_dir.join(format!(
        ".build-{}-{}.ext4",
        template.name,
        uuid::Uuid::new_v4().simple()
    ));
    let result = build(template, agent_binary, &staging, &progress).await;
    let result = match result {
        Ok(()) => std::fs::rename(&staging, &target)
            .map_err(io_err(format!("publishing {}", target.display()))),
        Err(e) => Err(e),
    };
    if result.is_err() {
        let _ = std::fs::remove_file(&staging);
    } else {
        remove_older_images(cache_dir, &template.name, &target);
        progress(&format!("image ready: {}", target.display()));
    }
    drop(lock);
    result.map(|()| target)
}

/// Removes images of `name` other than `keep`, and staging files of dead builds.
fn remove_older_images(cache_dir: &Path, name: &str, keep: &Path) {
    let Ok(entries) = std::fs::read_dir(cache_dir) else {
        return;
    };
    let prefix = format!("{name}-");
    for e in entries.flatten() {
        let file = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = file.strip_prefix(&prefix) else {
            continue;
        };
        // `<name>-<16 hex>.ext4` exactly: another template's name may extend this one's.
        let is_ours = rest
            .strip_suffix(".ext4")
            .is_some_and(|k| k.len() == 16 && k.bytes().all(|b| b.is_ascii_hexdigit()));
        if is_ours && e.path() != keep {
            match std::fs::remove_file(e.path()) {
                Ok(()) => {
                    tracing::info!(image = %e.path().display(), "removed an outdated template image")
                }
                Err(err) => {
                    tracing::warn!(image = %e.path().display(), error = %err, "removing an outdated template image")
                }
            }
        }
    }
}

async fn build(
    template: &Template,
    agent_binary: &Path,
    staging: &Path,
    progress: &Progress,
) -> Result<(), ImageError> {
    let mkfs = find_tool("mkfs.ext4")?;
    let debugfs = find_tool("debugfs")?;
    let rootfs = template.rootfs.clone();
    let agent_len = std::fs::metadata(agent_binary)
        .map_err(io_err(format!("reading {}", agent_binary.display())))?
        .len();
    let used = tokio::task::spawn_blocking(move || tree_bytes(&rootfs))
        .await
        .map_err(|e| ImageError::Io {
            context: "measuring the template".into(),
            source: std::io::Error::other(e),
        })?;
    let size_mib = (used + agent_len) * 5 / 4 / (1 << 20) + SLACK_MIB;
    progress(&format!(
        "building the disk image of template {:?}: {size_mib} MiB ext4 from {}",
        template.name,
        template.rootfs.display()
    ));
    let size = format!("{size_mib}M");
    run_tool(
        "mkfs.ext4",
        &mkfs,
        &[
            "-q".as_ref(),
            "-F".as_ref(),
            "-t".as_ref(),
            "ext4".as_ref(),
            "-L".as_ref(),
            "agentenv-root".as_ref(),
            "-d".as_ref(),
            template.rootfs.as_os_str(),
            staging.as_os_str(),
            size.as_ref(),
        ],
        &template.name,
    )
    .await?;
    progress("installing the guest agent as init");
    let dir = Path::new(AGENT_IMAGE_PATH)
        .parent()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| "/".into());
    let agent = agent_binary.display().to_string();
    if agent.contains(char::is_whitespace) || agent.contains('"') {
        // debugfs requests are whitespace-separated; copy to a plain name first.
        return Err(ImageError::Io {
            context: format!("the agent path {agent:?} has spaces or quotes"),
            source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
        });
    }
    let script = format!(
        "mkdir {dir}\nrm {AGENT_IMAGE_PATH}\nwrite {agent} {AGENT_IMAGE_PATH}\n\
         sif {AGENT_IMAGE_PATH} mode 0100755\nsif {AGENT_IMAGE_PATH} uid 0\nsif {AGENT_IMAGE_PATH} gid 0\n\
         sif {dir} mode 040755\n"
    );
    let script_path = staging.with_extension("debugfs");
    std::fs::write(&script_path, script)
        .map_err(io_err(format!("writing {}", script_path.display())))?;
    let written = run_tool(
        "debugfs",
        &debugfs,
        &[
            "-w".as_ref(),
            "-f".as_ref(),
            script_path.as_os_str(),
            staging.as_os_str(),
        ],
        &template.name,
    )
    .await;
    let _ = std::fs::remove_file(&script_path);
    written?;
    let stat = format!("stat {AGENT_IMAGE_PATH}");
    let out = run_tool(
        "debugfs",
        &debugfs,
        &["-R".as_ref(), stat.as_ref(), staging.as_os_str()],
        &template.name,
    )
    .await?;
    let expected_size = format!("Size: {agent_len}");
    if !out.contains(&expected_size) || !out.contains("Mode:  0755") {
        return Err(ImageError::AgentMissing {
            template: template.name.clone(),
            output: out.trim().to_string(),
        });
    }
    let f = File::open(staging).map_err(io_err(format!("opening {}", staging.display())))?;
    f.sync_all()
        .map_err(io_err(format!("syncing {}", staging.display())))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::template::TemplateMeta;
    use std::sync::{Arc, Mutex};

    fn template(root: &Path, built_at: u64) -> Template {
        Template {
            name: "tiny".into(),
            rootfs: root.to_path_buf(),
            meta: TemplateMeta {
                name: "tiny".into(),
                built_at,
                source: "test".into(),
            },
        }
    }

    fn debugfs(image: &Path, request: &str) -> String {
        let out = std::process::Command::new(find_tool("debugfs").unwrap())
            .args(["-R", request])
            .arg(image)
            .output()
            .unwrap();
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }

    #[tokio::test]
    async fn an_image_holds_the_tree_and_the_agent_and_is_rebuilt_only_on_change() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("rootfs");
        std::fs::create_dir_all(root.join("etc")).unwrap();
        std::fs::create_dir_all(root.join("usr/bin")).unwrap();
        std::fs::write(root.join("etc/hostname"), "sandbox\n").unwrap();
        std::fs::write(root.join("usr/bin/tool"), vec![7u8; 100_000]).unwrap();
        std::os::unix::fs::symlink("usr/bin", root.join("bin")).unwrap();
        let agent = dir.path().join("agent");
        std::fs::write(&agent, b"\x7fELF not really an agent").unwrap();
        let cache = dir.path().join("cache");
        let lines = Arc::new(Mutex::new(Vec::<String>::new()));
        let l2 = lines.clone();
        let progress: Progress = Arc::new(move |l| l2.lock().unwrap().push(l.to_string()));

        let t = template(&root, 1);
        let image = ensure_image(&t, &agent, &cache, progress.clone())
            .await
            .unwrap();
        assert!(image.exists());
        assert!(
            lines.lock().unwrap().iter().any(|l| l.contains("building")),
            "{lines:?}"
        );
        let ls = debugfs(&image, "ls -l /");
        for name in ["etc", "usr", "bin", "agentenv"] {
            assert!(ls.contains(name), "{name} missing in:\n{ls}");
        }
        assert!(debugfs(&image, "cat /etc/hostname").contains("sandbox"));
        let stat = debugfs(&image, "stat /usr/bin/tool");
        assert!(stat.contains("Size: 100000"), "{stat}");
        let agent_stat = debugfs(&image, &format!("stat {AGENT_IMAGE_PATH}"));
        assert!(agent_stat.contains("Mode:  0755"), "{agent_stat}");
        assert!(debugfs(&image, &format!("cat {AGENT_IMAGE_PATH}")).contains("not really"));
        // No staging files are left.
        let names: Vec<String> = std::fs::read_dir(&cache)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| !n.ends_with(".lock"))
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");

        // Cached: same path, no new build.
        lines.lock().unwrap().clear();
        let again = ensure_image(&t, &agent, &cache, progress.clone())
            .await
            .unwrap();
        assert_eq!(again, image);
        assert!(lines.lock().unwrap().is_empty());

        // A new agent gives a new image and removes the old one.
        std::fs::write(&agent, b"\x7fELF another agent").unwrap();
        let newer = ensure_image(&t, &agent, &cache, progress.clone())
            .await
            .unwrap();
        assert_ne!(newer, image);
        assert!(!image.exists());
        assert!(debugfs(&newer, &format!("cat {AGENT_IMAGE_PATH}")).contains("another"));

        // A rebuilt template (new build time) does too.
        let rebuilt = ensure_image(&template(&root, 2), &agent, &cache, progress)
            .await
            .unwrap();
        assert_ne!(rebuilt, newer);
        assert!(!newer.exists());
    }

    #[tokio::test]
    async fn a_failed_build_leaves_no_image() {
        let dir = tempfile::tempdir().unwrap();
        let agent = dir.path().join("agent");
        std::fs::write(&agent, b"agent").unwrap();
        let cache = dir.path().join("cache");
        // A root filesystem that does not exist makes mkfs.ext4 fail.
        let t = template(&dir.path().join("missing"), 1);
        let err = ensure_image(&t, &agent, &cache, Arc::new(|_| {}))
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                ImageError::ToolFailed {
                    tool: "mkfs.ext4",
                    ..
                }
            ),
            "{err}"
        );
        let left: Vec<_> = std::fs::read_dir(&cache)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .filter(|n| !n.to_string_lossy().ends_with(".lock"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn init_runs_the_agent_in_init_mode() {
        assert_eq!(init_cmdline(), "init=/agentenv/agentenv-guest --init");
        assert!(!init_cmdline().split_whitespace().any(|w| w == "--"));
    }
}

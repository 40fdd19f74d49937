//! Durable records of paused sandboxes: one JSON file per sandbox, written to a temporary
//! file, synced, renamed into place, and the directory synced.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::SandboxRecord;

/// Errors of the paused-sandbox store.
#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    #[error("{context} {}: {source}", path.display())]
    Io {
        context: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn io(context: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> PersistError {
    let path = path.to_path_buf();
    move |source| PersistError::Io {
        context,
        path,
        source,
    }
}

#[derive(Serialize, Deserialize)]
struct Envelope {
    version: u32,
    lifecycle: String,
    metadata: SandboxRecord,
}

/// The store under `<home>/persisted-sandboxes/`.
#[derive(Debug, Clone)]
pub struct PausedStore {
    dir: PathBuf,
}

impl PausedStore {
    /// Opens (creating) the store directory.
    pub fn open(dir: impl Into<PathBuf>) -> Result<Self, PersistError> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir).map_err(io("creating", &dir))?;
        Ok(Self { dir })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    /// Writes (replaces) the record of a paused sandbox, durably.
    pub fn save(&self, rec: &SandboxRecord) -> Result<(), PersistError> {
        let env = Envelope {
            version: 1,
            lifecycle: "paused".into(),
            metadata: rec.clone(),
        };
        let bytes = serde_json::to_vec_pretty(&env).unwrap_or_default();
        let tmp = self.dir.join(format!(".{}.tmp", rec.id));
        {
            let mut f = std::fs::File::create(&tmp).map_err(io("creating", &tmp))?;
            f.write_all(&bytes)
                .and_then(|_| f.sync_all())
                .map_err(io("writing", &tmp))?;
        }
        let path = self.path(&rec.id);
        std::fs::rename(&tmp, &path).map_err(io("renaming into", &path))?;
        self.sync_dir()
    }

    fn sync_dir(&self) -> Result<(), PersistError> {
        std::fs::File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(io("syncing", &self.dir))
    }

    /// Removes a record (absent is fine).
    pub fn remove(&self, id: &str) -> Result<(), PersistError> {
        let path = self.path(id);
        match std::fs::remove_file(&path) {
            Ok(()) => self.sync_dir(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io("removing", &path)(e)),
        }
    }

    /// Every readable record; unreadable ones and leftover temporary files are removed.
    pub fn load_all(&self) -> Result<Vec<SandboxRecord>, PersistError> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(&self.dir).map_err(io("listing", &self.dir))? {
            let entry = entry.map_err(io("listing", &self.dir))?;
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                let _ = std::fs::remove_file(&path);
                continue;
            }
            let Some(id) = name.strip_suffix(".json") else {
                continue;
            };
            let parsed = std::fs::read(&path)
                .ok()
                .and_then(|b| serde_json::from_slice::<Envelope>(&b).ok())
                .filter(|e| e.version == 1 && e.lifecycle == "paused" && e.metadata.id == id);
            match parsed {
                Some(e) => out.push(e.metadata),
                None => {
                    tracing::warn!(path = %path.display(), "discarding an unreadable paused-sandbox record");
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        out.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(out)
    }
}

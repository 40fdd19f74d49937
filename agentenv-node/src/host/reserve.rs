//! Host-wide reservations of numbered resources (sandbox addresses, id ranges).
//!
//! A reservation is a file `<dir>/<name of the index>` created with `O_EXCL` and holding
//! its owner's path (a sandbox directory, or a namespace pool's owner directory), so
//! several node processes on one host share the numbers without collisions, and a
//! reservation whose owner is gone can be found and released after a crash.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

/// How the index of a reservation is named on disk.
pub(crate) trait IndexName {
    /// The file name of index `idx`.
    fn name(&self, idx: u32) -> String;
    /// The index a file name stands for, if it is one of ours.
    fn parse(&self, name: &str) -> Option<u32>;
}

/// `count` numbered resources with their reservations in `dir`.
#[derive(Debug)]
pub(crate) struct Reservations<N> {
    dir: PathBuf,
    count: u32,
    cursor: AtomicU32,
    naming: N,
}

/// Why a reservation could not be made.
#[derive(Debug)]
pub(crate) enum ReserveError {
    /// Every index is reserved.
    Exhausted,
    Io(String, std::io::Error),
}

impl<N: IndexName> Reservations<N> {
    /// Reservations of `count` indexes in `dir` (created if missing).
    pub(crate) fn new(dir: PathBuf, count: u32, naming: N) -> std::io::Result<Self> {
        std::fs::create_dir_all(&dir)?;
        Ok(Self {
            dir,
            count,
            cursor: AtomicU32::new(0),
            naming,
        })
    }

    fn path(&self, idx: u32) -> PathBuf {
        self.dir.join(self.naming.name(idx))
    }

    /// Reserves a free index for `owner` (written into the reservation). Starts after
    /// the index reserved last, so numbers are not reused at once.
    pub(crate) fn reserve(&self, owner: &Path) -> Result<u32, ReserveError> {
        let n = self.count;
        let start = self.cursor.fetch_add(1, Ordering::Relaxed) % n;
        for i in 0..n {
            let idx = (start + i) % n;
            match File::options()
                .write(true)
                .create_new(true)
                .open(self.path(idx))
            {
                Ok(mut f) => {
                    f.write_all(owner.as_os_str().as_encoded_bytes())
                        .map_err(|e| ReserveError::Io("writing a reservation".into(), e))?;
                    self.cursor.store(idx + 1, Ordering::Relaxed);
                    return Ok(idx);
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => {
                    return Err(ReserveError::Io(
                        format!("reserving {}", self.path(idx).display()),
                        e,
                    ));
                }
            }
        }
        Err(ReserveError::Exhausted)
    }

    /// Returns an index to the pool.
    pub(crate) fn release(&self, idx: u32) {
        match std::fs::remove_file(self.path(idx)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(reservation = %self.path(idx).display(), error = %e, "releasing a reservation")
            }
        }
    }

    /// Hands a reservation over to `owner` (rewritten in place, atomically).
    pub(crate) fn transfer(&self, idx: u32, owner: &Path) -> std::io::Result<()> {
        let nonce: u64 = rand::random();
        // Names starting with a dot are not ours: `list` skips them.
        let tmp = self
            .dir
            .join(format!(".{}.{nonce:016x}", self.naming.name(idx)));
        std::fs::write(&tmp, owner.as_os_str().as_encoded_bytes())?;
        std::fs::rename(&tmp, self.path(idx)).inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
    }

    /// Whether a reservation named `name` exists, of these indexes or not.
    pub(crate) fn name_reserved(&self, name: &str) -> bool {
        !name.starts_with('.') && !name.contains('/') && self.dir.join(name).exists()
    }

    /// Every reservation of these indexes on the host: `(index, owner path)`.
    pub(crate) fn list(&self) -> Vec<(u32, PathBuf)> {
        self.list_names()
            .into_iter()
            .filter_map(|(name, owner)| Some((self.naming.parse(&name)?, owner)))
            .filter(|(idx, _)| *idx < self.count)
            .collect()
    }

    /// Every reservation in the directory, of these indexes or not (node processes with
    /// other pools share it): `(file name, owner path)`. Names starting with a dot are
    /// reservations being handed over, not reservations.
    pub(crate) fn list_names(&self) -> Vec<(String, PathBuf)> {
        let mut out = Vec::new();
        if let Ok(entries) = std::fs::read_dir(&self.dir) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with('.') {
                    continue;
                }
                let owner = std::fs::read(e.path())
                    .map(|b| PathBuf::from(String::from_utf8_lossy(&b).into_owned()))
                    .unwrap_or_default();
                out.push((name, owner));
            }
        }
        out
    }

    /// Releases every reservation whose owner directory no longer exists; returns them.
    pub(crate) fn release_orphans(&self) -> Vec<u32> {
        let mut gone = Vec::new();
        for (idx, owner) in self.list() {
            if !owner.as_os_str().is_empty() && !owner.exists() {
                self.release(idx);
                gone.push(idx);
            }
        }
        gone
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Plain;
    impl IndexName for Plain {
        fn name(&self, idx: u32) -> String {
            idx.to_string()
        }
        fn parse(&self, name: &str) -> Option<u32> {
            name.parse().ok()
        }
    }

    #[test]
    fn reservations_are_exclusive_until_released_and_name_their_owner() {
        let dir = tempfile::tempdir().unwrap();
        let r = Reservations::new(dir.path().join("r"), 2, Plain).unwrap();
        let a = r.reserve(Path::new("/owner/a")).unwrap();
        let b = r.reserve(Path::new("/owner/b")).unwrap();
        assert_ne!(a, b);
        assert!(matches!(
            r.reserve(Path::new("/owner/c")),
            Err(ReserveError::Exhausted)
        ));
        let mut list = r.list();
        list.sort();
        assert_eq!(list.len(), 2);
        assert!(
            list.iter()
                .any(|(i, o)| *i == a && o == Path::new("/owner/a"))
        );
        r.transfer(a, Path::new("/owner/z")).unwrap();
        assert!(
            r.list()
                .iter()
                .any(|(i, o)| *i == a && o == Path::new("/owner/z"))
        );
        r.release(b);
        assert!(!r.name_reserved(&b.to_string()));
        assert_eq!(r.reserve(Path::new("/owner/d")).unwrap(), b);
    }

    #[test]
    fn orphans_are_reservations_whose_owner_directory_is_gone() {
        let dir = tempfile::tempdir().unwrap();
        let live = dir.path().join("live");
        std::fs::create_dir(&live).unwrap();
        let r = Reservations::new(dir.path().join("r"), 4, Plain).unwrap();
        let kept = r.reserve(&live).unwrap();
        let gone = r.reserve(&dir.path().join("vanished")).unwrap();
        assert_eq!(r.release_orphans(), vec![gone]);
        assert!(r.name_reserved(&kept.to_string()));
        assert!(!r.name_reserved(&gone.to_string()));
    }
}

//! Volume records, names and leases on the shared [`Storage`].
//!
//! A volume exists when its signed record exists *and* its name points to it: a create
//! writes the record first and then claims the name (an atomic create, so two nodes
//! never give one name to two volumes); a record whose name is not its own (a create
//! that lost the name, or crashed before claiming it) is invisible. A name whose record
//! is gone (a delete that crashed half-way) is taken over by the next create.
//!
//! A lease says that a sandbox mounts a volume: it is written before the sandbox first
//! mounts it and removed when the sandbox is deleted, so a paused sandbox (which mounts
//! it again on resume) keeps its lease. A volume with leases is not deleted (409, naming
//! a sandbox). Mount and delete order their steps so that neither can miss the other:
//! a mount writes its lease and then reads the record again; a delete removes the record
//! and then looks for leases again, putting the record back (and refusing) if one
//! appeared.

use std::sync::Arc;

use agentenv_core::storage::Storage;
use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::VolumeError;
use super::record::{Envelope, VolumeKey, VolumeRecord, validate_name};

/// Largest record, name or lease object read.
const MAX_OBJECT: usize = 64 << 10;

/// The version of records this node writes.
const RECORD_VERSION: u32 = 1;

/// What a lease holds: the node of the sandbox that mounts the volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub node: String,
}

/// A sandbox that mounts a volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub volume_id: String,
    pub sandbox_id: String,
    pub node: String,
}

/// The volume records of one store.
#[derive(Debug)]
pub struct VolumeStore {
    storage: Arc<dyn Storage>,
    key: VolumeKey,
}

fn record_key(id: &str) -> String {
    format!("volumes/records/{id}.json")
}

fn name_key(name: &str) -> String {
    format!("volumes/names/{name}.json")
}

fn lease_prefix(id: &str) -> String {
    format!("volumes/leases/{id}/")
}

fn lease_key(id: &str, sandbox: &str) -> String {
    format!("volumes/leases/{id}/{sandbox}.json")
}

impl VolumeStore {
    pub fn new(storage: Arc<dyn Storage>, key: VolumeKey) -> Self {
        Self { storage, key }
    }

    pub fn key(&self) -> &VolumeKey {
        &self.key
    }

    /// Creates volume `name`: a new record, then the name.
    pub async fn create(&self, name: &str) -> Result<VolumeRecord, VolumeError> {
        validate_name(name)?;
        let rec = VolumeRecord {
            version: RECORD_VERSION,
            id: uuid::Uuid::now_v7().to_string(),
            name: name.to_string(),
            created_at_ms: crate::clock::now_ms(),
        };
        let key = record_key(&rec.id);
        let body = serde_json::to_string(&rec).expect("a record serializes");
        let sealed = serde_json::to_vec(&self.key.seal(&key, body)).expect("an envelope");
        self.storage.create_new(&key, Bytes::from(sealed)).await?;
        if let Err(e) = self.claim_name(name, &rec.id).await {
            if let Err(d) = self.storage.delete(&key).await {
                tracing::warn!(volume = %rec.id, error = %d, "removing the record of a volume whose name was taken");
            }
            return Err(e);
        }
        Ok(rec)
    }

    /// Points `name` at `id` (atomic across nodes); a name whose volume is gone is
    /// taken over.
    async fn claim_name(&self, name: &str, id: &str) -> Result<(), VolumeError> {
        let key = name_key(name);
        let body = Bytes::from(serde_json::to_vec(id).expect("a string serializes"));
        for _ in 0..2 {
            if self.storage.create_new(&key, body.clone()).await? {
                return Ok(());
            }
            if let Some(owner) = self.by_name(name).await? {
                return Err(VolumeError::NameTaken {
                    name: name.to_string(),
                    id: owner.id,
                });
            }
            tracing::info!(name, "taking over a volume name whose volume is gone");
            self.storage.delete(&key).await?;
        }
        Err(VolumeError::NameTaken {
            name: name.to_string(),
            id: "(being created)".into(),
        })
    }

    /// The id `name` points to, if any.
    async fn name_target(&self, name: &str) -> Result<Option<String>, VolumeError> {
        let Some(raw) = self.storage.read(&name_key(name), MAX_OBJECT).await? else {
            return Ok(None);
        };
        Ok(serde_json::from_slice::<String>(&raw).ok())
    }

    /// The signed record under `id` (not checked against its name).
    async fn record(&self, id: &str) -> Result<Option<VolumeRecord>, VolumeError> {
        if !crate::ids::is_uuid(id) {
            return Ok(None);
        }
        let key = record_key(id);
        let Some(raw) = self.storage.read(&key, MAX_OBJECT).await? else {
            return Ok(None);
        };
        let what = || format!("the record of volume {id}");
        let env: Envelope = serde_json::from_slice(&raw).map_err(|e| VolumeError::Corrupt {
            what: what(),
            reason: e.to_string(),
        })?;
        if !self.key.verifies(&key, &env) {
            return Err(VolumeError::Forged {
                what: what(),
                reason: "its signature does not match its content".into(),
            });
        }
        let rec: VolumeRecord =
            serde_json::from_str(&env.body).map_err(|e| VolumeError::Corrupt {
                what: what(),
                reason: e.to_string(),
            })?;
        Ok(Some(rec))
    }

    /// Volume `id`, if it exists.
    pub async fn get(&self, id: &str) -> Result<Option<VolumeRecord>, VolumeError> {
        let id = id.to_ascii_lowercase();
        let Some(rec) = self.record(&id).await? else {
            return Ok(None);
        };
        if self.name_target(&rec.name).await?.as_deref() != Some(id.as_str()) {
            return Ok(None);
        }
        Ok(Some(rec))
    }

    /// The volume named `name`, if it exists.
    pub async fn by_name(&self, name: &str) -> Result<Option<VolumeRecord>, VolumeError> {
        if validate_name(name).is_err() {
            return Ok(None);
        }
        let Some(id) = self.name_target(name).await? else {
            return Ok(None);
        };
        Ok(self.record(&id).await?.filter(|r| r.name == name))
    }

    /// Every volume, oldest first (ties by id). Unreadable ones are skipped (logged).
    pub async fn list(&self) -> Result<Vec<VolumeRecord>, VolumeError> {
        let mut out = Vec::new();
        for key in self.storage.list("volumes/names/").await? {
            let Some(name) = key
                .strip_prefix("volumes/names/")
                .and_then(|k| k.strip_suffix(".json"))
            else {
                continue;
            };
            match self.by_name(name).await {
                Ok(Some(r)) => out.push(r),
                Ok(None) => {}
                Err(e) => tracing::warn!(name, error = %e, "skipping an unreadable volume"),
            }
        }
        out.sort_by(|a, b| {
            a.created_at_ms
                .cmp(&b.created_at_ms)
                .then_with(|| a.id.cmp(&b.id))
        });
        Ok(out)
    }

    /// The sandboxes that mount volume `id`.
    pub async fn holders(&self, id: &str) -> Result<Vec<Holder>, VolumeError> {
        let prefix = lease_prefix(id);
        let mut out = Vec::new();
        for key in self.storage.list(&prefix).await? {
            let Some(sandbox) = key
                .strip_prefix(&prefix)
                .and_then(|k| k.strip_suffix(".json"))
            else {
                continue;
            };
            let node = match self.storage.read(&key, MAX_OBJECT).await? {
                Some(raw) => serde_json::from_slice::<Lease>(&raw)
                    .map(|l| l.node)
                    .unwrap_or_else(|_| "(unknown)".into()),
                // Removed between the list and the read.
                None => continue,
            };
            out.push(Holder {
                volume_id: id.to_string(),
                sandbox_id: sandbox.to_string(),
                node,
            });
        }
        Ok(out)
    }

    /// Every lease of every volume.
    pub async fn all_holders(&self) -> Result<Vec<Holder>, VolumeError> {
        let mut out = Vec::new();
        let mut ids: Vec<String> = Vec::new();
        for key in self.storage.list("volumes/leases/").await? {
            if let Some(id) = key
                .strip_prefix("volumes/leases/")
                .and_then(|k| k.split_once('/'))
                .map(|(id, _)| id.to_string())
                && ids.last() != Some(&id)
            {
                ids.push(id);
            }
        }
        for id in ids {
            out.extend(self.holders(&id).await?);
        }
        Ok(out)
    }

    /// Records that sandbox `sandbox` on `node` mounts volume `rec`, then checks that
    /// the volume still exists (a delete meanwhile wins: the lease goes again).
    pub async fn lease(
        &self,
        rec: &VolumeRecord,
        sandbox: &str,
        node: &str,
    ) -> Result<(), VolumeError> {
        let key = lease_key(&rec.id, sandbox);
        let body = serde_json::to_vec(&Lease {
            node: node.to_string(),
        })
        .expect("a lease serializes");
        self.storage.put(&key, &mut body.as_slice()).await?;
        if self.get(&rec.id).await?.is_none() {
            self.storage.delete(&key).await?;
            return Err(VolumeError::UnknownName(rec.name.clone()));
        }
        Ok(())
    }

    /// Removes sandbox `sandbox`'s lease on volume `id` (none is fine).
    pub async fn unlease(&self, id: &str, sandbox: &str) -> Result<(), VolumeError> {
        self.storage.delete(&lease_key(id, sandbox)).await?;
        Ok(())
    }

    /// Deletes volume `id`'s record and name, unless a sandbox mounts it (then
    /// [`VolumeError::InUse`] and nothing changes). `None` when there was no volume.
    pub async fn remove(&self, id: &str) -> Result<Option<VolumeRecord>, VolumeError> {
        let id = id.to_ascii_lowercase();
        let Some(rec) = self.get(&id).await? else {
            return Ok(None);
        };
        self.refuse_if_held(&rec).await?;
        let key = record_key(&id);
        let Some(raw) = self.storage.read(&key, MAX_OBJECT).await? else {
            return Ok(None);
        };
        self.storage.delete(&key).await?;
        // A mount that wrote its lease before the record went may have read the record
        // still there: it wins, and the record comes back.
        if let Err(e) = self.refuse_if_held(&rec).await {
            if let Err(put) = self.storage.create_new(&key, Bytes::from(raw)).await {
                tracing::error!(volume = %id, error = %put, "putting back the record of a volume a sandbox mounted during its delete");
            }
            return Err(e);
        }
        if self.name_target(&rec.name).await?.as_deref() == Some(id.as_str()) {
            self.storage.delete(&name_key(&rec.name)).await?;
        }
        Ok(Some(rec))
    }

    async fn refuse_if_held(&self, rec: &VolumeRecord) -> Result<(), VolumeError> {
        let holders = self.holders(&rec.id).await?;
        if let Some(first) = holders.first() {
            return Err(VolumeError::InUse {
                id: rec.id.clone(),
                name: rec.name.clone(),
                sandbox: first.sandbox_id.clone(),
                node: first.node.clone(),
                others: holders.len() - 1,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentenv_core::storage::{OpendalStorage, StorageConfig};

    fn store(root: &std::path::Path, seed: &str) -> VolumeStore {
        let cfg = StorageConfig::Fs {
            root: root.to_path_buf(),
        };
        VolumeStore::new(
            Arc::new(OpendalStorage::open(&cfg).unwrap()),
            VolumeKey::from_seed(seed),
        )
    }

    #[tokio::test]
    async fn records_round_trip_and_names_are_unique() {
        let dir = tempfile::tempdir().unwrap();
        let s = store(dir.path(), "seed");
        let a = s.create("data").await.unwrap();
        assert!(crate::ids::is_uuid(&a.id));
        assert_eq!(s.get(&a.id).await.unwrap().unwrap(), a);
        assert_eq!(s.get(&a.id.to_ascii_uppercase()).await.unwrap().unwrap(), a);
        assert_eq!(s.by_name("data").await.unwrap().unwrap(), a);
        let e = s.create("data").await.unwrap_err();
        assert!(
            matches!(&e, VolumeError::NameTaken { id, .. } if *id == a.id),
            "{e}"
        );
        // The loser's record is gone again: only one volume lists.
        assert_eq!(s.list().await.unwrap(), vec![a.clone()]);
        assert_eq!(
            s.storage.list("volumes/records/").await.unwrap().len(),
            1,
            "no orphan record"
        );
        let b = s.create("other").await.unwrap();
        assert_eq!(s.list().await.unwrap(), vec![a.clone(), b.clone()]);
        assert!(s.get("not-a-uuid").await.unwrap().is_none());
        assert!(s.by_name("bad name").await.unwrap().is_none());
        assert!(matches!(
            s.create("bad name").await.unwrap_err(),
            VolumeError::InvalidName(_)
        ));
        // Delete: gone, and the name is free again.
        assert_eq!(s.remove(&a.id).await.unwrap().unwrap(), a);
        assert!(s.get(&a.id).await.unwrap().is_none());
        assert!(s.remove(&a.id).await.unwrap().is_none());
        let a2 = s.create("data").await.unwrap();
        assert_ne!(a2.id, a.id);
    }

    #[tokio::test]
    async fn a_leased_volume_is_not_deleted_and_a_deleted_one_is_not_leased() {
        let dir = tempfile::tempdir().unwrap();
        let s = store(dir.path(), "seed");
        let v = s.create("shared").await.unwrap();
        let sbx = crate::ids::new_sandbox_id();
        s.lease(&v, &sbx, "node-a").await.unwrap();
        let e = s.remove(&v.id).await.unwrap_err();
        let msg = e.to_string();
        assert!(
            matches!(&e, VolumeError::InUse { sandbox, node, .. } if *sandbox == sbx && node == "node-a"),
            "{msg}"
        );
        assert!(msg.contains("delete the sandbox"), "{msg}");
        assert_eq!(s.get(&v.id).await.unwrap().unwrap(), v, "nothing changed");
        assert_eq!(
            s.all_holders().await.unwrap(),
            vec![Holder {
                volume_id: v.id.clone(),
                sandbox_id: sbx.clone(),
                node: "node-a".into()
            }]
        );
        s.unlease(&v.id, &sbx).await.unwrap();
        s.remove(&v.id).await.unwrap().unwrap();
        let e = s.lease(&v, &sbx, "node-a").await.unwrap_err();
        assert!(matches!(e, VolumeError::UnknownName(_)), "{e}");
        assert!(s.holders(&v.id).await.unwrap().is_empty(), "lease removed");
    }

    #[tokio::test]
    async fn records_of_another_seed_or_moved_are_refused_and_stale_names_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        let ours = store(dir.path(), "seed");
        let theirs = store(dir.path(), "other seed");
        let v = theirs.create("theirs").await.unwrap();
        assert!(matches!(
            ours.get(&v.id).await.unwrap_err(),
            VolumeError::Forged { .. }
        ));
        assert!(ours.list().await.unwrap().is_empty(), "skipped");
        // A record of ours copied under another id does not verify there.
        let a = ours.create("mine").await.unwrap();
        let fake = crate::ids::new_sandbox_id();
        std::fs::copy(
            dir.path().join(record_key(&a.id)),
            dir.path().join(record_key(&fake)),
        )
        .unwrap();
        assert!(matches!(
            ours.get(&fake).await.unwrap_err(),
            VolumeError::Forged { .. }
        ));
        // A name left behind by a volume whose record is gone is taken over.
        std::fs::remove_file(dir.path().join(record_key(&a.id))).unwrap();
        let again = ours.create("mine").await.unwrap();
        assert_eq!(ours.by_name("mine").await.unwrap().unwrap(), again);
    }
}

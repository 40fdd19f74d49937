//! The saved state of virtio devices.
//!
//! Each device saves a typed state of its own ([`Persist::State`], a serde struct) under a
//! version of its own ([`Persist::STATE_VERSION`]). In a snapshot it is a JSON object
//! holding the state's fields and `"version"`, inside the transport's state
//! ([`super::mmio::MmioTransportState::device`]). The transport holds devices of any type
//! behind [`super::VirtioDevice`], so it reaches them through [`SavedState`], which every
//! [`Persist`] device has: the version is checked and the state decoded here, once for
//! every device, and the device only sees a state of its own type and version.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Why a device's saved state could not be saved or restored.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error(
        "{device} state version {found} is not supported (this VMM reads version {supported}); take the snapshot again with this VMM"
    )]
    Version {
        device: &'static str,
        /// The version the state names (`none` when it names none).
        found: String,
        supported: u32,
    },
    #[error("{device} state is malformed: {source}")]
    Malformed {
        device: &'static str,
        source: serde_json::Error,
    },
    /// The state is well-formed but does not fit this device (another image size, another
    /// guest CID, an index past a queue).
    #[error("{0}")]
    Invalid(String),
}

/// A device whose state goes into a snapshot.
pub trait Persist {
    /// The device's saved state. Its fields are the JSON fields of the snapshot; a change
    /// of their meaning or shape bumps [`Persist::STATE_VERSION`].
    type State: Serialize + DeserializeOwned;

    /// The version of [`Persist::State`] this build writes and reads.
    const STATE_VERSION: u32;

    /// The device's name in messages about its state (`virtio-blk`, `vsock`).
    const NAME: &'static str;

    /// The state for a snapshot (configuration and backend position; the transport saves
    /// the acked features and the queues).
    fn save(&self) -> Self::State;

    /// Puts a saved state back into this device, built from the same configuration and
    /// not active yet, before the transport activates it again.
    fn restore(&mut self, state: Self::State) -> Result<(), StateError>;
}

/// The state of a device of any type, as the transport sees it: JSON with the version.
pub trait SavedState {
    /// The device's state for a snapshot, with its `"version"`.
    fn save_state(&self) -> Result<Value, StateError>;

    /// Restores what [`SavedState::save_state`] produced, after checking its version.
    fn restore_state(&mut self, state: &Value) -> Result<(), StateError>;
}

#[derive(Serialize)]
struct Versioned<'a, S> {
    version: u32,
    #[serde(flatten)]
    state: &'a S,
}

#[derive(Deserialize)]
struct VersionOnly {
    version: Option<u32>,
}

impl<D: Persist> SavedState for D {
    fn save_state(&self) -> Result<Value, StateError> {
        serde_json::to_value(Versioned {
            version: D::STATE_VERSION,
            state: &self.save(),
        })
        .map_err(|source| StateError::Malformed {
            device: D::NAME,
            source,
        })
    }

    fn restore_state(&mut self, state: &Value) -> Result<(), StateError> {
        let malformed = |source| StateError::Malformed {
            device: D::NAME,
            source,
        };
        // The version first: another version may well have other fields.
        let found = VersionOnly::deserialize(state).map_err(malformed)?.version;
        if found != Some(D::STATE_VERSION) {
            return Err(StateError::Version {
                device: D::NAME,
                found: found.map_or_else(|| "none".into(), |v| v.to_string()),
                supported: D::STATE_VERSION,
            });
        }
        let typed = D::State::deserialize(state).map_err(malformed)?;
        self.restore(typed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Dev {
        pages: u32,
    }

    #[derive(Serialize, Deserialize)]
    struct DevState {
        pages: u32,
    }

    impl Persist for Dev {
        type State = DevState;
        const STATE_VERSION: u32 = 3;
        const NAME: &'static str = "test-dev";
        fn save(&self) -> DevState {
            DevState { pages: self.pages }
        }
        fn restore(&mut self, state: DevState) -> Result<(), StateError> {
            if state.pages > 100 {
                return Err(StateError::Invalid("too many pages".into()));
            }
            self.pages = state.pages;
            Ok(())
        }
    }

    #[test]
    fn a_state_is_saved_with_its_version_and_restored_only_at_that_version() {
        let saved = Dev { pages: 7 }.save_state().unwrap();
        assert_eq!(saved, serde_json::json!({"version": 3, "pages": 7}));
        let mut fresh = Dev::default();
        fresh.restore_state(&saved).unwrap();
        assert_eq!(fresh.pages, 7);

        let e = fresh
            .restore_state(&serde_json::json!({"version": 4, "other": true}))
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "test-dev state version 4 is not supported (this VMM reads version 3); take the snapshot again with this VMM"
        );
        let e = fresh
            .restore_state(&serde_json::json!({"pages": 1}))
            .unwrap_err();
        assert!(e.to_string().contains("version none"), "{e}");
        let e = fresh
            .restore_state(&serde_json::json!({"version": 3, "pages": "x"}))
            .unwrap_err();
        assert!(
            e.to_string().starts_with("test-dev state is malformed"),
            "{e}"
        );
        let e = fresh
            .restore_state(&serde_json::json!({"version": 3, "pages": 101}))
            .unwrap_err();
        assert_eq!(e.to_string(), "too many pages");
        assert_eq!(fresh.pages, 7);
    }
}

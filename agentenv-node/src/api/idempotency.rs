//! `Idempotency-Key` on creates: a retry with the same key and the same body gets the
//! answer of the first request (the same sandbox) instead of a second sandbox.
//!
//! The first request with a key runs; a request with the same key while it runs waits
//! for its answer; afterwards the answer is replayed (`Idempotent-Replayed: true`) for
//! [`KEEP_FOR`]. A create that failed left nothing behind, so its key is forgotten and a
//! retry runs afresh. The same key with another body is refused (409,
//! `idempotency_request_mismatch`). Keys are kept in memory, at most [`MAX_KEYS`] (the
//! oldest go first): a node restart forgets them.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use parking_lot::Mutex;
use sha2::{Digest, Sha256};
use tokio::sync::watch;
use tokio::time::Instant;

/// How long an answer is replayed.
pub const KEEP_FOR: Duration = Duration::from_secs(24 * 3600);
/// Most keys remembered at once.
pub const MAX_KEYS: usize = 10_000;
/// Longest key.
pub const MAX_KEY_LEN: usize = 255;

/// A finished request's answer: its status and JSON body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub status: StatusCode,
    pub body: Bytes,
}

/// Why a request with a key does not run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error(
        "invalid Idempotency-Key: use 1 to {MAX_KEY_LEN} printable ASCII characters, e.g. a UUID"
    )]
    Invalid,
    #[error(
        "this Idempotency-Key was used with another request body: use a new key for another request"
    )]
    Mismatch,
    #[error(
        "the first request with this Idempotency-Key failed while this one waited for it: retry with the same key"
    )]
    FirstFailed,
}

impl KeyError {
    /// The status and the `error_code` of the refusal.
    pub fn status_and_code(&self) -> (StatusCode, &'static str) {
        match self {
            KeyError::Invalid => (StatusCode::BAD_REQUEST, "idempotency_key_invalid"),
            KeyError::Mismatch => (StatusCode::CONFLICT, "idempotency_request_mismatch"),
            KeyError::FirstFailed => (
                StatusCode::SERVICE_UNAVAILABLE,
                "idempotency_outcome_unknown",
            ),
        }
    }
}

type Outcome = Option<Option<Answer>>;

struct Entry {
    fingerprint: [u8; 32],
    /// `None` while the first request runs; `Some(None)` when it failed (the entry goes);
    /// `Some(Some(answer))` when it succeeded.
    outcome: watch::Receiver<Outcome>,
    at: Instant,
}

/// What [`Idempotency::begin`] decided.
pub enum Begin {
    /// Run the request, then [`Claim::finish`].
    Run(Claim),
    /// The answer of the first request with the key.
    Replay(Answer),
}

/// The right and duty to run the request of a key; dropped unfinished, it counts as a
/// failure.
pub struct Claim {
    key: String,
    tx: watch::Sender<Outcome>,
    finished: bool,
    table: std::sync::Weak<Mutex<Table>>,
}

#[derive(Default)]
struct Table {
    entries: HashMap<String, Entry>,
    order: VecDeque<(Instant, String)>,
}

/// The keys a node remembers.
#[derive(Default)]
pub struct Idempotency {
    table: std::sync::Arc<Mutex<Table>>,
}

/// The fingerprint of a JSON request body: its canonical form's hash, so that key order
/// and white space do not matter.
pub fn fingerprint(body: &[u8]) -> [u8; 32] {
    let canonical = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| serde_json::to_vec(&v).ok())
        .unwrap_or_else(|| body.to_vec());
    Sha256::digest(&canonical).into()
}

impl Idempotency {
    /// Checks `key` and either claims it for a request with `body` or gives the answer of
    /// the request that has it (waiting while that one runs).
    pub async fn begin(&self, key: &str, body: &[u8]) -> Result<Begin, KeyError> {
        if key.is_empty() || key.len() > MAX_KEY_LEN || !key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(KeyError::Invalid);
        }
        let fp = fingerprint(body);
        let mut rx = {
            let mut t = self.table.lock();
            let now = Instant::now();
            t.expire(now);
            match t.entries.get(key) {
                Some(e) if e.fingerprint != fp => return Err(KeyError::Mismatch),
                Some(e) => e.outcome.clone(),
                None => {
                    let (tx, rx) = watch::channel(None);
                    t.insert(key, fp, rx, now);
                    return Ok(Begin::Run(Claim {
                        key: key.to_string(),
                        tx,
                        finished: false,
                        table: std::sync::Arc::downgrade(&self.table),
                    }));
                }
            }
        };
        let outcome = rx
            .wait_for(Option::is_some)
            .await
            .map(|o| o.clone())
            .unwrap_or(Some(None));
        match outcome.flatten() {
            Some(answer) => Ok(Begin::Replay(answer)),
            None => Err(KeyError::FirstFailed),
        }
    }

    /// Keys remembered now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.table.lock().entries.len()
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Table {
    fn insert(
        &mut self,
        key: &str,
        fingerprint: [u8; 32],
        outcome: watch::Receiver<Outcome>,
        at: Instant,
    ) {
        while self.entries.len() >= MAX_KEYS {
            let Some((_, old)) = self.order.pop_front() else {
                break;
            };
            self.entries.remove(&old);
        }
        self.entries.insert(
            key.to_string(),
            Entry {
                fingerprint,
                outcome,
                at,
            },
        );
        self.order.push_back((at, key.to_string()));
    }

    /// Forgets answers older than [`KEEP_FOR`].
    fn expire(&mut self, now: Instant) {
        while let Some((at, _)) = self.order.front() {
            if now.duration_since(*at) < KEEP_FOR {
                break;
            }
            let (at, key) = self.order.pop_front().expect("front exists");
            // A key used again since has a newer entry: only its own goes.
            if self.entries.get(&key).is_some_and(|e| e.at == at) {
                self.entries.remove(&key);
            }
        }
    }

    fn forget(&mut self, key: &str, outcome: &watch::Sender<Outcome>) {
        if self
            .entries
            .get(key)
            .is_some_and(|e| e.outcome.same_channel(&outcome.subscribe()))
        {
            self.entries.remove(key);
        }
    }
}

impl Claim {
    /// Records the request's answer: a success (2xx) is replayed to retries; anything else
    /// frees the key.
    pub fn finish(mut self, answer: Answer) {
        self.finished = true;
        if answer.status.is_success() {
            let _ = self.tx.send(Some(Some(answer)));
        } else {
            self.fail();
        }
    }

    fn fail(&self) {
        if let Some(t) = self.table.upgrade() {
            t.lock().forget(&self.key, &self.tx);
        }
        let _ = self.tx.send(Some(None));
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if !self.finished {
            self.fail();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(body: &str) -> Answer {
        Answer {
            status: StatusCode::CREATED,
            body: Bytes::from(body.to_string()),
        }
    }

    #[tokio::test]
    async fn a_retry_gets_the_first_answer_and_another_body_is_refused() {
        let idem = Idempotency::default();
        let Begin::Run(claim) = idem.begin("k1", br#"{"a":1,"b":2}"#).await.unwrap() else {
            panic!("the first request runs");
        };
        claim.finish(ok("first"));
        // The same body with other key order and spacing is the same request.
        match idem.begin("k1", br#"{ "b":2, "a":1 }"#).await.unwrap() {
            Begin::Replay(a) => assert_eq!(a, ok("first")),
            Begin::Run(_) => panic!("a retry must not run again"),
        }
        assert!(matches!(
            idem.begin("k1", br#"{"a":2}"#).await,
            Err(KeyError::Mismatch)
        ));
        assert!(matches!(
            idem.begin("", b"{}").await,
            Err(KeyError::Invalid)
        ));
        assert!(matches!(
            idem.begin("a b", b"{}").await,
            Err(KeyError::Invalid)
        ));
        assert!(matches!(
            idem.begin(&"k".repeat(MAX_KEY_LEN + 1), b"{}").await,
            Err(KeyError::Invalid)
        ));
    }

    #[tokio::test]
    async fn a_retry_waits_for_the_first_and_a_failure_frees_the_key() {
        let idem = std::sync::Arc::new(Idempotency::default());
        let Begin::Run(claim) = idem.begin("k", b"{}").await.unwrap() else {
            panic!("runs");
        };
        let waiter = {
            let idem = idem.clone();
            tokio::spawn(async move { idem.begin("k", b"{}").await })
        };
        tokio::task::yield_now().await;
        assert!(
            !waiter.is_finished(),
            "the retry waits while the first runs"
        );
        claim.finish(Answer {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            body: Bytes::new(),
        });
        assert!(matches!(waiter.await.unwrap(), Err(KeyError::FirstFailed)));
        // Freed: the next request with the key runs.
        assert!(matches!(
            idem.begin("k", b"{}").await.unwrap(),
            Begin::Run(_)
        ));
    }

    #[tokio::test]
    async fn an_abandoned_claim_frees_the_key() {
        let idem = Idempotency::default();
        let claim = idem.begin("k", b"{}").await.unwrap();
        drop(claim);
        assert!(idem.is_empty());
        assert!(matches!(
            idem.begin("k", b"{}").await.unwrap(),
            Begin::Run(_)
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn answers_expire_and_the_table_is_bounded() {
        let idem = Idempotency::default();
        if let Begin::Run(c) = idem.begin("old", b"{}").await.unwrap() {
            c.finish(ok("x"));
        }
        tokio::time::advance(KEEP_FOR + Duration::from_secs(1)).await;
        assert!(matches!(
            idem.begin("old", b"{}").await.unwrap(),
            Begin::Run(_)
        ));
        for i in 0..MAX_KEYS + 5 {
            if let Begin::Run(c) = idem.begin(&format!("k{i}"), b"{}").await.unwrap() {
                c.finish(ok("x"));
            }
        }
        assert_eq!(idem.len(), MAX_KEYS);
    }
}

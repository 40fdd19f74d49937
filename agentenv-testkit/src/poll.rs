//! Polling with a deadline: a check runs until it passes or the time is up, and a test
//! that times out fails with what it waited for and what the check saw last.

use std::fmt::Display;
use std::future::Future;
use std::time::{Duration, Instant};

/// What a check returns: passed (with a value) or not yet (with what it saw).
///
/// `bool` passes when `true`; `Option<T>` when `Some` (yielding the `T`);
/// `Result<T, E>` when `Ok` (yielding the `T`; the `Err` is the observation reported on a
/// timeout).
pub trait Check {
    /// What a passed check yields.
    type Ready;
    /// `Ok` when the check passed, else a description of what it saw.
    fn check(self) -> Result<Self::Ready, String>;
}

impl Check for bool {
    type Ready = ();
    fn check(self) -> Result<(), String> {
        if self { Ok(()) } else { Err("false".into()) }
    }
}

impl<T> Check for Option<T> {
    type Ready = T;
    fn check(self) -> Result<T, String> {
        self.ok_or_else(|| "None".into())
    }
}

impl<T, E: Display> Check for Result<T, E> {
    type Ready = T;
    fn check(self) -> Result<T, String> {
        self.map_err(|e| e.to_string())
    }
}

/// A bounded wait for something: what is awaited, for how long, how often it is checked.
#[derive(Debug, Clone)]
pub struct Wait {
    what: String,
    within: Duration,
    every: Duration,
}

/// Default pause between two checks.
const EVERY: Duration = Duration::from_millis(10);

impl Wait {
    /// Waits at most `within` for `what` (named in the timeout's message), checking every
    /// 10 ms.
    pub fn new(what: impl Display, within: Duration) -> Wait {
        Wait {
            what: what.to_string(),
            within,
            every: EVERY,
        }
    }

    /// Checks every `every` instead; zero yields to other threads or tasks between checks.
    pub fn every(mut self, every: Duration) -> Wait {
        self.every = every;
        self
    }

    fn timeout_message(&self, last: &str) -> String {
        format!(
            "timed out after {:?} waiting for {}; last observation: {last}",
            self.within, self.what
        )
    }

    /// Runs `check` until it passes; `Err(message)` when `within` passed first.
    pub async fn try_until<C, F, Fut>(&self, mut check: F) -> Result<C::Ready, String>
    where
        C: Check,
        F: FnMut() -> Fut,
        Fut: Future<Output = C>,
    {
        let deadline = tokio::time::Instant::now() + self.within;
        loop {
            let last = match check().await.check() {
                Ok(v) => return Ok(v),
                Err(last) => last,
            };
            if tokio::time::Instant::now() >= deadline {
                return Err(self.timeout_message(&last));
            }
            if self.every.is_zero() {
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep(self.every).await;
            }
        }
    }

    /// Runs `check` until it passes; panics with what was awaited and the last
    /// observation when `within` passed first.
    pub async fn until<C, F, Fut>(&self, check: F) -> C::Ready
    where
        C: Check,
        F: FnMut() -> Fut,
        Fut: Future<Output = C>,
    {
        self.try_until(check)
            .await
            .unwrap_or_else(|m| panic!("{m}"))
    }

    /// Like [`Wait::try_until`] for a blocking check, sleeping the thread between checks.
    pub fn try_until_blocking<C, F>(&self, mut check: F) -> Result<C::Ready, String>
    where
        C: Check,
        F: FnMut() -> C,
    {
        let deadline = Instant::now() + self.within;
        loop {
            let last = match check().check() {
                Ok(v) => return Ok(v),
                Err(last) => last,
            };
            if Instant::now() >= deadline {
                return Err(self.timeout_message(&last));
            }
            if self.every.is_zero() {
                std::thread::yield_now();
            } else {
                std::thread::sleep(self.every);
            }
        }
    }

    /// Like [`Wait::until`] for a blocking check, sleeping the thread between checks.
    pub fn until_blocking<C, F>(&self, check: F) -> C::Ready
    where
        C: Check,
        F: FnMut() -> C,
    {
        self.try_until_blocking(check)
            .unwrap_or_else(|m| panic!("{m}"))
    }
}

/// Polls `check` every 10 ms until it passes and returns what it yields; panics naming
/// `what` and the last observation when `within` passes first.
pub async fn eventually<C, F, Fut>(what: impl Display, within: Duration, check: F) -> C::Ready
where
    C: Check,
    F: FnMut() -> Fut,
    Fut: Future<Output = C>,
{
    Wait::new(what, within).until(check).await
}

/// The blocking [`eventually`]: polls `check` every 10 ms on this thread.
pub fn eventually_blocking<C, F>(what: impl Display, within: Duration, check: F) -> C::Ready
where
    C: Check,
    F: FnMut() -> C,
{
    Wait::new(what, within).until_blocking(check)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blocking_wait_returns_what_the_check_yields() {
        let mut n = 0;
        let v = eventually_blocking("n to reach 3", Duration::from_secs(5), || {
            n += 1;
            (n >= 3).then_some(n)
        });
        assert_eq!(v, 3);
    }

    #[test]
    fn a_timeout_names_what_was_awaited_and_the_last_observation() {
        let e = Wait::new("the answer", Duration::from_millis(30))
            .every(Duration::from_millis(5))
            .try_until_blocking(|| Err::<(), _>("41"))
            .unwrap_err();
        assert!(e.contains("waiting for the answer"), "{e}");
        assert!(e.contains("last observation: 41"), "{e}");
    }

    #[tokio::test]
    async fn an_async_wait_polls_until_true() {
        let mut n = 0;
        eventually("three checks", Duration::from_secs(5), || {
            n += 1;
            let done = n >= 3;
            async move { done }
        })
        .await;
        assert_eq!(n, 3);
    }
}

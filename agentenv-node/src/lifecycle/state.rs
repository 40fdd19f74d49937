//! The states of a sandbox and the one table of how operations move between them.
//!
//! Every operation asks [`next`] before it changes a sandbox: the table says which state
//! the sandbox goes to, or why the operation is refused. Multi-step operations (create,
//! pause, resume, snapshot, delete) move to a state that says what is in progress,
//! and end with [`Op::Done`] on success or back in the state they started from on
//! failure.

use serde::{Deserialize, Serialize};

/// Internal states of a sandbox (a paused sandbox's record on disk names its state).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    /// A create is starting the sandbox (every sandbox begins here).
    Creating,
    Resuming,
    Running,
    /// Captured for a snapshot or forks (jail: frozen while its layer is copied).
    Snapshotting,
    Pausing,
    Paused,
    /// Paused, its files published for another node that takes it over (a move): it
    /// is not resumed here unless the move is cancelled.
    Moving,
    /// Being deleted: to every operation the sandbox is gone.
    Killing,
}

impl State {
    /// Every state, for tests and tables.
    pub const ALL: [State; 8] = [
        State::Creating,
        State::Resuming,
        State::Running,
        State::Snapshotting,
        State::Pausing,
        State::Paused,
        State::Moving,
        State::Killing,
    ];

    /// The state the API shows: `running` or `paused`.
    pub fn api_name(self) -> &'static str {
        match self {
            State::Pausing | State::Paused | State::Snapshotting | State::Moving => "paused",
            _ => "running",
        }
    }
}

/// What is done to a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// The step in progress succeeded: a create's or a resume's agent is ready, a pause
    /// is recorded, a capture is over.
    Done,
    /// `POST /pause`, a timeout with auto-pause, shutdown (a paused sandbox: nothing to do).
    Pause,
    /// `POST /resume` (a running sandbox only gets its timeout set).
    Resume,
    /// `POST /connect` (a running sandbox only gets its timeout extended).
    Connect,
    /// `POST /timeout`.
    SetTimeout,
    /// `POST /refreshes`.
    Refresh,
    /// The timeout passed: the sandbox is paused or killed (its `on_timeout`).
    Expire,
    /// `POST /snapshots`: the sandbox is captured and keeps running.
    Snapshot,
    /// `POST /fork`: the sandbox is captured for its forks and keeps running.
    Fork,
    /// `DELETE`, a timeout with kill.
    Kill,
    /// Shutdown keeps a paused sandbox's state (jail: its writable layer) for the next start.
    Keep,
    /// A paused sandbox's record is loaded at start.
    Restore,
    /// `PUT /network`: the egress rules are replaced (a paused sandbox gets them on resume).
    SetNetwork,
    /// `POST /export`: a paused sandbox's files are published for another node (a move).
    Move,
    /// `DELETE /export`: the move did not happen; the sandbox stays here, paused.
    CancelMove,
}

impl Op {
    /// Every operation, for tests and tables.
    pub const ALL: [Op; 15] = [
        Op::Done,
        Op::Pause,
        Op::Resume,
        Op::Connect,
        Op::SetTimeout,
        Op::Refresh,
        Op::Expire,
        Op::Snapshot,
        Op::Fork,
        Op::Kill,
        Op::Keep,
        Op::Restore,
        Op::SetNetwork,
        Op::Move,
        Op::CancelMove,
    ];

    /// The operation as errors name it.
    pub fn name(self) -> &'static str {
        match self {
            Op::Done => "finishing a step",
            Op::Pause => "pause",
            Op::Resume => "resume",
            Op::Connect => "connect",
            Op::SetTimeout => "setting the timeout",
            Op::Refresh => "refresh",
            Op::Expire => "the timeout",
            Op::Snapshot => "snapshot",
            Op::Fork => "fork",
            Op::Kill => "delete",
            Op::Keep => "keeping its state",
            Op::Restore => "restoring",
            Op::SetNetwork => "updating the network",
            Op::Move => "moving it to another node",
            Op::CancelMove => "cancelling a move",
        }
    }

    /// The states the operation needs, as errors name them.
    pub fn needs(self) -> &'static str {
        match self {
            Op::Done => "creating, resuming, pausing or snapshotting",
            Op::Connect | Op::SetNetwork => "running or paused",
            Op::Resume | Op::Keep | Op::Move => "paused",
            Op::CancelMove => "being moved",
            Op::Kill | Op::Restore => "anything",
            Op::Pause | Op::SetTimeout | Op::Refresh | Op::Expire | Op::Snapshot | Op::Fork => {
                "running"
            }
        }
    }
}

/// Why [`next`] refuses an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TransitionError {
    /// The sandbox is being deleted (the API answers 404).
    #[error("the sandbox is being deleted")]
    Gone,
    /// The operation needs another state (the API answers 409).
    #[error("the sandbox is {state:?}; {} needs it {}", op.name(), op.needs())]
    Invalid { state: State, op: Op },
}

/// The state `op` moves a sandbox in `state` to.
pub fn next(state: State, op: Op) -> Result<State, TransitionError> {
    use State::*;
    Ok(match (op, state) {
        // A record on disk is a paused sandbox, whatever it was saved as.
        (Op::Restore, _) => Paused,
        (_, Killing) => return Err(TransitionError::Gone),
        (Op::Kill, _) => Killing,
        (Op::Done, Creating | Resuming | Snapshotting) => Running,
        (Op::Done, Pausing) => Paused,
        (Op::Pause, Running) => Pausing,
        (Op::Pause | Op::Keep, Paused) => Paused,
        (Op::Resume | Op::Connect, Paused) => Resuming,
        (Op::Resume | Op::Connect | Op::SetTimeout | Op::Refresh | Op::Expire, Running) => Running,
        (Op::Snapshot | Op::Fork, Running) => Snapshotting,
        (Op::SetNetwork, Running) => Running,
        (Op::SetNetwork, Paused) => Paused,
        (Op::Move, Paused) => Moving,
        (Op::CancelMove, Moving) => Paused,
        _ => return Err(TransitionError::Invalid { state, op }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use State::*;

    /// The whole table, written out: every pair not listed is refused.
    const ALLOWED: &[(State, Op, State)] = &[
        (Creating, Op::Done, Running),
        (Resuming, Op::Done, Running),
        (Snapshotting, Op::Done, Running),
        (Pausing, Op::Done, Paused),
        (Running, Op::Pause, Pausing),
        (Paused, Op::Pause, Paused),
        (Paused, Op::Resume, Resuming),
        (Running, Op::Resume, Running),
        (Paused, Op::Connect, Resuming),
        (Running, Op::Connect, Running),
        (Running, Op::SetTimeout, Running),
        (Running, Op::Refresh, Running),
        (Running, Op::Expire, Running),
        (Running, Op::Snapshot, Snapshotting),
        (Running, Op::Fork, Snapshotting),
        (Creating, Op::Kill, Killing),
        (Resuming, Op::Kill, Killing),
        (Running, Op::Kill, Killing),
        (Snapshotting, Op::Kill, Killing),
        (Pausing, Op::Kill, Killing),
        (Paused, Op::Kill, Killing),
        (Paused, Op::Keep, Paused),
        (Creating, Op::Restore, Paused),
        (Resuming, Op::Restore, Paused),
        (Running, Op::Restore, Paused),
        (Snapshotting, Op::Restore, Paused),
        (Pausing, Op::Restore, Paused),
        (Paused, Op::Restore, Paused),
        (Killing, Op::Restore, Paused),
        (Running, Op::SetNetwork, Running),
        (Paused, Op::SetNetwork, Paused),
        (Paused, Op::Move, Moving),
        (Moving, Op::CancelMove, Paused),
        (Moving, Op::Kill, Killing),
        (Moving, Op::Restore, Paused),
    ];

    #[test]
    fn every_state_and_operation_follows_the_table() {
        for state in State::ALL {
            for op in Op::ALL {
                let allowed = ALLOWED
                    .iter()
                    .find(|(s, o, _)| *s == state && *o == op)
                    .map(|(_, _, to)| *to);
                let got = next(state, op);
                match allowed {
                    Some(to) => assert_eq!(got, Ok(to), "{state:?} × {op:?}"),
                    None if state == Killing => {
                        assert_eq!(got, Err(TransitionError::Gone), "{state:?} × {op:?}")
                    }
                    None => assert_eq!(
                        got,
                        Err(TransitionError::Invalid { state, op }),
                        "{state:?} × {op:?}"
                    ),
                }
            }
        }
    }

    #[test]
    fn refusals_name_the_state_and_what_the_operation_needs() {
        let cases = [
            (
                Paused,
                Op::SetTimeout,
                "setting the timeout needs it running",
            ),
            (Pausing, Op::Refresh, "refresh needs it running"),
            (Creating, Op::Pause, "pause needs it running"),
            (Resuming, Op::Resume, "resume needs it paused"),
            (
                Snapshotting,
                Op::Connect,
                "connect needs it running or paused",
            ),
            (Paused, Op::Snapshot, "snapshot needs it running"),
            (Paused, Op::Fork, "fork needs it running"),
            (Moving, Op::Resume, "resume needs it paused"),
            (
                Running,
                Op::Move,
                "moving it to another node needs it paused",
            ),
        ];
        for (state, op, needs) in cases {
            let e = next(state, op).unwrap_err();
            assert_eq!(e.to_string(), format!("the sandbox is {state:?}; {needs}"));
        }
    }

    #[test]
    fn the_api_shows_running_or_paused() {
        let paused: Vec<State> = State::ALL
            .into_iter()
            .filter(|s| s.api_name() == "paused")
            .collect();
        assert_eq!(paused, [Snapshotting, Pausing, Paused, Moving]);
        assert!(
            State::ALL
                .iter()
                .all(|s| ["running", "paused"].contains(&s.api_name()))
        );
    }
}

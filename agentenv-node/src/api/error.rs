//! Errors as responses: every lifecycle, snapshot and input error's status and message.

use http::{Response, StatusCode};

use crate::backend::BackendError;
use crate::dataplane::{Body, json_error};
use crate::ids::InvalidSandboxId;
use crate::lifecycle::LifecycleError;
use crate::snapshot::SnapshotError;
use crate::template::catalog::CatalogError;
use crate::volume::VolumeError;

/// The response that ends a handler early: an error.
pub(super) struct Reject(Box<Response<Body>>);

impl Reject {
    pub(super) fn into_response(self) -> Response<Body> {
        *self.0
    }
}

impl From<Response<Body>> for Reject {
    fn from(r: Response<Body>) -> Self {
        Reject(Box::new(r))
    }
}

/// What a handler answers.
pub(super) type Reply = Result<Response<Body>, Reject>;

/// A 400 with `message`.
pub(super) fn bad_request(message: impl Into<String>) -> Reject {
    json_error(StatusCode::BAD_REQUEST, message).into()
}

impl From<LifecycleError> for Reject {
    fn from(e: LifecycleError) -> Self {
        lifecycle_error(e).into()
    }
}

impl From<SnapshotError> for Reject {
    fn from(e: SnapshotError) -> Self {
        LifecycleError::from(e).into()
    }
}

/// No sandbox has an id that is not a UUID: 404, as for any unknown sandbox (the
/// gateway answers the same).
impl From<InvalidSandboxId> for Reject {
    fn from(e: InvalidSandboxId) -> Self {
        json_error(StatusCode::NOT_FOUND, e.to_string()).into()
    }
}

impl From<Box<Response<Body>>> for Reject {
    fn from(r: Box<Response<Body>>) -> Self {
        Reject(r)
    }
}

/// The response to a lifecycle error.
fn lifecycle_error(e: LifecycleError) -> Response<Body> {
    let (status, message) = lifecycle_error_parts(e);
    json_error(status, message)
}

/// The status and message of a lifecycle error.
pub(super) fn lifecycle_error_parts(e: LifecycleError) -> (StatusCode, String) {
    let status = match &e {
        LifecycleError::NotFound(_) => StatusCode::NOT_FOUND,
        LifecycleError::InvalidState { .. } => StatusCode::CONFLICT,
        LifecycleError::ShuttingDown | LifecycleError::Unavailable(_) => {
            StatusCode::SERVICE_UNAVAILABLE
        }
        LifecycleError::BadRequest(_) => StatusCode::BAD_REQUEST,
        LifecycleError::Conflict(_) => StatusCode::CONFLICT,
        LifecycleError::Catalog(c) => catalog_status(c),
        LifecycleError::Backend(b) => match b {
            BackendError::UnknownTemplate(n) => {
                return (StatusCode::BAD_REQUEST, format!("template {n} not found"));
            }
            BackendError::InvalidLimits(_)
            | BackendError::InvalidId(_)
            | BackendError::BadVolumeMount(_) => StatusCode::BAD_REQUEST,
            BackendError::NotFound(_) => StatusCode::NOT_FOUND,
            BackendError::AddressPoolExhausted { .. } | BackendError::IdPoolExhausted { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            // What this node's backend cannot do (a fork on a microVM node): not the
            // client's mistake, nor a failure of the node.
            BackendError::Unsupported { .. } => StatusCode::NOT_IMPLEMENTED,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        },
        LifecycleError::Agent { .. } | LifecycleError::Persist(_) | LifecycleError::Internal(_) => {
            StatusCode::INTERNAL_SERVER_ERROR
        }
        LifecycleError::Snapshot(s) => snapshot_status(s),
        LifecycleError::Volume(v) => volume_status(v),
        LifecycleError::NoSnapshotRepository => StatusCode::SERVICE_UNAVAILABLE,
    };
    (status, e.to_string())
}

impl From<CatalogError> for Reject {
    fn from(e: CatalogError) -> Self {
        json_error(catalog_status(&e), e.to_string()).into()
    }
}

fn catalog_status(e: &CatalogError) -> StatusCode {
    match e {
        CatalogError::InvalidName(_) | CatalogError::InvalidTag(_) => StatusCode::BAD_REQUEST,
        CatalogError::NameTaken { .. } => StatusCode::CONFLICT,
        CatalogError::NotFound(_) | CatalogError::BuildNotFound { .. } => StatusCode::NOT_FOUND,
        CatalogError::Forged { .. } | CatalogError::Corrupt { .. } | CatalogError::Storage(_) => {
            StatusCode::INTERNAL_SERVER_ERROR
        }
    }
}

impl From<VolumeError> for Reject {
    fn from(e: VolumeError) -> Self {
        json_error(volume_status(&e), e.to_string()).into()
    }
}

/// The status of a volume error: what the client named wrong is a 4xx.
pub(super) fn volume_status(e: &VolumeError) -> StatusCode {
    match e {
        VolumeError::InvalidName(_) | VolumeError::UnknownName(_) => StatusCode::BAD_REQUEST,
        VolumeError::NotFound(_) => StatusCode::NOT_FOUND,
        VolumeError::NameTaken { .. } | VolumeError::InUse { .. } => StatusCode::CONFLICT,
        VolumeError::TooManyFiles { .. }
        | VolumeError::Forged { .. }
        | VolumeError::Corrupt { .. }
        | VolumeError::Storage(_)
        | VolumeError::Files(_)
        | VolumeError::Io { .. } => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

fn snapshot_status(e: &SnapshotError) -> StatusCode {
    match e {
        SnapshotError::InvalidName(_)
        | SnapshotError::ReservedName(_)
        | SnapshotError::AliasConflict { .. }
        | SnapshotError::WrongBackend { .. } => StatusCode::BAD_REQUEST,
        SnapshotError::NotFound(_) => StatusCode::NOT_FOUND,
        SnapshotError::Corrupt { .. }
        | SnapshotError::Forged { .. }
        | SnapshotError::Storage(_)
        | SnapshotError::Io { .. } => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;
    use crate::lifecycle::{Op, State, TransitionError, next};

    async fn answer(r: Reject) -> (StatusCode, String) {
        let r = r.into_response();
        let status = r.status();
        let body = r.into_body().collect().await.unwrap().to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        (status, v["message"].as_str().unwrap().to_string())
    }

    /// What the API answered for each refusal of the state table before it was one table.
    #[tokio::test]
    async fn every_refused_transition_answers_as_before() {
        let id = "01936f8e-72f5-7000-8000-000000000001";
        for state in State::ALL {
            for op in Op::ALL {
                let Err(e) = next(state, op) else { continue };
                let (status, message) = answer(e.for_sandbox(id).into()).await;
                match e {
                    TransitionError::Gone => {
                        assert_eq!(status, StatusCode::NOT_FOUND, "{state:?} × {op:?}");
                        assert_eq!(message, format!("sandbox {id} not found"));
                    }
                    TransitionError::Invalid { .. } => {
                        assert_eq!(status, StatusCode::CONFLICT, "{state:?} × {op:?}");
                        assert_eq!(
                            message,
                            format!(
                                "sandbox {id} is {state:?}; {} needs it {}",
                                op.name(),
                                op.needs()
                            )
                        );
                    }
                }
            }
        }
        let (status, message) = answer(
            next(State::Paused, Op::Refresh)
                .unwrap_err()
                .for_sandbox(id)
                .into(),
        )
        .await;
        assert_eq!(status, StatusCode::CONFLICT);
        assert_eq!(
            message,
            format!("sandbox {id} is Paused; refresh needs it running")
        );
    }

    #[tokio::test]
    async fn what_the_backend_cannot_do_is_not_implemented_and_says_where_to_go() {
        let e = LifecycleError::Backend(BackendError::Unsupported {
            backend: crate::config::BackendKind::Microvm,
            op: "fork a sandbox",
            hint: "fork sandboxes on a node with the jail backend",
        });
        let (status, message) = answer(e.into()).await;
        assert_eq!(status, StatusCode::NOT_IMPLEMENTED);
        assert_eq!(
            message,
            "the microvm backend cannot fork a sandbox: fork sandboxes on a node with the jail backend"
        );
    }
}

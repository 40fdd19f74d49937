//! The scheduler's side of the cluster credential: every call of
//! `scheduler.v1.Scheduler` must carry it (see
//! [`agentenv_core::cluster_auth`]), except the read-only lookups when the
//! operator opened them (`scheduler.open_lookups`). A call without it is
//! answered `UNAUTHENTICATED` before the service sees it, so it changes
//! nothing. The gRPC health service stays open.

use std::task::{Context, Poll};

use agentenv_core::cluster_auth::{ClusterToken, METADATA_KEY};
use tonic::server::NamedService;

/// Read-only calls that `open_lookups` leaves open.
pub const LOOKUP_CALLS: [&str; 5] = [
    "Schedule",
    "LookupNode",
    "ListNodes",
    "GetNode",
    "ListObservedNodes",
];

/// Who may call the scheduler.
#[derive(Clone, Debug, Default)]
pub struct ClusterAuth {
    /// The credential every call must carry; `None`: calls are not checked
    /// (only on loopback or with `insecure_no_auth`, see the config).
    pub token: Option<ClusterToken>,
    /// The calls of [`LOOKUP_CALLS`] are answered without the credential.
    pub open_lookups: bool,
}

impl ClusterAuth {
    /// `Err` with the status to answer when a call to `path`
    /// (`/scheduler.v1.Scheduler/<Method>`) with `authorization` metadata
    /// `value` is refused.
    pub fn check(&self, path: &str, value: Option<&[u8]>) -> Result<(), tonic::Status> {
        let Some(token) = &self.token else {
            return Ok(());
        };
        let method = path.rsplit('/').next().unwrap_or("");
        if self.open_lookups && LOOKUP_CALLS.contains(&method) {
            return Ok(());
        }
        match value {
            Some(v) if token.verify(v) => Ok(()),
            Some(_) => Err(tonic::Status::unauthenticated(
                "wrong cluster credential: the token in cluster_token_file (AENV_CLUSTER_TOKEN_FILE on nodes) differs from the scheduler's",
            )),
            None => Err(tonic::Status::unauthenticated(
                "missing cluster credential: this scheduler needs the cluster token; set cluster_token_file in the gateway's config (AENV_CLUSTER_TOKEN_FILE on nodes) to the scheduler's token file",
            )),
        }
    }
}

/// A gRPC service wrapped in the credential check.
#[derive(Clone)]
pub struct Authenticated<S> {
    inner: S,
    auth: ClusterAuth,
}

impl<S> Authenticated<S> {
    pub fn new(inner: S, auth: ClusterAuth) -> Self {
        Self { inner, auth }
    }
}

impl<S: NamedService> NamedService for Authenticated<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B> tonic::codegen::Service<http::Request<B>> for Authenticated<S>
where
    S: tonic::codegen::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future =
        futures::future::Either<S::Future, std::future::Ready<Result<Self::Response, Self::Error>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let value = req.headers().get(METADATA_KEY).map(|v| v.as_bytes());
        match self.auth.check(req.uri().path(), value) {
            Ok(()) => futures::future::Either::Left(self.inner.call(req)),
            Err(status) => {
                tracing::warn!(
                    call = %req.uri().path(),
                    reason = status.message(),
                    "refused a scheduler call without a valid cluster credential"
                );
                futures::future::Either::Right(std::future::ready(Ok(status.into_http())))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "0123456789abcdef0123456789abcdef";

    fn auth(open_lookups: bool) -> ClusterAuth {
        ClusterAuth {
            token: Some(ClusterToken::new(TOKEN, "test").unwrap()),
            open_lookups,
        }
    }

    #[test]
    fn every_call_needs_the_token_unless_lookups_are_opened() {
        let bearer = format!("Bearer {TOKEN}");
        let hb = "/scheduler.v1.Scheduler/Heartbeat";
        let lookup = "/scheduler.v1.Scheduler/LookupNode";
        let a = auth(false);
        assert_eq!(
            a.check(hb, None).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
        assert_eq!(
            a.check(hb, Some(b"Bearer nope")).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
        assert!(a.check(hb, Some(bearer.as_bytes())).is_ok());
        assert!(a.check(lookup, None).is_err());
        let open = auth(true);
        assert!(open.check(lookup, None).is_ok());
        assert!(open.check("/scheduler.v1.Scheduler/Schedule", None).is_ok());
        assert!(open.check(hb, None).is_err());
        assert!(
            open.check("/scheduler.v1.Scheduler/RecordAssignment", None)
                .is_err()
        );
        assert!(ClusterAuth::default().check(hb, None).is_ok());
    }
}

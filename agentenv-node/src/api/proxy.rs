//! The data plane's side of the API: finding (or auto-resuming) the sandbox of a
//! data-plane request, checking its access rules and relaying the request.

use http::{Request, Response, StatusCode};
use hyper::body::Incoming;

use super::ApiState;
use crate::dataplane::{self, Access, Body, Relay, Target, check_access, json_error, status_only};
use crate::lifecycle::RouteError;

/// The answer for a sandbox that does not exist (any more).
fn gone(id: &str) -> Response<Body> {
    json_error(
        StatusCode::BAD_GATEWAY,
        format!("The sandbox {id} was not found"),
    )
}

/// Relays a data-plane request to its sandbox.
pub(super) async fn proxy(
    state: &ApiState,
    req: Request<Incoming>,
    target: Target,
) -> Response<Body> {
    let rec = match state.orch.route(&target.sandbox_id).await {
        Ok(r) => r,
        Err(RouteError::NotFound) => return gone(&target.sandbox_id),
        Err(RouteError::NotProxyable) => {
            return json_error(
                StatusCode::GONE,
                format!(
                    "sandbox {} is paused and auto-resume is off: connect to it (POST /sandboxes/{}/connect) first",
                    target.sandbox_id, target.sandbox_id
                ),
            );
        }
        Err(RouteError::ResumeTimedOut) => {
            return json_error(StatusCode::GATEWAY_TIMEOUT, "sandbox auto-resume timed out");
        }
        Err(e @ RouteError::ResumeFailed(_)) => {
            return json_error(StatusCode::BAD_GATEWAY, e.to_string());
        }
    };
    let keep_access_token = match check_access(&rec, &target, req.headers(), state.orch.tokens()) {
        Access::Allowed { keep_access_token } => keep_access_token,
        Access::Denied => return status_only(StatusCode::UNAUTHORIZED),
        Access::NodeOnly => {
            return json_error(
                StatusCode::FORBIDDEN,
                format!(
                    "{} is answered to the node only: the node initialises the agent itself",
                    target.path_and_query
                ),
            );
        }
    };
    let Some(addr) = rec.address else {
        return json_error(
            StatusCode::BAD_GATEWAY,
            "sandbox route is temporarily unavailable",
        );
    };
    let relay = Relay {
        upstream: addr.port(target.port),
        timeouts: state.relay_timeouts,
        target: &target,
        keep_access_token,
        api_key: &state.api_key,
        pool: &state.sandbox_pool,
    };
    match dataplane::relay(req, relay).await {
        Ok(r) => r,
        Err(dataplane::ProxyError::Connect { .. }) => {
            // A sandbox deleted while the request was in flight is gone, not closed.
            if state.orch.get(&target.sandbox_id).is_err() {
                return gone(&target.sandbox_id);
            }
            json_error(
                StatusCode::BAD_GATEWAY,
                format!(
                    "The sandbox {} is running but port {} is not open",
                    target.sandbox_id, target.port
                ),
            )
        }
        Err(e @ dataplane::ProxyError::HeaderTimeout(_)) => {
            json_error(StatusCode::GATEWAY_TIMEOUT, e.to_string())
        }
        Err(e) => json_error(StatusCode::BAD_GATEWAY, e.to_string()),
    }
}

//! Connect error codes, their HTTP statuses, and the error a call fails with.

use http::{HeaderValue, Response, StatusCode, header};

use super::body::{RespBody, full};

/// Connect error codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Code {
    Canceled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    OutOfRange,
    Unimplemented,
    Internal,
    Unavailable,
    DataLoss,
    Unauthenticated,
}

impl Code {
    /// The code's wire name (`"not_found"`).
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::Unknown => "unknown",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Aborted => "aborted",
            Code::OutOfRange => "out_of_range",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::DataLoss => "data_loss",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// Parses a wire name; unknown names give [`Code::Unknown`].
    pub fn parse(s: &str) -> Code {
        match s {
            "canceled" => Code::Canceled,
            "invalid_argument" => Code::InvalidArgument,
            "deadline_exceeded" => Code::DeadlineExceeded,
            "not_found" => Code::NotFound,
            "already_exists" => Code::AlreadyExists,
            "permission_denied" => Code::PermissionDenied,
            "resource_exhausted" => Code::ResourceExhausted,
            "failed_precondition" => Code::FailedPrecondition,
            "aborted" => Code::Aborted,
            "out_of_range" => Code::OutOfRange,
            "unimplemented" => Code::Unimplemented,
            "internal" => Code::Internal,
            "unavailable" => Code::Unavailable,
            "data_loss" => Code::DataLoss,
            "unauthenticated" => Code::Unauthenticated,
            _ => Code::Unknown,
        }
    }

    /// The HTTP status a unary error with this code is sent with.
    pub fn http_status(self) -> StatusCode {
        match self {
            Code::Canceled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            Code::Unknown | Code::Internal | Code::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
            Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => {
                StatusCode::BAD_REQUEST
            }
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }

    /// The code a client infers from an HTTP status without a Connect body.
    pub fn from_http_status(status: StatusCode) -> Code {
        match status.as_u16() {
            400 => Code::InvalidArgument,
            401 => Code::Unauthenticated,
            403 => Code::PermissionDenied,
            404 => Code::NotFound,
            408 => Code::DeadlineExceeded,
            409 => Code::Aborted,
            415 => Code::Internal,
            429 | 502 | 503 => Code::Unavailable,
            504 => Code::DeadlineExceeded,
            _ => Code::Unknown,
        }
    }
}

impl std::fmt::Display for Code {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A Connect error: a code and a message for the client.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ConnectError {
    pub code: Code,
    pub message: String,
}

impl ConnectError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        ConnectError {
            code,
            message: message.into(),
        }
    }
    pub fn invalid_argument(message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(Code::NotFound, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Code::Internal, message)
    }

    /// Maps an I/O error on `what` to the closest code.
    pub fn from_io(err: &std::io::Error, what: &str) -> Self {
        use std::io::ErrorKind as K;
        let code = match err.kind() {
            K::NotFound => Code::NotFound,
            K::PermissionDenied => Code::PermissionDenied,
            K::AlreadyExists => Code::AlreadyExists,
            K::InvalidInput | K::NotADirectory | K::IsADirectory | K::DirectoryNotEmpty => {
                Code::InvalidArgument
            }
            K::StorageFull | K::QuotaExceeded => Code::ResourceExhausted,
            _ => Code::Internal,
        };
        Self::new(code, format!("{what}: {err}"))
    }

    /// The JSON body of a unary error: `{"code":"...","message":"..."}`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({"code": self.code.as_str(), "message": self.message})
    }

    /// Parses a Connect error JSON body; `None` if it is not one.
    pub fn from_json(body: &[u8]) -> Option<ConnectError> {
        let v: serde_json::Value = serde_json::from_slice(body).ok()?;
        let code = v.get("code")?.as_str()?;
        let message = v
            .get("message")
            .and_then(|m| m.as_str())
            .unwrap_or_default();
        Some(ConnectError::new(Code::parse(code), message))
    }

    /// The unary error response.
    pub fn into_unary_response(self) -> Response<RespBody> {
        let body = serde_json::to_vec(&self.to_json()).unwrap_or_default();
        let mut resp = Response::new(full(body));
        *resp.status_mut() = self.code.http_status();
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_map_to_connect_http_statuses() {
        assert_eq!(Code::NotFound.http_status(), 404);
        assert_eq!(Code::Unauthenticated.http_status(), 401);
        assert_eq!(Code::DeadlineExceeded.http_status(), 504);
        assert_eq!(Code::Canceled.http_status().as_u16(), 499);
        assert_eq!(Code::ResourceExhausted.http_status(), 429);
        for c in [Code::NotFound, Code::DataLoss, Code::Aborted] {
            assert_eq!(Code::parse(c.as_str()), c);
        }
    }
}

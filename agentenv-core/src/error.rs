//! The JSON error body that the gateway and the nodes answer with:
//! `{"code": <status>, "message": "..."}`, and where a client acts on the kind of error,
//! a machine-readable `error_code` (as the E2B API names them).

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub code: u16,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_code: Option<String>,
}

impl ErrorBody {
    pub fn new(code: u16, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            error_code: None,
        }
    }

    /// The body with the machine-readable `error_code` (e.g. `idempotency_request_mismatch`).
    pub fn with_error_code(mut self, error_code: impl Into<String>) -> Self {
        self.error_code = Some(error_code.into());
        self
    }

    /// The serialized body.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("error body serializes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serializes_code_and_message() {
        let b = ErrorBody::new(503, "no nodes available");
        assert_eq!(
            b.to_json(),
            r#"{"code":503,"message":"no nodes available"}"#
        );
        let b = ErrorBody::new(409, "in use").with_error_code("idempotency_in_progress");
        assert_eq!(
            b.to_json(),
            r#"{"code":409,"message":"in use","error_code":"idempotency_in_progress"}"#
        );
    }
}

//! The JSON error body that the gateway and the nodes answer with:
//! `{"code": <status>, "message": "..."}`.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub code: u16,
    pub message: String,
}

impl ErrorBody {
    pub fn new(code: u16, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
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
    }
}

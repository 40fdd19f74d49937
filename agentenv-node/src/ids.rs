//! Sandbox ids: hyphenated UUIDs (v7 when this node makes them), written lowercase.
//!
//! The API, the data plane, the lifecycle and the snapshot repository all check and make
//! ids here, so none of them imports another for it.

/// A string that is not a sandbox id; the message is what the API answers (404: no
/// sandbox has it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("sandbox {0:?} not found: sandbox ids are UUIDs")]
pub struct InvalidSandboxId(pub String);

/// Whether `s` is a hyphenated UUID (in either case).
pub fn is_uuid(s: &str) -> bool {
    s.len() == 36 && uuid::Uuid::try_parse(s).is_ok()
}

/// Checks that `s` is a sandbox id and returns it lowercase.
pub fn parse_sandbox_id(s: &str) -> Result<String, InvalidSandboxId> {
    if is_uuid(s) {
        Ok(s.to_ascii_lowercase())
    } else {
        Err(InvalidSandboxId(s.to_string()))
    }
}

/// A new sandbox id (a UUIDv7: ids sort by creation time).
pub fn new_sandbox_id() -> String {
    uuid::Uuid::now_v7().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_hyphenated_uuids_in_either_case() {
        let id = "01936F8E-72F5-7000-8000-000000000001";
        assert!(is_uuid(id));
        assert_eq!(parse_sandbox_id(id).unwrap(), id.to_ascii_lowercase());
        // The simple (unhyphenated) form is a UUID to the parser, not an id here.
        assert!(!is_uuid("01936f8e72f570008000000000000001"));
        assert!(!is_uuid("base"));
        assert_eq!(
            parse_sandbox_id("nope").unwrap_err().to_string(),
            "sandbox \"nope\" not found: sandbox ids are UUIDs"
        );
        let new = new_sandbox_id();
        assert!(is_uuid(&new));
        assert_eq!(new, new.to_ascii_lowercase());
    }
}

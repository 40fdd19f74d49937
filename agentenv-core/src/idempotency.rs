//! The sandbox id of an idempotent create: derived from its `Idempotency-Key`, so that
//! every gateway routes a retry to the node that has (or is making) the first request's
//! sandbox: the id's scheduler binding exists from before the create is forwarded and is
//! kept by the node's heartbeats for as long as the sandbox lives. The node makes the
//! sandbox under the same id and answers a retry with it.

use sha2::{Digest, Sha256};

/// The header that carries the key.
pub const IDEMPOTENCY_KEY_HEADER: &str = "idempotency-key";

/// The sandbox id of a create with `Idempotency-Key: key`: a UUID (version 8, RFC 9562)
/// from the key's SHA-256, lowercase and hyphenated like every sandbox id.
pub fn sandbox_id(key: &str) -> String {
    let digest = Sha256::new()
        .chain_update(b"agentenv idempotent sandbox\0")
        .chain_update(key.as_bytes())
        .finalize();
    let mut b = [0u8; 16];
    b.copy_from_slice(&digest[..16]);
    // Version 8 (custom), variant RFC 9562.
    b[6] = (b[6] & 0x0f) | 0x80;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_stable_uuid_shaped_and_differ_per_key() {
        let a = sandbox_id("retry-me");
        assert_eq!(a, sandbox_id("retry-me"));
        assert_ne!(a, sandbox_id("retry-me-too"));
        assert_eq!(a.len(), 36);
        assert_eq!(a, a.to_ascii_lowercase());
        let parts: Vec<&str> = a.split('-').collect();
        assert_eq!(
            parts.iter().map(|p| p.len()).collect::<Vec<_>>(),
            [8, 4, 4, 4, 12]
        );
        assert!(parts[2].starts_with('8'), "version 8: {a}");
        assert!(
            matches!(&parts[3][..1], "8" | "9" | "a" | "b"),
            "variant: {a}"
        );
    }
}

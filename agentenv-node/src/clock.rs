//! Wall-clock time as the node's records and API write it: milliseconds since the Unix
//! epoch, and RFC 3339 in UTC with nanoseconds.
//!
//! (Timers and deadlines go through `tokio::time`; this is only for timestamps.)

use std::time::{Duration, SystemTime};

use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

/// Milliseconds from the epoch to `t` (0 before the epoch).
pub fn ms_since_epoch(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Milliseconds since the epoch, now.
pub fn now_ms() -> u64 {
    ms_since_epoch(SystemTime::now())
}

/// RFC 3339 UTC with nanoseconds.
pub fn time_rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    let dt = OffsetDateTime::from_unix_timestamp_nanos(d.as_nanos() as i128)
        .unwrap_or(OffsetDateTime::UNIX_EPOCH);
    dt.format(&Rfc3339).unwrap_or_default()
}

/// RFC 3339 of ms since the epoch.
pub fn ms_rfc3339(ms: u64) -> String {
    time_rfc3339(SystemTime::UNIX_EPOCH + Duration::from_millis(ms))
}

/// Ms since the epoch of an RFC 3339 time (`None` if it is not one).
pub fn rfc3339_ms(s: &str) -> Option<u64> {
    let dt = OffsetDateTime::parse(s, &Rfc3339).ok()?;
    Some((dt.unix_timestamp_nanos() / 1_000_000) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ms_and_rfc3339_round_trip() {
        assert_eq!(ms_rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(ms_rfc3339(1_700_000_000_123), "2023-11-14T22:13:20.123Z");
        assert_eq!(
            rfc3339_ms("2023-11-14T22:13:20.123Z"),
            Some(1_700_000_000_123)
        );
        assert_eq!(rfc3339_ms("yesterday"), None);
        let before = SystemTime::UNIX_EPOCH - Duration::from_secs(1);
        assert_eq!(ms_since_epoch(before), 0);
        assert!(now_ms() > 1_700_000_000_000);
    }
}

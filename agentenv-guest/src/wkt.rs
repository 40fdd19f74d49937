//! `google.protobuf.Timestamp` with the canonical JSON form: RFC 3339 in
//! UTC with a `Z` suffix and 0, 3, 6 or 9 fractional digits, which strict
//! parsers (e.g. protobuf-es in the JS SDK) require. Offsets are accepted
//! when parsing.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A point in time, as seconds and nanoseconds since the Unix epoch.
#[derive(Clone, Copy, PartialEq, Eq, Hash, prost::Message)]
pub struct Timestamp {
    #[prost(int64, tag = "1")]
    pub seconds: i64,
    #[prost(int32, tag = "2")]
    pub nanos: i32,
}

/// Days since 1970-01-01 to a civil date (proleptic Gregorian).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

impl Timestamp {
    /// The canonical RFC 3339 text.
    pub fn to_rfc3339(&self) -> String {
        let nanos = self.nanos.clamp(0, 999_999_999) as u32;
        let days = self.seconds.div_euclid(86_400);
        let secs = self.seconds.rem_euclid(86_400);
        let (y, mo, d) = civil_from_days(days);
        let (h, mi, s) = (secs / 3600, (secs % 3600) / 60, secs % 60);
        let frac = if nanos == 0 {
            String::new()
        } else if nanos % 1_000_000 == 0 {
            format!(".{:03}", nanos / 1_000_000)
        } else if nanos % 1_000 == 0 {
            format!(".{:06}", nanos / 1_000)
        } else {
            format!(".{nanos:09}")
        };
        format!("{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}{frac}Z")
    }
}

impl Serialize for Timestamp {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_rfc3339())
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let t = pbjson_types::Timestamp::deserialize(d)?;
        Ok(Timestamp {
            seconds: t.seconds,
            nanos: t.nanos,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_is_canonical_utc_with_z() {
        let t = Timestamp {
            seconds: 1_764_498_655,
            nanos: 376_940_438,
        };
        let j = serde_json::to_string(&t).unwrap();
        assert_eq!(j, "\"2025-11-30T10:30:55.376940438Z\"");
        assert_eq!(serde_json::from_str::<Timestamp>(&j).unwrap(), t);
        let whole = Timestamp {
            seconds: 0,
            nanos: 0,
        };
        assert_eq!(whole.to_rfc3339(), "1970-01-01T00:00:00Z");
        let ms = Timestamp {
            seconds: 951_782_400,
            nanos: 5_000_000,
        };
        assert_eq!(ms.to_rfc3339(), "2000-02-29T00:00:00.005Z");
        let with_offset: Timestamp = serde_json::from_str("\"1970-01-01T01:00:00+01:00\"").unwrap();
        assert_eq!(with_offset.seconds, 0);
    }
}

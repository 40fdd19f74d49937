//! Duration strings in Go's `time.ParseDuration` syntax (`"30s"`, `"1m30s"`,
//! `"1.5h"`, `"-5s"`, `"250ms"`), which the control-plane config uses.

use std::time::Duration;

/// Why a duration string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error(
        "invalid duration {0:?}: expected a number followed by a unit (ns, us, ms, s, m, h), e.g. \"30s\""
    )]
    Invalid(String),
    #[error("missing unit in duration {0:?}: write e.g. \"{0}s\"")]
    MissingUnit(String),
    #[error("unknown unit {unit:?} in duration {input:?}: use ns, us, ms, s, m or h")]
    UnknownUnit { unit: String, input: String },
    #[error("duration {0:?} is out of range")]
    Overflow(String),
}

/// Parses a Go duration string into signed nanoseconds. Surrounding white space
/// is ignored.
pub fn parse_go_duration_nanos(input: &str) -> Result<i128, DurationError> {
    let original = input;
    let s = input.trim();
    let invalid = || DurationError::Invalid(original.to_string());
    let (neg, mut rest) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    if rest == "0" {
        return Ok(0);
    }
    if rest.is_empty() {
        return Err(invalid());
    }
    let mut total: f64 = 0.0;
    let mut total_exact: i128 = 0;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let number = &rest[..num_len];
        if number.is_empty() || number == "." || number.matches('.').count() > 1 {
            return Err(invalid());
        }
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let unit = &rest[..unit_len];
        rest = &rest[unit_len..];
        if unit.is_empty() {
            return Err(DurationError::MissingUnit(original.trim().to_string()));
        }
        let scale: i128 = match unit {
            "ns" => 1,
            "us" | "µs" | "μs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60 * 1_000_000_000,
            "h" => 3_600 * 1_000_000_000,
            _ => {
                return Err(DurationError::UnknownUnit {
                    unit: unit.to_string(),
                    input: original.to_string(),
                });
            }
        };
        if let Some((int_part, frac_part)) = number.split_once('.') {
            let whole: i128 = if int_part.is_empty() {
                0
            } else {
                int_part.parse().map_err(|_| invalid())?
            };
            let frac: f64 = format!("0.{frac_part}").parse().map_err(|_| invalid())?;
            total_exact = total_exact
                .checked_add(whole.checked_mul(scale).ok_or_else(|| overflow(original))?)
                .ok_or_else(|| overflow(original))?;
            total += frac * scale as f64;
        } else {
            let whole: i128 = number.parse().map_err(|_| overflow(original))?;
            total_exact = total_exact
                .checked_add(whole.checked_mul(scale).ok_or_else(|| overflow(original))?)
                .ok_or_else(|| overflow(original))?;
        }
    }
    let nanos = total_exact + total.round() as i128;
    if nanos > i64::MAX as i128 {
        return Err(overflow(original));
    }
    Ok(if neg { -nanos } else { nanos })
}

fn overflow(s: &str) -> DurationError {
    DurationError::Overflow(s.to_string())
}

/// Parses a Go duration string that must be greater than zero.
pub fn parse_positive_duration(input: &str) -> Result<Duration, String> {
    let nanos = parse_go_duration_nanos(input).map_err(|e| e.to_string())?;
    if nanos <= 0 {
        return Err(format!(
            "must be greater than zero, got {:?} (e.g. \"30s\")",
            input.trim()
        ));
    }
    Ok(Duration::from_nanos(nanos as u64))
}

/// Formats a duration the way Go prints one (`1m30s`, `250ms`, `0s`).
pub fn format_go_duration(d: Duration) -> String {
    let nanos = d.as_nanos();
    if nanos == 0 {
        return "0s".into();
    }
    if nanos < 1_000 {
        return format!("{nanos}ns");
    }
    if nanos < 1_000_000 {
        return format!("{}µs", trim_fraction(nanos as f64 / 1e3));
    }
    if nanos < 1_000_000_000 {
        return format!("{}ms", trim_fraction(nanos as f64 / 1e6));
    }
    let mut out = String::new();
    let total_secs = d.as_secs();
    let hours = total_secs / 3600;
    let minutes = (total_secs % 3600) / 60;
    if hours > 0 {
        out.push_str(&format!("{hours}h"));
    }
    if hours > 0 || minutes > 0 {
        out.push_str(&format!("{minutes}m"));
    }
    let secs = (total_secs % 60) as f64 + f64::from(d.subsec_nanos()) / 1e9;
    out.push_str(&format!("{}s", trim_fraction(secs)));
    out
}

fn trim_fraction(v: f64) -> String {
    let s = format!("{v:.9}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    s.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_go_duration_forms() {
        let s = 1_000_000_000i128;
        assert_eq!(parse_go_duration_nanos("30s").unwrap(), 30 * s);
        assert_eq!(parse_go_duration_nanos(" 1m30s ").unwrap(), 90 * s);
        assert_eq!(parse_go_duration_nanos("1.5h").unwrap(), 5400 * s);
        assert_eq!(parse_go_duration_nanos("250ms").unwrap(), s / 4);
        assert_eq!(parse_go_duration_nanos("10us").unwrap(), 10_000);
        assert_eq!(parse_go_duration_nanos("10µs").unwrap(), 10_000);
        assert_eq!(parse_go_duration_nanos("-5s").unwrap(), -5 * s);
        assert_eq!(parse_go_duration_nanos("+2s").unwrap(), 2 * s);
        assert_eq!(parse_go_duration_nanos("0").unwrap(), 0);
        assert_eq!(parse_go_duration_nanos(".5s").unwrap(), s / 2);
        assert_eq!(
            parse_go_duration_nanos("1h2m3s4ms").unwrap(),
            3723 * s + 4_000_000
        );
    }

    #[test]
    fn rejects_missing_unit_unknown_unit_and_garbage() {
        assert_eq!(
            parse_go_duration_nanos("45"),
            Err(DurationError::MissingUnit("45".into()))
        );
        assert_eq!(
            parse_go_duration_nanos("1m30"),
            Err(DurationError::MissingUnit("1m30".into()))
        );
        assert!(matches!(
            parse_go_duration_nanos("3d"),
            Err(DurationError::UnknownUnit { .. })
        ));
        for bad in ["", "  ", "s", "-", "1..2s", "abc", "."] {
            assert!(parse_go_duration_nanos(bad).is_err(), "{bad:?} accepted");
        }
        assert!(matches!(
            parse_go_duration_nanos("99999999999999999h"),
            Err(DurationError::Overflow(_))
        ));
    }

    #[test]
    fn positive_duration_rejects_zero_and_negative() {
        assert_eq!(
            parse_positive_duration("45s").unwrap(),
            Duration::from_secs(45)
        );
        assert!(
            parse_positive_duration("0s")
                .unwrap_err()
                .contains("greater than zero")
        );
        assert!(
            parse_positive_duration("-5s")
                .unwrap_err()
                .contains("greater than zero")
        );
    }

    #[test]
    fn formats_like_go() {
        assert_eq!(format_go_duration(Duration::from_secs(90)), "1m30s");
        assert_eq!(format_go_duration(Duration::from_secs(30)), "30s");
        assert_eq!(format_go_duration(Duration::from_secs(3600)), "1h0m0s");
        assert_eq!(format_go_duration(Duration::from_millis(250)), "250ms");
        assert_eq!(format_go_duration(Duration::from_millis(1500)), "1.5s");
        assert_eq!(format_go_duration(Duration::ZERO), "0s");
    }
}

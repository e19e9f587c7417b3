//! Durations in one format for the CRD and the flags: `1h`, `90m`, `1h30m`, `45s` (what the
//! schema's CEL rule also accepts). Parsed here too, because the CRD may be installed without validation (or edited
//! with an old schema) and the controller must never trust it blindly.

/// Shortest and longest TTL we accept, matching the CRD's validation rule.
pub const MIN_TTL_SECONDS: i64 = 60;
pub const MAX_TTL_SECONDS: i64 = 720 * 3600;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("{field} {value:?} is not a duration like 1h or 90m (units h, m, s)")]
    Syntax { field: &'static str, value: String },
    #[error("{field} {value:?} is outside 1m..720h")]
    Range { field: &'static str, value: String },
}

/// Seconds of a duration in the one grammar every duration we read uses (the CRD's TTL and
/// every flag): one or more `<digits><h|m|s>`, e.g. `1h30m`. `None` when it does not parse.
pub fn parse_seconds(value: &str) -> Option<u64> {
    if value.is_empty() {
        return None;
    }
    let mut total: u64 = 0;
    let mut digits = String::new();
    for c in value.chars() {
        if c.is_ascii_digit() {
            digits.push(c);
            continue;
        }
        let unit = match c {
            'h' => 3600,
            'm' => 60,
            's' => 1,
            _ => return None,
        };
        let n: u64 = digits.parse().ok()?;
        digits.clear();
        total = total.saturating_add(n.saturating_mul(unit));
    }
    digits.is_empty().then_some(total)
}

/// Seconds of a TTL, range-checked; `field` names the CRD field in errors.
pub fn parse_ttl(field: &'static str, value: &str) -> Result<i32, DurationError> {
    let total = parse_seconds(value).ok_or_else(|| DurationError::Syntax {
        field,
        value: value.to_string(),
    })?;
    if !(MIN_TTL_SECONDS as u64..=MAX_TTL_SECONDS as u64).contains(&total) {
        return Err(DurationError::Range {
            field,
            value: value.to_string(),
        });
    }
    Ok(total as i32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_forms() {
        for (text, secs) in [
            ("1h", 3600),
            ("90m", 5400),
            ("1h30m", 5400),
            ("60s", 60),
            ("720h", 2_592_000),
        ] {
            assert_eq!(parse_ttl("ttl", text), Ok(secs), "{text}");
        }
    }

    #[test]
    fn rejects_bad_syntax_and_range() {
        for bad in ["", "1", "h", "1d", "1.5h", "-1h", "1h 30m"] {
            assert!(
                matches!(parse_ttl("ttl", bad), Err(DurationError::Syntax { .. })),
                "{bad:?}"
            );
        }
        for out in ["59s", "721h", "0s", "99999999999999h"] {
            assert!(
                matches!(parse_ttl("ttl", out), Err(DurationError::Range { .. })),
                "{out:?}"
            );
        }
    }
}

//! Durations as proto JSON writes them: `"1.5s"`.
//!
//! By hand: the form is tiny (digits, up to nine fraction digits, `s`),
//! and the crates that read durations read humane forms (`1m 30s`,
//! `500ms`) that gRPC refuses, or pull in a proto runtime for one type.

use std::time::Duration;

/// The most seconds a proto `Duration` holds (10 000 years).
const MAX_SECONDS: u64 = 315_576_000_000;

/// Why a string is not a duration: the rest of a sentence that begins
/// with the string (`"100ms" is not a duration such as …`).
pub(crate) const NOT_A_DURATION: &str =
    "is not a duration such as \"1.5s\" (seconds, up to 9 decimals, then \"s\")";
const FORM: &str = NOT_A_DURATION;

/// Reads `"<seconds>[.<up to 9 digits>]s"`; the reason when it is not one.
pub(crate) fn parse(s: &str) -> Result<Duration, &'static str> {
    if s.starts_with('-') {
        return Err("is negative");
    }
    let Some(number) = s.strip_suffix('s') else {
        return Err(FORM);
    };
    let (whole, fraction) = match number.split_once('.') {
        Some((w, f)) => (w, Some(f)),
        None => (number, None),
    };
    if whole.is_empty() || !whole.bytes().all(|b| b.is_ascii_digit()) {
        return Err(FORM);
    }
    let mut secs: u64 = 0;
    for b in whole.bytes() {
        secs = secs
            .checked_mul(10)
            .and_then(|s| s.checked_add(u64::from(b - b'0')))
            .filter(|&s| s <= MAX_SECONDS)
            .ok_or("is more than 315576000000s, the most a duration holds")?;
    }
    let mut nanos: u32 = 0;
    if let Some(f) = fraction {
        if f.is_empty() || !f.bytes().all(|b| b.is_ascii_digit()) {
            return Err(FORM);
        }
        if f.len() > 9 {
            return Err("has more than 9 decimals (a duration counts nanoseconds)");
        }
        for b in f.bytes() {
            nanos = nanos * 10 + u32::from(b - b'0');
        }
        nanos *= 10u32.pow(9 - f.len() as u32);
    }
    Ok(Duration::new(secs, nanos))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proto_json_durations() {
        assert_eq!(parse("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(parse("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse("0.000000001s"), Ok(Duration::from_nanos(1)));
        assert_eq!(parse("0.1s"), Ok(Duration::from_millis(100)));
        assert_eq!(parse("0s"), Ok(Duration::ZERO));
        assert_eq!(parse("315576000000s"), Ok(Duration::from_secs(MAX_SECONDS)));
        for bad in [
            "",
            "s",
            "1",
            "1.s",
            ".5s",
            "1.5",
            "1ms",
            "1m",
            "1.0000000001s",
            "1e3s",
            " 1s",
            "1s ",
            "+1s",
            "1,5s",
            "١s",
            "0x1s",
            "1.5.5s",
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
        assert_eq!(parse("-1s"), Err("is negative"));
        assert!(parse("315576000001s").is_err());
        assert!(parse("99999999999999999999999s").is_err());
    }
}

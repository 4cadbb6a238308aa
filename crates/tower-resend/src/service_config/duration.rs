//! Durations as proto JSON writes them (`"1.5s"`), read as grpc-go reads
//! them (`internal/serviceconfig/duration.go`, `Duration.UnmarshalJSON`):
//! seconds, a fraction of up to 9 digits, then `s`; either part may be
//! left out (`".01s"`, `"1.s"`), not both.
//!
//! By hand: the form is tiny, and the crates that read durations read
//! humane forms (`1m 30s`, `500ms`) that gRPC refuses, or pull in a proto
//! runtime for one type.

use std::time::Duration;

/// The most seconds a proto `Duration` holds (10 000 years).
const MAX_SECONDS: u64 = 315_576_000_000;

/// Why a string is not a duration: the rest of a sentence that begins
/// with the string (`"100ms" is not a duration such as …`).
pub(crate) const NOT_A_DURATION: &str =
    "is not a duration such as \"1.5s\" (seconds, up to 9 decimals, then \"s\")";
const TOO_PRECISE: &str = "has more than 9 decimals (a duration counts nanoseconds)";
const TOO_LONG: &str = "is more than 315576000000s, the most a duration holds";
const NEGATIVE: &str = "is negative";

/// Reads `"[-][+][<seconds>][.<up to 9 digits>]s"`, at least one digit,
/// as grpc-go does; the reason when it is not one.
///
/// Where grpc-go differs, and why:
/// - a duration below zero is refused (grpc-go reads it, and then refuses
///   it for a backoff or ignores it for a timeout; a negative time is a
///   mistake worth saying);
/// - a sign after the first (`"--1s"`, read by grpc-go as 1 s) or in the
///   fraction (`"1.-5s"`, 0.5 s; `"1.+5s"`, 1.5 s) is refused: grpc-go
///   accepts those because it reads each part with `strconv.ParseInt`,
///   which takes a sign; no proto JSON parser does.
pub(crate) fn parse(s: &str) -> Result<Duration, &'static str> {
    let Some(number) = s.strip_suffix('s') else {
        return Err(NOT_A_DURATION);
    };
    let (negative, number) = match number.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, number),
    };
    // grpc-go reads the seconds with `strconv.ParseInt`, which takes a `+`
    // (but not alone: `"+.5s"` is refused).
    let (plus, number) = match number.strip_prefix('+') {
        Some(rest) => (true, rest),
        None => (false, number),
    };
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    let digits = |part: &str| part.bytes().all(|b| b.is_ascii_digit());
    if !digits(whole) || !digits(fraction) || (whole.is_empty() && (plus || fraction.is_empty())) {
        return Err(NOT_A_DURATION);
    }
    let mut secs: u64 = 0;
    for b in whole.bytes() {
        secs = secs
            .checked_mul(10)
            .and_then(|s| s.checked_add(u64::from(b - b'0')))
            .filter(|&s| s <= MAX_SECONDS)
            .ok_or(TOO_LONG)?;
    }
    if fraction.len() > 9 {
        return Err(TOO_PRECISE);
    }
    let mut nanos: u32 = 0;
    for i in 0..9 {
        let digit = fraction.as_bytes().get(i).map_or(0, |b| b - b'0');
        nanos = nanos * 10 + u32::from(digit);
    }
    let d = Duration::new(secs, nanos);
    if negative && !d.is_zero() {
        return Err(NEGATIVE);
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// Every row as grpc-go's `Duration.UnmarshalJSON` reads it (grpc-go
    /// 4793ad0474669eafbd5346c8a3d098fdfa542498), but the rows marked
    /// "grpc-go reads it": see [`parse`] for why those are refused.
    #[test]
    fn durations_as_grpc_go_reads_them() {
        let accepted = [
            ("1s", Duration::from_secs(1)),
            ("10s", Duration::from_secs(10)),
            ("0.5s", 500 * MS),
            ("1.5s", 1500 * MS),
            // grpc-go's retry example.
            (".01s", 10 * MS),
            (".5s", 500 * MS),
            ("1.s", Duration::from_secs(1)),
            ("1.000000001s", Duration::new(1, 1)),
            ("0.000000001s", Duration::from_nanos(1)),
            ("0.1s", 100 * MS),
            ("0.100s", 100 * MS),
            ("0s", Duration::ZERO),
            ("0.0s", Duration::ZERO),
            ("00010s", Duration::from_secs(10)),
            ("+1s", Duration::from_secs(1)),
            ("+1.5s", 1500 * MS),
            // Zero with a sign is zero.
            ("-0s", Duration::ZERO),
            ("-.0s", Duration::ZERO),
            ("315576000000s", Duration::from_secs(MAX_SECONDS)),
            (
                "315576000000.999999999s",
                Duration::new(MAX_SECONDS, 999_999_999),
            ),
        ];
        for (s, want) in accepted {
            assert_eq!(parse(s), Ok(want), "{s:?}");
        }
        let refused = [
            // No unit, another unit, or the unit alone.
            ("", NOT_A_DURATION),
            ("1", NOT_A_DURATION),
            ("1.5", NOT_A_DURATION),
            ("1S", NOT_A_DURATION),
            ("1ms", NOT_A_DURATION),
            ("1m", NOT_A_DURATION),
            ("1h", NOT_A_DURATION),
            ("s", NOT_A_DURATION),
            (".s", NOT_A_DURATION),
            ("-s", NOT_A_DURATION),
            ("+s", NOT_A_DURATION),
            ("+.5s", NOT_A_DURATION),
            // Not digits.
            ("1.5.5s", NOT_A_DURATION),
            ("1e3s", NOT_A_DURATION),
            ("0x1s", NOT_A_DURATION),
            ("1_000s", NOT_A_DURATION),
            ("1,5s", NOT_A_DURATION),
            ("\u{661}s", NOT_A_DURATION),
            (" 1s", NOT_A_DURATION),
            ("1s ", NOT_A_DURATION),
            ("1 s", NOT_A_DURATION),
            ("+-1s", NOT_A_DURATION),
            // grpc-go reads it (1 s, 0.5 s, 1.5 s): a second sign.
            ("--1s", NOT_A_DURATION),
            ("1.-5s", NOT_A_DURATION),
            ("1.+5s", NOT_A_DURATION),
            // Finer than a nanosecond.
            ("1.0000000001s", TOO_PRECISE),
            ("0.9999999999s", TOO_PRECISE),
            // Longer than a proto Duration.
            ("315576000001s", TOO_LONG),
            ("99999999999999999999999s", TOO_LONG),
            // grpc-go reads it (a negative time): refused.
            ("-1s", NEGATIVE),
            ("-0.5s", NEGATIVE),
            ("-.000000001s", NEGATIVE),
            ("-+1s", NEGATIVE),
        ];
        for (s, why) in refused {
            assert_eq!(parse(s), Err(why), "{s:?}");
        }
    }
}

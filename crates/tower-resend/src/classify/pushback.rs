//! How long the server asked us to wait: `Retry-After` and gRPC's
//! `grpc-retry-pushback-ms`.
//!
//! Both parsers first trim spaces and horizontal tabs from both ends of the
//! value (the optional whitespace around an HTTP field value, RFC 9110 §5.5,
//! which a `HeaderValue` built by hand may still carry). Nothing else is
//! forgiven: whitespace inside the value, other control characters, signs,
//! fractions and anything longer than 10 digits (leading zeros aside) are
//! rejected.

use std::fmt;
use std::time::{Duration, SystemTime};

/// The most digits a delta-seconds or pushback value may have: up to
/// 9 999 999 999 (about 317 years in seconds, 115 days in milliseconds).
const MAX_DIGITS: usize = 10;

/// Why a `Retry-After` value could not be read.
///
/// ```
/// use std::time::SystemTime;
/// use tower_resend::classify::parse_retry_after;
///
/// let err = parse_retry_after(b"1.5", SystemTime::now()).unwrap_err();
/// assert_eq!(err.to_string(), "invalid Retry-After value: delta-seconds must be ASCII digits only");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidRetryAfter {
    reason: &'static str,
}

impl InvalidRetryAfter {
    const fn new(reason: &'static str) -> Self {
        Self { reason }
    }

    /// What was wrong with the value.
    ///
    /// ```
    /// use std::time::SystemTime;
    /// use tower_resend::classify::parse_retry_after;
    ///
    /// let err = parse_retry_after(b"-1", SystemTime::now()).unwrap_err();
    /// assert_eq!(err.reason(), "delta-seconds must not be negative");
    /// ```
    pub fn reason(&self) -> &'static str {
        self.reason
    }
}

impl fmt::Display for InvalidRetryAfter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid Retry-After value: {}", self.reason)
    }
}

impl std::error::Error for InvalidRetryAfter {}

/// Reads a Retry-After value: delta-seconds (1*DIGIT) or an HTTP-date
/// (IMF-fixdate, and the obsolete RFC 850 and asctime forms via httpdate).
/// A date in the past means zero wait.
///
/// Spaces and tabs around the value are trimmed; delta-seconds of more than
/// 10 digits (leading zeros not counted) read as [`Duration::MAX`] (a wait longer than any retry will
/// honour, never wrapped). A date is
/// measured from `now`, to the nanosecond; HTTP-dates have whole seconds.
/// Empty, negative, fractional, non-ASCII or otherwise malformed values are
/// an [`InvalidRetryAfter`] that says why; no input panics.
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use tower_resend::classify::parse_retry_after;
///
/// let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_445_412_450); // 07:27:30 GMT
/// assert_eq!(parse_retry_after(b"120", now), Ok(Duration::from_secs(120)));
/// assert_eq!(
///     parse_retry_after(b"Wed, 21 Oct 2015 07:28:00 GMT", now),
///     Ok(Duration::from_secs(30)),
/// );
/// // A date in the past: no wait.
/// assert_eq!(parse_retry_after(b"Wed, 21 Oct 2015 07:00:00 GMT", now), Ok(Duration::ZERO));
/// assert!(parse_retry_after(b"soon", now).is_err());
/// ```
pub fn parse_retry_after(value: &[u8], now: SystemTime) -> Result<Duration, InvalidRetryAfter> {
    let value = trim_ows(value);
    match value.first() {
        None => Err(InvalidRetryAfter::new("value is empty")),
        Some(b'0'..=b'9') => parse_delta_seconds(value),
        Some(b'-') => Err(InvalidRetryAfter::new("delta-seconds must not be negative")),
        Some(b'+') => Err(InvalidRetryAfter::new("delta-seconds must not have a sign")),
        // Every HTTP-date form starts with the name of a day.
        Some(_) => parse_date(value, now),
    }
}

fn parse_delta_seconds(digits: &[u8]) -> Result<Duration, InvalidRetryAfter> {
    if !digits.iter().all(u8::is_ascii_digit) {
        return Err(InvalidRetryAfter::new(
            "delta-seconds must be ASCII digits only",
        ));
    }
    // More than 10 digits is a wait of centuries: read as the longest wait
    // there is, never wrapped, so that it stops a retry as surely as a
    // 10-digit one does.
    Ok(parse_digits(digits).map_or(Duration::MAX, Duration::from_secs))
}

fn parse_date(value: &[u8], now: SystemTime) -> Result<Duration, InvalidRetryAfter> {
    if !value.is_ascii() {
        return Err(InvalidRetryAfter::new(
            "value is not ASCII (nor valid as an HTTP-date)",
        ));
    }
    // httpdate trims all ASCII whitespace itself; we allow only SP and HTAB
    // around the value, trimmed above, and nothing of the kind within.
    if value.iter().any(u8::is_ascii_control) {
        return Err(InvalidRetryAfter::new("value has control characters"));
    }
    let text = std::str::from_utf8(value)
        .map_err(|_| InvalidRetryAfter::new("value is not ASCII (nor valid as an HTTP-date)"))?;
    let date = httpdate::parse_http_date(text)
        .map_err(|_| InvalidRetryAfter::new("value is neither delta-seconds nor an HTTP-date"))?;
    // A date at or before now: retry at once.
    Ok(date.duration_since(now).unwrap_or(Duration::ZERO))
}

/// What gRPC's `grpc-retry-pushback-ms` asks of the client.
///
/// ```
/// use std::time::Duration;
/// use tower_resend::classify::{parse_grpc_pushback, Pushback};
///
/// match parse_grpc_pushback(b"250") {
///     Pushback::After(wait) => assert_eq!(wait, Duration::from_millis(250)),
///     Pushback::DoNotRetry => unreachable!(),
/// }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pushback {
    /// Retry, after waiting this long (instead of the computed backoff).
    After(Duration),
    /// Do not retry this call at all.
    DoNotRetry,
}

/// Reads gRPC's `grpc-retry-pushback-ms`: a non-negative integer of
/// milliseconds means wait that long; a negative or malformed value means
/// "do not retry" (gRPC retry design A6).
///
/// Spaces and tabs around the value are trimmed, as for
/// [`parse_retry_after`]. The value is 1 to 10 ASCII digits (leading zeros
/// not counted); anything else,
/// including an empty or overlong value, is [`Pushback::DoNotRetry`].
///
/// ```
/// use std::time::Duration;
/// use tower_resend::classify::{parse_grpc_pushback, Pushback};
///
/// assert_eq!(parse_grpc_pushback(b"1500"), Pushback::After(Duration::from_millis(1500)));
/// assert_eq!(parse_grpc_pushback(b"-1"), Pushback::DoNotRetry);
/// assert_eq!(parse_grpc_pushback(b"abc"), Pushback::DoNotRetry);
/// ```
pub fn parse_grpc_pushback(value: &[u8]) -> Pushback {
    let digits = trim_ows(value);
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return Pushback::DoNotRetry;
    }
    parse_digits(digits)
        .map(Duration::from_millis)
        .map_or(Pushback::DoNotRetry, Pushback::After)
}

/// Removes spaces and horizontal tabs from both ends.
fn trim_ows(mut value: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = value {
        value = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = value {
        value = rest;
    }
    value
}

/// Parses ASCII digits with at most [`MAX_DIGITS`] after any leading zeros
/// (`00000000002` is two: zeros add no value, so they do not count toward
/// the limit); `None` on anything else.
fn parse_digits(digits: &[u8]) -> Option<u64> {
    let zeros = digits.iter().take_while(|&&d| d == b'0').count();
    // Keep the last zero of an all-zero value: "000" is zero.
    let significant = digits.split_at(zeros.min(digits.len().saturating_sub(1))).1;
    if significant.len() > MAX_DIGITS {
        return None;
    }
    crate::vocab::parse_digits(significant)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The largest time an HTTP-date can name: 9999-12-31 23:59:59 GMT.
    const LAST_HTTP_DATE: u64 = 253_402_300_799;

    fn at(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(secs)
    }

    fn now() -> SystemTime {
        at(1_700_000_000)
    }

    #[test]
    fn delta_seconds() {
        assert_eq!(
            parse_retry_after(b"120", now()),
            Ok(Duration::from_secs(120))
        );
        assert_eq!(parse_retry_after(b"0", now()), Ok(Duration::ZERO));
        assert_eq!(parse_retry_after(b"000", now()), Ok(Duration::ZERO));
        assert_eq!(
            parse_retry_after(b"9999999999", now()),
            Ok(Duration::from_secs(9_999_999_999))
        );
    }

    #[test]
    fn spaces_and_tabs_around_are_trimmed_nothing_else() {
        for ok in [&b" 120"[..], b"120 ", b"\t120\t", b"  \t 120 \t "] {
            assert_eq!(
                parse_retry_after(ok, now()),
                Ok(Duration::from_secs(120)),
                "{ok:?}"
            );
        }
        let date = httpdate::fmt_http_date(now() + Duration::from_secs(5));
        assert_eq!(
            parse_retry_after(format!(" \t{date}\t ").as_bytes(), now()),
            Ok(Duration::from_secs(5))
        );
        for bad in [&b"1 20"[..], b"120\r\n", b"\n120", b"\x0b120", b"120\x00"] {
            assert!(parse_retry_after(bad, now()).is_err(), "{bad:?} accepted");
        }
        for bad in [
            format!("{date}\r\n"),
            format!("\n{date}"),
            format!("{date}\x0c"),
        ] {
            assert_eq!(
                parse_retry_after(bad.as_bytes(), now())
                    .unwrap_err()
                    .reason(),
                "value has control characters",
                "{bad:?}"
            );
        }
    }

    #[test]
    fn http_date_in_the_future() {
        let now = now();
        let value = httpdate::fmt_http_date(now + Duration::from_secs(30));
        assert_eq!(
            parse_retry_after(value.as_bytes(), now),
            Ok(Duration::from_secs(30))
        );
        // A `now` between seconds: the wait is measured from it exactly.
        let later = now + Duration::from_millis(250);
        assert_eq!(
            parse_retry_after(value.as_bytes(), later),
            Ok(Duration::from_millis(29_750))
        );
    }

    #[test]
    fn http_date_in_the_past_or_now_is_zero() {
        let value = httpdate::fmt_http_date(now() - Duration::from_secs(3600));
        assert_eq!(
            parse_retry_after(value.as_bytes(), now()),
            Ok(Duration::ZERO)
        );
        let value = httpdate::fmt_http_date(now());
        assert_eq!(
            parse_retry_after(value.as_bytes(), now()),
            Ok(Duration::ZERO)
        );
    }

    #[test]
    fn all_three_date_forms() {
        // 2015-10-21 07:28:00 GMT, a Wednesday.
        let date = at(1_445_412_480);
        let before = date - Duration::from_secs(60);
        for form in [
            &b"Wed, 21 Oct 2015 07:28:00 GMT"[..],
            b"Wednesday, 21-Oct-15 07:28:00 GMT",
            b"Wed Oct 21 07:28:00 2015",
        ] {
            assert_eq!(
                parse_retry_after(form, before),
                Ok(Duration::from_secs(60)),
                "{}",
                String::from_utf8_lossy(form)
            );
        }
        assert_eq!(
            parse_retry_after(b"Wed, 21 Oct 2015 07:28:00 GMT", now()),
            Ok(Duration::ZERO)
        );
    }

    #[test]
    fn more_than_ten_digits_is_the_longest_wait_not_an_error() {
        for v in [
            &b"10000000000"[..],
            b"010000000000",
            b"99999999999999999999999999",
        ] {
            assert_eq!(parse_retry_after(v, now()), Ok(Duration::MAX), "{v:?}");
        }
        assert_eq!(
            parse_retry_after(b"9999999999", now()),
            Ok(Duration::from_secs(9_999_999_999))
        );
    }

    #[test]
    fn leading_zeros_do_not_count_toward_the_ten_digits() {
        // A valid two seconds: the zeros add nothing (they once read as
        // "wait forever", and the call gave up after one attempt).
        assert_eq!(
            parse_retry_after(b"00000000002", now()),
            Ok(Duration::from_secs(2))
        );
        assert_eq!(
            parse_retry_after(b"0000000000000000000000000", now()),
            Ok(Duration::ZERO)
        );
        assert_eq!(
            parse_grpc_pushback(b"000000000000250"),
            Pushback::After(Duration::from_millis(250))
        );
    }

    #[test]
    fn rejects_garbage_with_a_reason() {
        let cases: &[(&[u8], &str)] = &[
            (b"", "value is empty"),
            (b" \t ", "value is empty"),
            (b"-1", "delta-seconds must not be negative"),
            (b"-0", "delta-seconds must not be negative"),
            (b"+5", "delta-seconds must not have a sign"),
            (b"1.5", "delta-seconds must be ASCII digits only"),
            (b"1e3", "delta-seconds must be ASCII digits only"),
            (b"0x10", "delta-seconds must be ASCII digits only"),
            (b"12abc", "delta-seconds must be ASCII digits only"),
            (b"1\xff", "delta-seconds must be ASCII digits only"),
            (
                b"\xff\xfe",
                "value is not ASCII (nor valid as an HTTP-date)",
            ),
            (
                "Wed, 21 Oct 2015 07:28:00 GMT\u{e9}".as_bytes(),
                "value is not ASCII (nor valid as an HTTP-date)",
            ),
            (b"soon", "value is neither delta-seconds nor an HTTP-date"),
            (
                b"wed, 21 oct 2015 07:28:00 gmt",
                "value is neither delta-seconds nor an HTTP-date",
            ),
            // Wrong day of the week.
            (
                b"Thu, 21 Oct 2015 07:28:00 GMT",
                "value is neither delta-seconds nor an HTTP-date",
            ),
            (
                b"Wed, 21 Oct 2015 07:28:00 UTC",
                "value is neither delta-seconds nor an HTTP-date",
            ),
            (
                b"Wed, 31 Feb 2015 07:28:00 GMT",
                "value is neither delta-seconds nor an HTTP-date",
            ),
            (
                b"Wed, 21 Oct 2015 25:28:00 GMT",
                "value is neither delta-seconds nor an HTTP-date",
            ),
            // Before 1970: httpdate does not go there.
            (
                b"Thu, 01 Jan 1960 00:00:00 GMT",
                "value is neither delta-seconds nor an HTTP-date",
            ),
            (
                b"Wed,  21 Oct 2015 07:28:00 GMT",
                "value is neither delta-seconds nor an HTTP-date",
            ),
        ];
        for (value, reason) in cases {
            let err = parse_retry_after(value, now()).unwrap_err();
            assert_eq!(err.reason(), *reason, "{value:?}");
            assert_eq!(
                err.to_string(),
                format!("invalid Retry-After value: {reason}")
            );
        }
    }

    #[test]
    fn last_http_date_parses() {
        let value = httpdate::fmt_http_date(at(LAST_HTTP_DATE));
        assert_eq!(value, "Fri, 31 Dec 9999 23:59:59 GMT");
        assert_eq!(
            parse_retry_after(value.as_bytes(), at(LAST_HTTP_DATE - 1)),
            Ok(Duration::from_secs(1))
        );
    }

    #[test]
    fn pushback() {
        assert_eq!(
            parse_grpc_pushback(b"1500"),
            Pushback::After(Duration::from_millis(1500))
        );
        assert_eq!(parse_grpc_pushback(b"0"), Pushback::After(Duration::ZERO));
        assert_eq!(
            parse_grpc_pushback(b" 20\t"),
            Pushback::After(Duration::from_millis(20))
        );
        assert_eq!(
            parse_grpc_pushback(b"9999999999"),
            Pushback::After(Duration::from_millis(9_999_999_999))
        );
        for bad in [
            &b""[..],
            b" ",
            b"-1",
            b"-0",
            b"+1",
            b"abc",
            b"1.5",
            b"1 5",
            b"15\r\n",
            b"10000000000",
            b"\xff",
        ] {
            assert_eq!(parse_grpc_pushback(bad), Pushback::DoNotRetry, "{bad:?}");
        }
    }

    fn date_like() -> impl Strategy<Value = String> {
        prop_oneof![
            "[A-Z][a-z]{2}, [0-9]{2} [A-Z][a-z]{2} [0-9]{4} [0-9]{2}:[0-9]{2}:[0-9]{2} GMT",
            "[A-Z][a-z]{5,8}, [0-9]{2}-[A-Z][a-z]{2}-[0-9]{2} [0-9]{2}:[0-9]{2}:[0-9]{2} GMT",
            "[A-Z][a-z]{2} [A-Z][a-z]{2} [ 0-9][0-9] [0-9]{2}:[0-9]{2}:[0-9]{2} [0-9]{4}",
            "(Mon|Tue|Wed|Thu|Fri|Sat|Sun), [0-3][0-9] (Jan|Feb|Oct|Dec) (19[0-9]{2}|99[0-9]{2}) [0-2][0-9]:[0-6][0-9]:[0-6][0-9] GMT",
        ]
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..40), secs in any::<u64>()) {
            let now = SystemTime::UNIX_EPOCH.checked_add(Duration::from_secs(secs)).unwrap_or(now());
            let _ = parse_retry_after(&bytes, now);
            let _ = parse_grpc_pushback(&bytes);
        }

        #[test]
        fn date_like_strings_never_panic(value in date_like()) {
            let _ = parse_retry_after(value.as_bytes(), now());
            let _ = parse_grpc_pushback(value.as_bytes());
        }

        #[test]
        fn any_u32_seconds_round_trip(secs in any::<u32>()) {
            let value = secs.to_string();
            prop_assert_eq!(
                parse_retry_after(value.as_bytes(), now()),
                Ok(Duration::from_secs(u64::from(secs)))
            );
            prop_assert_eq!(
                parse_grpc_pushback(value.as_bytes()),
                Pushback::After(Duration::from_millis(u64::from(secs)))
            );
        }

        #[test]
        fn overlong_digits_are_the_longest_wait(digits in "0{0,5}[1-9][0-9]{10,29}") {
            prop_assert_eq!(parse_retry_after(digits.as_bytes(), now()), Ok(Duration::MAX));
            prop_assert_eq!(parse_grpc_pushback(digits.as_bytes()), Pushback::DoNotRetry);
        }

        #[test]
        fn leading_zeros_change_nothing(zeros in 0usize..40, secs in 0u32..=u32::MAX) {
            let value = format!("{}{secs}", "0".repeat(zeros));
            prop_assert_eq!(
                parse_retry_after(value.as_bytes(), now()),
                Ok(Duration::from_secs(u64::from(secs)))
            );
            prop_assert_eq!(
                parse_grpc_pushback(value.as_bytes()),
                Pushback::After(Duration::from_millis(u64::from(secs)))
            );
        }

        #[test]
        fn future_dates_round_trip_within_a_second(
            now_secs in 0u64..LAST_HTTP_DATE,
            now_nanos in 0u32..1_000_000_000,
            ahead_nanos in any::<u64>(),
        ) {
            let now = SystemTime::UNIX_EPOCH + Duration::new(now_secs, now_nanos);
            let ahead = Duration::from_nanos(ahead_nanos);
            let date = now + ahead;
            // HTTP-dates end with the year 9999.
            prop_assume!(date < at(LAST_HTTP_DATE + 1));
            let value = httpdate::fmt_http_date(date);
            let wait = parse_retry_after(value.as_bytes(), now).unwrap();
            // The date is written in whole seconds, rounded down.
            prop_assert!(wait <= ahead, "{value}: {wait:?} > {ahead:?}");
            prop_assert!(ahead - wait < Duration::from_secs(1), "{value}: {wait:?} vs {ahead:?}");
        }
    }
}

//! Whole numbers on the wire: ASCII digits, as `grpc-timeout`,
//! `Retry-After` and `grpc-retry-pushback-ms` carry them.

/// Parses ASCII digits (callers bound the length, at most 19 digits, so the
/// value cannot overflow); `None` on anything else or on no digits at all.
pub(crate) fn parse_digits(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() || digits.len() > 19 {
        return None;
    }
    digits.iter().try_fold(0u64, |n, &b| {
        b.is_ascii_digit().then(|| n * 10 + u64::from(b - b'0'))
    })
}

//! The remaining budget on the wire: `grpc-timeout` and a header in
//! milliseconds. Writers round down, so a callee is never told it has more
//! time than the caller will wait; parsers reject anything malformed with an
//! error that says why.

use std::fmt;
use std::time::Duration;

use http::HeaderValue;

use crate::vocab::parse_digits;

/// The most digits a `grpc-timeout` value may have.
pub const GRPC_TIMEOUT_MAX_DIGITS: usize = 8;
const GRPC_MAX_VALUE: u64 = 99_999_999;

/// Why a timeout header value could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidTimeout {
    reason: &'static str,
}

impl InvalidTimeout {
    const fn new(reason: &'static str) -> Self {
        Self { reason }
    }

    /// What was wrong with the value.
    pub fn reason(&self) -> &'static str {
        self.reason
    }
}

impl fmt::Display for InvalidTimeout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid timeout header value: {}", self.reason)
    }
}

impl std::error::Error for InvalidTimeout {}

/// Formats `budget` as a `grpc-timeout` value: at most 8 digits and a unit
/// (`H`, `M`, `S`, `m`, `u`, `n`), the finest unit that fits, rounded down.
///
/// ```
/// use std::time::Duration;
/// use tower_resend::deadline::{encode_grpc_timeout, parse_grpc_timeout};
///
/// let v = encode_grpc_timeout(Duration::from_millis(1500));
/// assert_eq!(v, "1500000u");
/// assert_eq!(parse_grpc_timeout(v.as_bytes()), Ok(Duration::from_millis(1500)));
/// ```
pub fn encode_grpc_timeout(budget: Duration) -> HeaderValue {
    let nanos = budget.as_nanos();
    let (value, unit) = if nanos <= u128::from(GRPC_MAX_VALUE) {
        (nanos as u64, 'n')
    } else if nanos / 1_000 <= u128::from(GRPC_MAX_VALUE) {
        ((nanos / 1_000) as u64, 'u')
    } else if nanos / 1_000_000 <= u128::from(GRPC_MAX_VALUE) {
        ((nanos / 1_000_000) as u64, 'm')
    } else if budget.as_secs() <= GRPC_MAX_VALUE {
        (budget.as_secs(), 'S')
    } else if budget.as_secs() / 60 <= GRPC_MAX_VALUE {
        (budget.as_secs() / 60, 'M')
    } else {
        ((budget.as_secs() / 3600).min(GRPC_MAX_VALUE), 'H')
    };
    header_value(format_args!("{value}{unit}"))
}

/// Reads a `grpc-timeout` value: 1 to 8 ASCII digits and one unit.
///
/// ```
/// use std::time::Duration;
/// use tower_resend::deadline::parse_grpc_timeout;
///
/// assert_eq!(parse_grpc_timeout(b"3S"), Ok(Duration::from_secs(3)));
/// assert!(parse_grpc_timeout(b"123456789m").is_err()); // 9 digits
/// assert!(parse_grpc_timeout(b"10").is_err());         // no unit
/// ```
pub fn parse_grpc_timeout(value: &[u8]) -> Result<Duration, InvalidTimeout> {
    let Some((&unit, digits)) = value.split_last() else {
        return Err(InvalidTimeout::new("grpc-timeout is empty"));
    };
    if digits.is_empty() {
        return Err(InvalidTimeout::new("grpc-timeout has no digits"));
    }
    if digits.len() > GRPC_TIMEOUT_MAX_DIGITS {
        return Err(InvalidTimeout::new("grpc-timeout has more than 8 digits"));
    }
    let n = parse_digits(digits).ok_or(InvalidTimeout::new(
        "grpc-timeout must be ASCII digits followed by a unit",
    ))?;
    Ok(match unit {
        b'H' => Duration::from_secs(n * 3600),
        b'M' => Duration::from_secs(n * 60),
        b'S' => Duration::from_secs(n),
        b'm' => Duration::from_millis(n),
        b'u' => Duration::from_micros(n),
        b'n' => Duration::from_nanos(n),
        _ => {
            return Err(InvalidTimeout::new(
                "grpc-timeout unit must be one of H M S m u n",
            ))
        }
    })
}

/// The most digits a milliseconds header value may have (about 31 years).
pub const MILLIS_MAX_DIGITS: usize = 12;

/// Formats `budget` as whole milliseconds, rounded down.
///
/// ```
/// use std::time::Duration;
/// use tower_resend::deadline::encode_millis;
///
/// assert_eq!(encode_millis(Duration::from_micros(2_999_999)), "2999");
/// ```
pub fn encode_millis(budget: Duration) -> HeaderValue {
    let ms = budget
        .as_millis()
        .min(10u128.pow(MILLIS_MAX_DIGITS as u32) - 1);
    header_value(format_args!("{ms}"))
}

/// Reads a milliseconds header value: 1 to 12 ASCII digits.
///
/// ```
/// use std::time::Duration;
/// use tower_resend::deadline::parse_millis;
///
/// assert_eq!(parse_millis(b"250"), Ok(Duration::from_millis(250)));
/// assert!(parse_millis(b"-1").is_err());
/// assert!(parse_millis(b"1.5").is_err());
/// ```
pub fn parse_millis(value: &[u8]) -> Result<Duration, InvalidTimeout> {
    if value.is_empty() {
        return Err(InvalidTimeout::new("timeout is empty"));
    }
    if value.len() > MILLIS_MAX_DIGITS {
        return Err(InvalidTimeout::new("timeout has more than 12 digits"));
    }
    parse_digits(value)
        .map(Duration::from_millis)
        .ok_or(InvalidTimeout::new(
            "timeout must be whole milliseconds in ASCII digits",
        ))
}

fn header_value(args: fmt::Arguments<'_>) -> HeaderValue {
    use std::io::Write;
    // At most 12 digits and a unit: a stack buffer, no intermediate String.
    let mut buf = [0u8; 24];
    let mut cursor = std::io::Cursor::new(&mut buf[..]);
    let _ = cursor.write_fmt(args);
    let len = usize::try_from(cursor.position()).unwrap_or(0);
    HeaderValue::from_bytes(&buf[..len]).unwrap_or_else(|_| HeaderValue::from_static("0n"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn picks_the_finest_unit_that_fits() {
        assert_eq!(encode_grpc_timeout(Duration::ZERO), "0n");
        assert_eq!(
            encode_grpc_timeout(Duration::from_nanos(99_999_999)),
            "99999999n"
        );
        assert_eq!(encode_grpc_timeout(Duration::from_millis(100)), "100000u");
        assert_eq!(encode_grpc_timeout(Duration::from_secs(10)), "10000000u");
        assert_eq!(encode_grpc_timeout(Duration::from_secs(1000)), "1000000m");
        assert_eq!(encode_grpc_timeout(Duration::from_secs(100_000)), "100000S");
        assert_eq!(
            encode_grpc_timeout(Duration::from_secs(200_000_000)),
            "3333333M"
        );
        assert_eq!(
            encode_grpc_timeout(Duration::from_secs(100_000_000 * 60)),
            "1666666H"
        );
        assert_eq!(encode_grpc_timeout(Duration::MAX), "99999999H");
    }

    #[test]
    fn rejects_malformed_grpc_timeouts() {
        for bad in [
            &b""[..],
            b"S",
            b"1",
            b"1s",
            b"1x",
            b"-1S",
            b"+1S",
            b"1 S",
            b"123456789n",
            b"\xff1S",
            b"1.5S",
        ] {
            assert!(parse_grpc_timeout(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(
            parse_grpc_timeout(b"123456789n").unwrap_err().to_string(),
            "invalid timeout header value: grpc-timeout has more than 8 digits"
        );
    }

    #[test]
    fn rejects_malformed_millis() {
        for bad in [
            &b""[..],
            b" 1",
            b"1 ",
            b"-5",
            b"1e3",
            b"0x10",
            b"1234567890123",
        ] {
            assert!(parse_millis(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(parse_millis(b"0"), Ok(Duration::ZERO));
    }

    proptest! {
        #[test]
        fn grpc_round_trip_never_grows(nanos in any::<u64>(), secs in 0u64..400_000_000_000) {
            for budget in [Duration::from_nanos(nanos), Duration::from_secs(secs)] {
                let v = encode_grpc_timeout(budget);
                prop_assert!(v.len() <= GRPC_TIMEOUT_MAX_DIGITS + 1);
                let back = parse_grpc_timeout(v.as_bytes()).expect("our own value parses");
                prop_assert!(back <= budget, "{budget:?} -> {v:?} -> {back:?}");
            }
        }

        #[test]
        fn grpc_round_trip_is_exact_to_the_millisecond_below_100000_seconds(ms in 0u64..100_000_000) {
            let budget = Duration::from_millis(ms);
            let back = parse_grpc_timeout(encode_grpc_timeout(budget).as_bytes()).unwrap();
            // Up to 99_999 s the milliseconds unit fits: exact.
            prop_assert_eq!(back, budget);
        }

        #[test]
        fn millis_round_trip_never_grows(nanos in any::<u64>(), ms in 0u64..1_000_000_000_000) {
            let big = Duration::from_nanos(nanos);
            prop_assert!(parse_millis(encode_millis(big).as_bytes()).unwrap() <= big);
            // Below the 12-digit cap, at most the sub-millisecond part is lost.
            let budget = Duration::from_millis(ms) + Duration::from_nanos(nanos % 1_000_000);
            let back = parse_millis(encode_millis(budget).as_bytes()).unwrap();
            prop_assert!(back <= budget);
            prop_assert!(budget - back < Duration::from_millis(1));
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..24)) {
            let _ = parse_grpc_timeout(&bytes);
            let _ = parse_millis(&bytes);
        }

        #[test]
        fn overlong_values_are_rejected(digits in "[0-9]{9,20}", unit in "[HMSmun]") {
            let v = format!("{digits}{unit}");
            prop_assert!(parse_grpc_timeout(v.as_bytes()).is_err());
            prop_assert!(parse_millis(digits.as_bytes()).is_err() || digits.len() <= MILLIS_MAX_DIGITS);
        }
    }
}

//! The two ways of writing time the quota headers use that no dependency
//! of this crate reads: a Go duration (`6m0s`, `1.5s`, `20ms`), as the
//! model APIs write a reset, and an RFC 3339 time
//! (`2026-12-06T21:04:05Z`), as others do. Each is a few lines of a
//! grammar; a calendar crate for one header form would be a dependency of
//! every user of the feature.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A Go duration: one or more decimal numbers, each with a unit (`ns`,
/// `us`, `µs`, `ms`, `s`, `m`, `h`), no sign (a reset is never negative).
/// `None` for anything else, or over `u64` nanoseconds.
pub(crate) fn go_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    if s.is_empty() {
        return None;
    }
    if s == "0" {
        return Some(Duration::ZERO);
    }
    let mut total: u128 = 0;
    let mut rest = s;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, tail) = rest.split_at(digits);
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, next) = tail.split_at(unit_len);
        let per: u128 = match unit {
            "ns" => 1,
            "us" | "µs" | "μs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            _ => return None,
        };
        total = total.checked_add(scaled(number, per)?)?;
        rest = next;
    }
    u64::try_from(total).ok().map(Duration::from_nanos)
}

/// `number` (digits, at most one `.`, at least one digit) times `per`.
fn scaled(number: &str, per: u128) -> Option<u128> {
    let (whole, frac) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && frac.is_empty() || frac.contains('.') {
        return None;
    }
    let whole: u128 = if whole.is_empty() {
        0
    } else {
        whole.parse().ok()?
    };
    let mut value = whole.checked_mul(per)?;
    // The fraction, digit by digit, as far as it is worth a nanosecond.
    let mut place = per;
    for d in frac.bytes() {
        if !d.is_ascii_digit() {
            return None;
        }
        place /= 10;
        value = value.checked_add(u128::from(d - b'0') * place)?;
    }
    Some(value)
}

/// An RFC 3339 date-time (`2026-12-06T21:04:05Z`,
/// `2026-12-06T21:04:05.5+01:00`; `t` and `z` in any case, a space for the
/// `T`): the time it names, or `None`.
pub(crate) fn rfc3339(s: &str) -> Option<SystemTime> {
    let b = s.trim().as_bytes();
    let num = |range: std::ops::Range<usize>| -> Option<i64> {
        let part = b.get(range)?;
        if !part.iter().all(u8::is_ascii_digit) {
            return None;
        }
        std::str::from_utf8(part).ok()?.parse().ok()
    };
    let sep = |i: usize, set: &[u8]| b.get(i).is_some_and(|c| set.contains(c));
    if b.len() < 20
        || !sep(4, b"-")
        || !sep(7, b"-")
        || !sep(10, b"Tt ")
        || !sep(13, b":")
        || !sep(16, b":")
    {
        return None;
    }
    let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hour, minute, second) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&month)
        || day < 1
        || day > days_in(year, month)
        || hour > 23
        || minute > 59
        || second > 60
    {
        return None;
    }
    let mut i = 19;
    let mut nanos: u64 = 0;
    if sep(i, b".") {
        i += 1;
        let start = i;
        while b.get(i).is_some_and(u8::is_ascii_digit) {
            if i - start < 9 {
                nanos = nanos * 10 + u64::from(b[i] - b'0');
            }
            i += 1;
        }
        if i == start {
            return None;
        }
        for _ in (i - start).min(9)..9 {
            nanos *= 10;
        }
    }
    let offset = match b.get(i..)? {
        b"Z" | b"z" => 0,
        [sign @ (b'+' | b'-'), h1, h2, b':', m1, m2] => {
            let digits = [*h1, *h2, *m1, *m2];
            if !digits.iter().all(u8::is_ascii_digit) {
                return None;
            }
            let h = i64::from((h1 - b'0') * 10 + (h2 - b'0'));
            let m = i64::from((m1 - b'0') * 10 + (m2 - b'0'));
            if h > 23 || m > 59 {
                return None;
            }
            let o = h * 3600 + m * 60;
            if *sign == b'+' {
                o
            } else {
                -o
            }
        }
        _ => return None,
    };
    let days = days_from_civil(year, month, day);
    let secs = days * 86_400 + hour * 3600 + minute * 60 + second.min(59) - offset;
    let secs = u64::try_from(secs).ok()?;
    UNIX_EPOCH.checked_add(Duration::new(secs, u32::try_from(nanos).ok()?))
}

fn days_in(year: i64, month: i64) -> i64 {
    match month {
        2 if year % 4 == 0 && (year % 100 != 0 || year % 400 == 0) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days from 1970-01-01 to a date of the proleptic Gregorian calendar
/// (Howard Hinnant's `days_from_civil`).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations_as_the_model_apis_write_them() {
        let ms = Duration::from_millis;
        for (s, want) in [
            ("6m0s", Some(Duration::from_secs(360))),
            ("1s", Some(ms(1000))),
            ("1.5s", Some(ms(1500))),
            ("20ms", Some(ms(20))),
            ("1h2m3.5s", Some(ms(3_723_500))),
            ("0s", Some(Duration::ZERO)),
            ("0", Some(Duration::ZERO)),
            (".5s", Some(ms(500))),
            ("7us", Some(Duration::from_micros(7))),
            ("7µs", Some(Duration::from_micros(7))),
            ("", None),
            ("s", None),
            ("5", None),
            ("-1s", None),
            ("1x", None),
            ("1..5s", None),
            ("99999999999999999999h", None),
        ] {
            assert_eq!(go_duration(s), want, "{s:?}");
        }
    }

    #[test]
    fn rfc3339_times_as_written() {
        let at = |secs: u64, nanos: u32| Some(UNIX_EPOCH + Duration::new(secs, nanos));
        for (s, want) in [
            ("1970-01-01T00:00:00Z", at(0, 0)),
            ("2026-12-06T21:04:05Z", at(1_796_591_045, 0)),
            ("2026-12-06t21:04:05z", at(1_796_591_045, 0)),
            ("2026-12-06 21:04:05Z", at(1_796_591_045, 0)),
            ("2026-12-06T22:04:05+01:00", at(1_796_591_045, 0)),
            ("2026-12-06T21:04:05.25Z", at(1_796_591_045, 250_000_000)),
            ("2000-02-29T00:00:00Z", at(951_782_400, 0)),
            ("2001-02-29T00:00:00Z", None),
            ("2026-13-01T00:00:00Z", None),
            ("2026-12-06T24:00:00Z", None),
            ("2026-12-06T21:04:05", None),
            ("2026-12-06T21:04:05.Z", None),
            ("2026-12-06T21:04:05+1:00", None),
            ("1969-12-31T23:59:59Z", None),
            ("garbage", None),
            ("", None),
        ] {
            assert_eq!(rfc3339(s), want, "{s:?}");
        }
    }
}

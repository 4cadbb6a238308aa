//! Exponential backoff with full jitter.

use std::fmt;
use std::time::Duration;

const NANOS_PER_SEC: u128 = 1_000_000_000;

/// Exponential backoff with full jitter: the n-th retry waits a uniformly
/// random time in `[0, min(cap, base * multiplier^n)]` (n = 0 for the first
/// retry).
///
/// Full jitter spreads the retries of many clients over the whole window, so
/// they do not come back in step. [`Backoff::DEFAULT`] is base 100 ms,
/// multiplier 2, cap 5 s. The random source is passed in, so tests can seed it.
///
/// ```
/// use std::time::Duration;
/// use tower_resend::retry::Backoff;
///
/// let backoff = Backoff::DEFAULT;
/// let mut rng = fastrand::Rng::with_seed(7);
/// for retry in 0..10 {
///     let wait = backoff.wait(retry, &mut rng);
///     assert!(wait <= backoff.ceiling(retry));
///     assert!(wait <= Duration::from_secs(5));
/// }
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Backoff {
    base: Duration,
    multiplier: f64,
    cap: Duration,
}

impl Backoff {
    /// Base 100 ms, multiplier 2, cap 5 s: ceilings of 100 ms, 200 ms, 400 ms,
    /// 800 ms, 1.6 s, 3.2 s, then 5 s.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_resend::retry::Backoff;
    ///
    /// assert_eq!(Backoff::DEFAULT.ceiling(0), Duration::from_millis(100));
    /// assert_eq!(Backoff::DEFAULT.ceiling(5), Duration::from_millis(3200));
    /// assert_eq!(Backoff::DEFAULT.ceiling(6), Duration::from_secs(5));
    /// assert_eq!(Backoff::default(), Backoff::DEFAULT);
    /// ```
    pub const DEFAULT: Backoff = Backoff {
        base: Duration::from_millis(100),
        multiplier: 2.0,
        cap: Duration::from_secs(5),
    };

    /// A backoff whose first retry waits up to `base`, each later one up to
    /// `multiplier` times longer, never more than `cap`.
    ///
    /// Fails, saying what is wrong, when `base` is zero, `multiplier` is NaN,
    /// infinite or less than 1, or `cap` is less than `base`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_resend::retry::Backoff;
    ///
    /// let b = Backoff::new(Duration::from_millis(50), 3.0, Duration::from_secs(2))?;
    /// assert_eq!(b.ceiling(2), Duration::from_millis(450));
    ///
    /// let err = Backoff::new(Duration::from_secs(1), 2.0, Duration::from_millis(10)).unwrap_err();
    /// assert_eq!(err.to_string(), "invalid backoff: cap must not be less than base");
    /// # Ok::<(), tower_resend::retry::InvalidBackoff>(())
    /// ```
    pub const fn new(
        base: Duration,
        multiplier: f64,
        cap: Duration,
    ) -> Result<Self, InvalidBackoff> {
        if base.is_zero() {
            return Err(InvalidBackoff::new("base must be non-zero"));
        }
        if multiplier.is_nan() {
            return Err(InvalidBackoff::new("multiplier must not be NaN"));
        }
        if multiplier.is_infinite() {
            return Err(InvalidBackoff::new("multiplier must be finite"));
        }
        if multiplier < 1.0 {
            return Err(InvalidBackoff::new("multiplier must be at least 1.0"));
        }
        if cap.as_nanos() < base.as_nanos() {
            return Err(InvalidBackoff::new("cap must not be less than base"));
        }
        Ok(Self {
            base,
            multiplier,
            cap,
        })
    }

    /// The longest wait before the first retry.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_resend::retry::Backoff;
    /// assert_eq!(Backoff::DEFAULT.base(), Duration::from_millis(100));
    /// ```
    pub const fn base(&self) -> Duration {
        self.base
    }

    /// How much longer each retry may wait than the one before.
    ///
    /// ```
    /// # use tower_resend::retry::Backoff;
    /// assert_eq!(Backoff::DEFAULT.multiplier(), 2.0);
    /// ```
    pub const fn multiplier(&self) -> f64 {
        self.multiplier
    }

    /// The longest any retry waits.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_resend::retry::Backoff;
    /// assert_eq!(Backoff::DEFAULT.cap(), Duration::from_secs(5));
    /// ```
    pub const fn cap(&self) -> Duration {
        self.cap
    }

    /// The longest the `retry`-th retry may wait (0 for the first):
    /// `min(cap, base * multiplier^retry)`, never less than `base`.
    ///
    /// Computed in floating point on nanoseconds; it cannot overflow or panic
    /// for any `retry`, and saturates at the cap.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_resend::retry::Backoff;
    ///
    /// let b = Backoff::DEFAULT;
    /// assert_eq!(b.ceiling(1), Duration::from_millis(200));
    /// assert_eq!(b.ceiling(u32::MAX), b.cap());
    /// ```
    pub fn ceiling(&self, retry: u32) -> Duration {
        // multiplier >= 1 and retry >= 0, so factor >= 1 (or +inf).
        let factor = self.multiplier.powf(f64::from(retry));
        let nanos = self.base.as_nanos() as f64 * factor;
        if nanos.is_finite() && nanos < self.cap.as_nanos() as f64 {
            // Below the cap, so below Duration::MAX: the cast cannot saturate.
            from_nanos(nanos as u128).clamp(self.base, self.cap)
        } else {
            self.cap
        }
    }

    /// How long to wait before the `retry`-th retry (0 for the first): a
    /// uniformly random time in `[0, ceiling(retry)]`, both ends included, to
    /// the nanosecond.
    ///
    /// ```
    /// use tower_resend::retry::Backoff;
    ///
    /// let b = Backoff::DEFAULT;
    /// let first = b.wait(0, &mut fastrand::Rng::with_seed(7));
    /// // The same seed gives the same wait.
    /// assert_eq!(first, b.wait(0, &mut fastrand::Rng::with_seed(7)));
    /// assert!(first <= b.ceiling(0));
    /// ```
    pub fn wait(&self, retry: u32, rng: &mut fastrand::Rng) -> Duration {
        let ceiling = self.ceiling(retry).as_nanos();
        from_nanos(rng.u128(0..=ceiling))
    }
}

impl Default for Backoff {
    /// [`Backoff::DEFAULT`]: base 100 ms, multiplier 2, cap 5 s.
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// A [`Duration`] from nanoseconds, saturating at [`Duration::MAX`].
fn from_nanos(nanos: u128) -> Duration {
    let secs = u64::try_from(nanos / NANOS_PER_SEC);
    let sub = u32::try_from(nanos % NANOS_PER_SEC);
    match (secs, sub) {
        (Ok(secs), Ok(sub)) => Duration::new(secs, sub),
        _ => Duration::MAX,
    }
}

/// Why a [`Backoff`] could not be built.
///
/// ```
/// use std::time::Duration;
/// use tower_resend::retry::Backoff;
///
/// let err = Backoff::new(Duration::ZERO, 2.0, Duration::from_secs(1)).unwrap_err();
/// assert_eq!(err.reason(), "base must be non-zero");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidBackoff {
    reason: &'static str,
}

impl InvalidBackoff {
    const fn new(reason: &'static str) -> Self {
        Self { reason }
    }

    /// What was wrong with the configuration.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_resend::retry::Backoff;
    ///
    /// let err = Backoff::new(Duration::from_millis(1), 0.5, Duration::from_secs(1)).unwrap_err();
    /// assert_eq!(err.reason(), "multiplier must be at least 1.0");
    /// ```
    pub fn reason(&self) -> &'static str {
        self.reason
    }
}

impl fmt::Display for InvalidBackoff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid backoff: {}", self.reason)
    }
}

impl std::error::Error for InvalidBackoff {}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn ceiling_grows_then_caps() {
        let b = Backoff::DEFAULT;
        let ceilings: Vec<_> = (0..8).map(|n| b.ceiling(n)).collect();
        assert_eq!(
            ceilings,
            [100, 200, 400, 800, 1600, 3200, 5000, 5000].map(|ms| ms * MS)
        );
        for n in 0..200 {
            assert!(b.ceiling(n) <= b.ceiling(n + 1), "shrinks at {n}");
        }
    }

    #[test]
    fn multiplier_one_is_constant() {
        let b = Backoff::new(250 * MS, 1.0, Duration::from_secs(10)).unwrap();
        for n in [0, 1, 7, 1000, u32::MAX] {
            assert_eq!(b.ceiling(n), 250 * MS);
        }
    }

    #[test]
    fn never_panics_for_any_retry() {
        // (backoff, whether the last retry reaches the cap)
        let configs = [
            (Backoff::DEFAULT, true),
            (
                Backoff::new(Duration::from_nanos(1), 1.0, Duration::from_nanos(1)).unwrap(),
                true,
            ),
            // 1.000000001^u32::MAX is about 73: far below this cap.
            (
                Backoff::new(Duration::from_nanos(1), 1.000_000_001, Duration::MAX).unwrap(),
                false,
            ),
            (
                Backoff::new(Duration::MAX, f64::MAX, Duration::MAX).unwrap(),
                true,
            ),
            (
                Backoff::new(Duration::from_secs(1), 10.0, Duration::MAX).unwrap(),
                true,
            ),
        ];
        let mut rng = fastrand::Rng::with_seed(7);
        for (b, reaches_cap) in configs {
            for n in [
                0,
                1,
                31,
                32,
                63,
                64,
                1 << 20,
                i32::MAX as u32,
                u32::MAX - 1,
                u32::MAX,
            ] {
                let c = b.ceiling(n);
                assert!(b.base() <= c && c <= b.cap(), "{b:?} at {n}: {c:?}");
                assert!(b.wait(n, &mut rng) <= c);
            }
            assert_eq!(b.ceiling(u32::MAX) == b.cap(), reaches_cap, "{b:?}");
        }
    }

    #[test]
    fn rejects_bad_configuration() {
        let s = Duration::from_secs(1);
        let cases = [
            (Duration::ZERO, 2.0, s, "base must be non-zero"),
            (s, f64::NAN, s, "multiplier must not be NaN"),
            (s, f64::INFINITY, s, "multiplier must be finite"),
            (s, f64::NEG_INFINITY, s, "multiplier must be finite"),
            (s, 0.999, s, "multiplier must be at least 1.0"),
            (s, -2.0, s, "multiplier must be at least 1.0"),
            (s, 2.0, s - MS, "cap must not be less than base"),
        ];
        for (base, multiplier, cap, reason) in cases {
            let err = Backoff::new(base, multiplier, cap).unwrap_err();
            assert_eq!(err.reason(), reason);
            assert_eq!(err.to_string(), format!("invalid backoff: {reason}"));
        }
        // Edges that are allowed.
        assert!(Backoff::new(s, 1.0, s).is_ok());
        assert!(Backoff::new(Duration::from_nanos(1), f64::MAX, Duration::MAX).is_ok());
    }

    #[test]
    fn default_is_the_documented_one() {
        let b = Backoff::default();
        assert_eq!(b, Backoff::DEFAULT);
        assert_eq!(
            (b.base(), b.multiplier(), b.cap()),
            (100 * MS, 2.0, Duration::from_secs(5))
        );
        assert_eq!(Backoff::new(100 * MS, 2.0, Duration::from_secs(5)), Ok(b));
    }

    fn waits(seed: u64) -> Vec<Duration> {
        let mut rng = fastrand::Rng::with_seed(seed);
        (0..32)
            .map(|n| Backoff::DEFAULT.wait(n, &mut rng))
            .collect()
    }

    #[test]
    fn seeded_waits_are_in_range_and_repeatable() {
        let a = waits(7);
        for (n, w) in (0..).zip(&a) {
            assert!(*w <= Backoff::DEFAULT.ceiling(n), "retry {n}: {w:?}");
        }
        assert_eq!(a, waits(7));
        assert_ne!(a, waits(8));
    }

    #[test]
    fn waits_average_half_the_ceiling() {
        let b = Backoff::DEFAULT;
        let mut rng = fastrand::Rng::with_seed(7);
        for retry in [0, 3, 10] {
            let draws = 10_000u32;
            let total: Duration = (0..draws).map(|_| b.wait(retry, &mut rng)).sum();
            let mean = (total / draws).as_secs_f64();
            let half = b.ceiling(retry).as_secs_f64() / 2.0;
            assert!(
                (mean - half).abs() < half * 0.05,
                "retry {retry}: mean {mean} vs {half}"
            );
        }
    }

    #[test]
    fn wait_reaches_both_ends_of_a_tiny_range() {
        // Ceiling of 1 ns: both 0 and 1 ns must come up.
        let b = Backoff::new(Duration::from_nanos(1), 1.0, Duration::from_nanos(1)).unwrap();
        let mut rng = fastrand::Rng::with_seed(7);
        let seen: std::collections::HashSet<_> = (0..100).map(|_| b.wait(0, &mut rng)).collect();
        assert_eq!(seen.len(), 2);
    }

    fn valid_backoff() -> impl Strategy<Value = Backoff> {
        (1u64.., 1.0f64..1e6, any::<u64>(), any::<bool>()).prop_map(
            |(base, multiplier, extra, max_cap)| {
                let base = Duration::from_nanos(base);
                let cap = if max_cap {
                    Duration::MAX
                } else {
                    base + Duration::from_nanos(extra)
                };
                Backoff::new(base, multiplier, cap).unwrap()
            },
        )
    }

    proptest! {
        #[test]
        fn wait_is_within_ceiling_within_cap(b in valid_backoff(), retry in any::<u32>(), seed in any::<u64>()) {
            let ceiling = b.ceiling(retry);
            prop_assert!(b.base() <= ceiling);
            prop_assert!(ceiling <= b.cap());
            let wait = b.wait(retry, &mut fastrand::Rng::with_seed(seed));
            prop_assert!(wait <= ceiling, "{wait:?} > {ceiling:?}");
        }

        #[test]
        fn first_ceiling_is_base(b in valid_backoff()) {
            // Exact while the base fits f64's 53-bit mantissa in nanoseconds.
            if b.base().as_nanos() < (1u128 << 53) {
                prop_assert_eq!(b.ceiling(0), b.base());
            }
        }
    }
}

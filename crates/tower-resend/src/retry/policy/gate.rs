//! Before each attempt goes out, the first and every retry: the deadline,
//! then the adaptive throttle.

use tokio::time::Instant;

use crate::deadline::Deadline;
use crate::retry::AdaptiveThrottle;

/// Why an attempt was not sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Unsent {
    /// The deadline had passed.
    Deadline,
    /// The adaptive throttle turned it away.
    Throttled,
}

/// Whether an attempt may go out at `now`: not once the `deadline` has
/// passed (a timeout layer below, seeing the retry layer in charge, does
/// not read the clock again to check), nor when the `throttle` turns it
/// away. When it may, the throttle's bin that its answer counts in (0
/// without a throttle).
#[inline]
pub(crate) fn gate(
    now: Instant,
    deadline: Option<Deadline>,
    throttle: Option<&AdaptiveThrottle>,
) -> Result<u64, Unsent> {
    if deadline.is_some_and(|d| d.instant() <= now) {
        return Err(Unsent::Deadline);
    }
    match throttle {
        Some(throttle) => throttle.admit(now).ok_or(Unsent::Throttled),
        None => Ok(0),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn an_attempt_goes_out_before_the_deadline_unless_throttled() {
        let now = Instant::now();
        let later = Deadline::at(now + Duration::from_secs(1));
        assert_eq!(gate(now, None, None), Ok(0));
        assert_eq!(gate(now, Some(later), None), Ok(0));
        // At the deadline: too late.
        assert_eq!(
            gate(now, Some(Deadline::at(now)), None),
            Err(Unsent::Deadline)
        );
        // A throttle that has seen only rejects turns most attempts away;
        // the deadline is checked first.
        let throttle = AdaptiveThrottle::new();
        for _ in 0..100 {
            if let Ok(bin) = gate(now, None, Some(&throttle)) {
                throttle.answered(bin, false);
            }
        }
        let turned = (0..100)
            .filter(|_| gate(now, Some(later), Some(&throttle)) == Err(Unsent::Throttled))
            .count();
        assert!(turned > 50, "{turned}");
        assert_eq!(
            gate(now, Some(Deadline::at(now)), Some(&throttle)),
            Err(Unsent::Deadline)
        );
    }
}

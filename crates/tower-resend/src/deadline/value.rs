use std::future::Future;
use std::time::Duration;

use tokio::task::futures::TaskLocalFuture;
use tokio::time::Instant;

use super::ledger::TimeLedger;

tokio::task_local! {
    static AMBIENT: Ambient;
}

/// What a [`scope`] hands down to the task: the deadline, and where to
/// record the time (see [`scope_with_ledger`]).
#[derive(Clone, Debug)]
pub struct Ambient {
    deadline: Deadline,
    ledger: Option<TimeLedger>,
}

impl Ambient {
    /// The ambient state for a scope of `deadline` opened here: the earlier
    /// of it and the enclosing deadline, and the enclosing ledger unless a
    /// new one is given.
    fn nested(deadline: Deadline, ledger: Option<TimeLedger>) -> Self {
        match AMBIENT.try_with(Self::clone).ok() {
            Some(outer) => Self {
                deadline: outer.deadline.min(deadline),
                ledger: ledger.or(outer.ledger),
            },
            None => Self { deadline, ledger },
        }
    }
}

/// `future` in the current task's scope, if it has one, wherever it is
/// polled later; else `future` back as it was. See [`carry`](super::carry).
pub(super) fn rescope<F: Future>(future: F) -> Result<TaskLocalFuture<Ambient, F>, F> {
    match AMBIENT.try_with(Ambient::clone) {
        Ok(ambient) => Ok(AMBIENT.scope(ambient, future)),
        Err(_) => Err(future),
    }
}

/// The ambient deadline and ledger, in one task-local access.
pub(crate) fn ambient() -> Option<(Deadline, Option<TimeLedger>)> {
    AMBIENT.try_with(|a| (a.deadline, a.ledger.clone())).ok()
}

/// An absolute point in time by which a call must be finished.
///
/// A `Deadline` is a [`tokio::time::Instant`], so tests on tokio's paused clock
/// control it. It travels in request [extensions](http::Extensions) and in an
/// ambient task-local [`scope`]. Deadlines only ever shrink: combine two with
/// [`min`](Ord::min), which keeps the earlier.
///
/// ```
/// use std::time::Duration;
/// use tower_resend::Deadline;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let d = Deadline::after(Duration::from_secs(2));
/// assert!(!d.is_expired());
/// assert!(d.remaining() <= Duration::from_secs(2));
///
/// // Combining never extends a deadline.
/// let sooner = Deadline::after(Duration::from_millis(500));
/// assert_eq!(d.min(sooner), sooner);
/// # }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Deadline(Instant);

impl Deadline {
    /// A deadline at `instant`.
    pub const fn at(instant: Instant) -> Self {
        Self(instant)
    }

    /// A deadline `budget` from now. A budget too large to represent is
    /// clamped to about thirty years, as tokio's timers do.
    pub fn after(budget: Duration) -> Self {
        Self(after(Instant::now(), budget))
    }

    /// The instant of this deadline.
    pub const fn instant(self) -> Instant {
        self.0
    }

    /// Time left until the deadline; zero once it has passed.
    pub fn remaining(self) -> Duration {
        self.0.saturating_duration_since(Instant::now())
    }

    /// Time left at `now`; zero once it has passed.
    pub fn remaining_at(self, now: Instant) -> Duration {
        self.0.saturating_duration_since(now)
    }

    /// True once the deadline has passed.
    pub fn is_expired(self) -> bool {
        self.0 <= Instant::now()
    }

    /// The ambient deadline of the current task, set by [`scope`], if any.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_resend::{deadline, Deadline};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// assert_eq!(Deadline::current(), None);
    /// let d = Deadline::after(Duration::from_secs(1));
    /// deadline::scope(d, async move {
    ///     assert_eq!(Deadline::current(), Some(d));
    /// })
    /// .await;
    /// # }
    /// ```
    pub fn current() -> Option<Self> {
        AMBIENT.try_with(|a| a.deadline).ok()
    }

    /// The deadline a request is bound by: the earlier of its own (a
    /// `Deadline` in its `extensions`, which a deadline layer writes) and
    /// the ambient one ([`Deadline::current`]). The one place where the two
    /// are merged; every layer of both crates that needs the time left
    /// starts here.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_resend::{deadline, Deadline};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let mut req = http::Request::new(());
    /// assert_eq!(Deadline::of(req.extensions()), None);
    /// let own = Deadline::after(Duration::from_secs(5));
    /// req.extensions_mut().insert(own);
    /// assert_eq!(Deadline::of(req.extensions()), Some(own));
    /// let ambient = Deadline::after(Duration::from_secs(1));
    /// deadline::scope(ambient, async move {
    ///     // The ambient deadline is sooner: it binds the request.
    ///     assert_eq!(Deadline::of(req.extensions()), Some(ambient));
    /// })
    /// .await;
    /// # }
    /// ```
    #[inline]
    pub fn of(extensions: &http::Extensions) -> Option<Self> {
        Self::with_ambient(extensions.get::<Self>().copied())
    }

    /// [`Deadline::of`] for a request whose own deadline was already looked
    /// up: `own` merged with the ambient one.
    #[inline]
    pub(crate) fn with_ambient(own: Option<Self>) -> Option<Self> {
        match (own, Self::current()) {
            (Some(own), Some(ambient)) => Some(own.min(ambient)),
            (own, ambient) => own.or(ambient),
        }
    }
}

/// The longest budget resend works with: about thirty years, as tokio's
/// timers clamp far-off deadlines. Layers clamp their budgets to it once, at
/// construction, so that `now + budget` cannot overflow on the hot path.
pub(crate) const MAX_BUDGET: Duration = Duration::from_secs(86_400 * 365 * 30);

/// Clamps a configured budget to [`MAX_BUDGET`].
pub(crate) const fn clamp(budget: Duration) -> Duration {
    if budget.as_secs() > MAX_BUDGET.as_secs() {
        MAX_BUDGET
    } else {
        budget
    }
}

/// `now + budget`, clamped like tokio's timers clamp far-off deadlines.
fn after(now: Instant, budget: Duration) -> Instant {
    now.checked_add(budget.min(MAX_BUDGET))
        .unwrap_or_else(|| now + Duration::from_secs(86_400))
}

/// Runs `future` with `deadline` as the ambient deadline of the task.
///
/// Every tower-resend stack called inside (a [`CallDeadlineLayer`](super::CallDeadlineLayer),
/// an [`AttemptTimeoutLayer`](crate::timeout::AttemptTimeoutLayer), a
/// [`DeadlineHeaderLayer`](super::DeadlineHeaderLayer)) inherits it, with no
/// plumbing. A server opens one scope per inbound request; a job runner one per
/// job. Scopes nest and only shrink: inside a scope, a new scope with a later
/// deadline keeps the earlier one.
///
/// The scope belongs to the task that awaits the returned future: a task
/// started with `tokio::spawn` inside it does not inherit it. Wrap the
/// spawned future in [`carry`](super::carry) to take the scope along.
///
/// ```
/// use std::time::Duration;
/// use tower_resend::{deadline, Deadline};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let outer = Deadline::after(Duration::from_secs(1));
/// deadline::scope(outer, async move {
///     // A later deadline cannot extend the ambient one.
///     deadline::scope(Deadline::after(Duration::from_secs(60)), async move {
///         assert_eq!(Deadline::current(), Some(outer));
///     })
///     .await;
/// })
/// .await;
/// # }
/// ```
pub fn scope<F: Future>(deadline: Deadline, future: F) -> TaskLocalFuture<Ambient, F> {
    AMBIENT.scope(Ambient::nested(deadline, None), future)
}

/// Like [`scope`], and records in `ledger` where the time goes: every tower-resend
/// stack called inside records its outbound calls, and the task may mark its
/// own work with [`internal`](super::internal). A server opens one per
/// inbound request, to say in a 504 where the time went.
///
/// ```
/// use std::time::Duration;
/// use tower_resend::deadline::{self, server::{Source, TimeLedger}};
/// use tower_resend::Deadline;
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// let ledger = TimeLedger::new();
/// deadline::server::scope_with_ledger(Deadline::after(Duration::from_secs(2)), ledger.clone(), async {
///     deadline::internal("db", tokio::time::sleep(Duration::from_millis(30))).await;
/// })
/// .await;
/// let spent = &ledger.snapshot().finished[0];
/// assert_eq!((spent.source, &*spent.name, spent.spent), (Source::Internal, "db", Duration::from_millis(30)));
/// # }
/// ```
pub fn scope_with_ledger<F: Future>(
    deadline: Deadline,
    ledger: TimeLedger,
    future: F,
) -> TaskLocalFuture<Ambient, F> {
    AMBIENT.scope(Ambient::nested(deadline, Some(ledger)), future)
}

/// The ledger of the current task's scope, if it has one.
pub fn current_ledger() -> Option<TimeLedger> {
    AMBIENT.try_with(|a| a.ledger.clone()).ok().flatten()
}

/// Runs `f` with `deadline` as the ambient deadline (for tests of code that
/// builds futures).
#[cfg(test)]
pub(crate) fn sync_scope<R>(deadline: Deadline, f: impl FnOnce() -> R) -> R {
    AMBIENT.sync_scope(Ambient::nested(deadline, None), f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn remaining_shrinks_with_the_clock_and_saturates() {
        let d = Deadline::after(Duration::from_secs(1));
        assert_eq!(d.remaining(), Duration::from_secs(1));
        tokio::time::advance(Duration::from_millis(300)).await;
        assert_eq!(d.remaining(), Duration::from_millis(700));
        assert!(!d.is_expired());
        tokio::time::advance(Duration::from_millis(700)).await;
        assert!(d.is_expired());
        assert_eq!(d.remaining(), Duration::ZERO);
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(d.remaining(), Duration::ZERO);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn huge_budgets_do_not_overflow() {
        let d = Deadline::after(Duration::MAX);
        assert!(d.remaining() > Duration::from_secs(86_400 * 365));
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn nested_scopes_only_shrink() {
        let long = Deadline::after(Duration::from_secs(10));
        let short = Deadline::after(Duration::from_secs(1));
        scope(long, async move {
            assert_eq!(Deadline::current(), Some(long));
            scope(short, async move {
                assert_eq!(Deadline::current(), Some(short));
                scope(long, async move {
                    assert_eq!(Deadline::current(), Some(short));
                })
                .await;
            })
            .await;
        })
        .await;
        assert_eq!(Deadline::current(), None);
        assert_eq!(sync_scope(short, Deadline::current), Some(short));
    }
}

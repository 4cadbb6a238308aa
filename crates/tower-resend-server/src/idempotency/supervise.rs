//! The one supervisor of a keyed request's work: the handler (and the
//! reading of its response) run to their end, the hold on the key renewed
//! every third of its life meanwhile, cut when the inbound deadline runs
//! out, a panic caught; and [`to_its_end`], which runs it to its end
//! whether its caller waits or goes away.

use std::any::Any;
use std::convert::Infallible;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::time::Duration;

use futures_util::FutureExt;
use tokio::time::Instant;
use tower_resend::deadline::{server::Snapshot, server::TimeLedger};
use tracing::Instrument;

/// How supervised work ended.
#[derive(Debug)]
pub(crate) enum Supervision<T> {
    Done(T),
    Panicked,
    /// Cut by the deadline: where the time went, as of the cut (taken
    /// before the work is dropped, which ends what it was doing).
    DeadlineCut(Snapshot),
}

/// When a hold is renewed while its work runs: every `every`, counted from
/// `from`, an instant before its claim was sent (the request's start).
///
/// Counted from before the claim, not from its answer: the store started
/// the hold's life no earlier, and a claim that was slow to answer (a slow
/// store, a process that stalled) would otherwise push every renewal later
/// by as much, and leave the renewals that much less of the lease to land
/// in. A claim that took longer than `every` is renewed as the work starts.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Renewals {
    pub(crate) from: Instant,
    pub(crate) every: Duration,
}

/// Runs the work `start` makes to its end, unless `deadline` comes first
/// (then where the time went, read from `ledger`) or it panics; meanwhile
/// `renew` runs as [`Renewals`] says, each renewal awaited before the next
/// is due (the times a late one ran past are skipped). The work is polled
/// first, so an answer that is ready wins a tie with the clock.
///
/// (The work is made inside, from `start`: a future handed in would be
/// kept twice in this one, as a parameter and as the future raced, as an
/// `async fn` keeps each of its parameters twice.)
#[allow(clippy::manual_async_fn)]
pub(crate) fn supervise<S, F, R, RF>(
    start: S,
    deadline: Option<Instant>,
    ledger: Option<&TimeLedger>,
    renewal: Option<(Renewals, R)>,
) -> impl Future<Output = Supervision<F::Output>> + use<'_, S, F, R, RF>
where
    S: FnOnce() -> F,
    F: Future,
    R: FnMut() -> RF,
    RF: Future<Output = ()>,
{
    async move {
        // Where the time went is read as the deadline passes, before the work
        // is dropped (which ends what it was doing).
        let cut = async {
            match deadline {
                // Boxed: a request with no deadline keeps no room for its timer.
                Some(at) => Box::pin(tokio::time::sleep_until(at)).await,
                None => std::future::pending().await,
            }
            ledger.map(TimeLedger::snapshot).unwrap_or_default()
        };
        let renewals = async {
            if let Some((Renewals { from, every }, mut renew)) = renewal {
                let every = every.max(Duration::from_millis(1));
                // Already past when the claim was slow: renewed at once.
                let mut next = on_grid(from + every);
                loop {
                    tokio::time::sleep_until(next).await;
                    renew().await;
                    // The times a late renewal ran past are skipped.
                    next += every;
                    while next <= Instant::now() {
                        next += every;
                    }
                }
            }
            std::future::pending::<Infallible>().await
        };
        tokio::select! {
            biased;
            out = AssertUnwindSafe(start()).catch_unwind() => match out {
                Ok(out) => Supervision::Done(out),
                Err(panic) => {
                    tracing::error!(panic = %message(panic.as_ref()), "a keyed handler panicked");
                    Supervision::Panicked
                }
            },
            cut = cut => Supervision::DeadlineCut(cut),
            never = renewals => match never {},
        }
    }
}

/// Renewals fall due on a grid of this step: the requests of one step
/// share one instant, and a timer set for an instant the runtime's timer
/// already waits for does not wake it (setting each request's own earliest
/// instant did, with a system call, on every keyed request).
const GRID: Duration = Duration::from_millis(64);

/// `at`, rounded up to the [`GRID`] (counted from the first use); an
/// instant before the grid's origin is left as it is, not moved on to the
/// origin (which, on a paused clock, another test's runtime may have set
/// seconds ahead of this one's).
fn on_grid(at: Instant) -> Instant {
    static ORIGIN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let origin = *ORIGIN.get_or_init(Instant::now);
    let step = GRID.as_nanos();
    let Some(since) = at.checked_duration_since(origin) else {
        return at;
    };
    let since = since.as_nanos();
    let up = since.div_ceil(step) * step;
    match u64::try_from(up) {
        Ok(nanos) => origin + Duration::from_nanos(nanos),
        Err(_) => at,
    }
}

/// What a panic said.
fn message(panic: &(dyn Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("")
}

/// `work` run to its end, even if its caller goes away: awaited, it runs
/// in the caller's task; dropped before its end, it is spawned, as it is
/// at that point, to run to its end in a task of its own (in the span it
/// was made in).
///
/// Why not `tokio::spawn` from the start, as DESIGN section 7 first said:
/// a task per keyed request cost the layer about six points of
/// `server_throughput`'s waiting row (the task woken, then its caller,
/// often on the other worker), for a caller that almost always waits.
/// (The guard is made at once, not at the first poll: a wait dropped before
/// it was ever polled hands the work on too.)
pub(crate) fn to_its_end<F: Future + Send + 'static>(
    work: Pin<Box<F>>,
) -> impl Future<Output = F::Output> {
    let mut unabandoned = Unabandoned {
        work: Some(work),
        span: tracing::Span::current(),
    };
    async move {
        let out = match unabandoned.work.as_mut() {
            Some(work) => work.await,
            None => std::future::pending().await,
        };
        // Ended: nothing left to hand on.
        drop(unabandoned.work.take());
        out
    }
}

/// Work in progress, spawned to its end if dropped before it.
struct Unabandoned<F: Future + Send + 'static> {
    work: Option<Pin<Box<F>>>,
    span: tracing::Span,
}

impl<F: Future + Send + 'static> Drop for Unabandoned<F> {
    fn drop(&mut self) {
        let Some(work) = self.work.take() else { return };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let span = std::mem::replace(&mut self.span, tracing::Span::none());
                runtime.spawn(
                    async move {
                        work.await;
                    }
                    .instrument(span),
                );
            }
            Err(_) => tracing::error!(
                "a keyed request's caller went away outside a tokio runtime: its work is dropped unfinished"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use tower_resend::deadline::server::Source;

    use super::*;

    type Renewal = Option<(Renewals, fn() -> std::future::Ready<()>)>;

    /// Renewals every `every`, counted from now (a claim that answered at
    /// once).
    fn from_now(every: Duration) -> Renewals {
        Renewals {
            from: Instant::now(),
            every,
        }
    }

    fn no_renewal() -> Renewal {
        None
    }

    /// A cut says what was running at the cut: the handler's upstream call,
    /// still in flight (its future not yet dropped).
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_cut_names_the_work_running_at_the_cut() {
        let ledger = TimeLedger::new();
        let deadline = Instant::now() + Duration::from_secs(1);
        let handler = async {
            let _call = ledger.start(Source::Upstream, "shipping".into());
            tokio::time::sleep(Duration::from_secs(60)).await;
        };
        let Supervision::DeadlineCut(cut) =
            supervise(|| handler, Some(deadline), Some(&ledger), no_renewal()).await
        else {
            panic!("not cut");
        };
        let running = cut.running().expect("the call was running");
        assert_eq!(
            (running.source, &*running.name),
            (Source::Upstream, "shipping")
        );
        assert_eq!(running.spent, Duration::from_secs(1));
        // Once the handler is gone, its call has ended.
        assert!(ledger.snapshot().running().is_none());
    }

    /// Renewals go out every `every` while the work runs, and stop with it;
    /// a panic ends it like an answer, caught.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn renewals_run_every_third_until_the_work_ends() {
        let renewed = Cell::new(0);
        let start = Instant::now();
        let work = tokio::time::sleep(Duration::from_millis(3500));
        let renew = || {
            renewed.set(renewed.get() + 1);
            std::future::ready(())
        };
        let out = supervise(
            || work,
            None,
            None,
            Some((from_now(Duration::from_secs(1)), renew)),
        )
        .await;
        assert!(matches!(out, Supervision::Done(())));
        assert_eq!(start.elapsed(), Duration::from_millis(3500));
        assert_eq!(renewed.get(), 3);

        let panics = async { panic!("boom") };
        let out: Supervision<()> = supervise(|| panics, None, None, no_renewal()).await;
        assert!(matches!(out, Supervision::Panicked));
    }

    /// A claim that took longer than a renewal's period to answer is
    /// renewed as the work starts, and then on the period counted from the
    /// claim's sending, not from its answer: a slow store's claim leaves
    /// the renewals the same share of the lease to land in.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_slow_claim_is_renewed_as_the_work_starts() {
        let started = Cell::new(Vec::new());
        let sent = Instant::now();
        // The claim answers 1.5 s after it was sent, on a period of 1 s.
        tokio::time::advance(Duration::from_millis(1500)).await;
        let renew = || {
            let mut v = started.take();
            v.push(sent.elapsed());
            started.set(v);
            std::future::ready(())
        };
        let renewals = Renewals {
            from: sent,
            every: Duration::from_secs(1),
        };
        let work = tokio::time::sleep(Duration::from_millis(2000));
        let out = supervise(|| work, None, None, Some((renewals, renew))).await;
        assert!(matches!(out, Supervision::Done(())));
        // In tenths of a second since the claim was sent (a renewal's tick
        // is rounded up to the 64 ms grid): at once, then at 2 s and 3 s.
        // Counted from the answer, the first came at 2.5 s: by then the
        // lease, written as the claim landed, had run 2.5 s unrenewed.
        let tenths: Vec<u128> = started.take().iter().map(|d| d.as_millis() / 100).collect();
        assert_eq!(tenths, [15, 20, 30]);
    }

    /// A renewal that never answers holds up the next ones (they are
    /// skipped), never the work or the cut; one slower than its period is
    /// followed by the next at its tick.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_slow_renewal_delays_no_cut() {
        let started = Cell::new(Vec::new());
        let start = Instant::now();
        let renew = || {
            let mut v = started.take();
            v.push(start.elapsed());
            started.set(v);
            tokio::time::sleep(Duration::from_millis(1500))
        };
        let deadline = start + Duration::from_secs(5);
        let out = supervise(
            std::future::pending::<()>,
            Some(deadline),
            None,
            Some((from_now(Duration::from_secs(1)), renew)),
        )
        .await;
        assert!(matches!(out, Supervision::DeadlineCut(_)));
        assert_eq!(start.elapsed(), Duration::from_secs(5));
        let secs: Vec<u64> = started.take().iter().map(Duration::as_secs).collect();
        // At 1 s; the tick at 2 s missed (the renewal lasts to 2.5 s), the
        // next at 3 s; then 4.5 s ... not a tick: 5 s is the cut.
        assert_eq!(secs, [1, 3]);
    }

    /// Awaited, the work runs in the caller's task and answers it; dropped
    /// before its end (or before it was ever polled), it goes on in a task of
    /// its own to its end, once.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn work_whose_caller_goes_away_runs_to_its_end() {
        use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
        use std::sync::Arc;
        use std::time::Duration;

        let (started, ended) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let work = |started: Arc<AtomicUsize>, ended: Arc<AtomicUsize>| async move {
            started.fetch_add(1, SeqCst);
            tokio::time::sleep(Duration::from_secs(1)).await;
            ended.fetch_add(1, SeqCst);
            7
        };

        // Awaited: its answer.
        let out = to_its_end(Box::pin(work(started.clone(), ended.clone()))).await;
        assert_eq!((out, started.load(SeqCst), ended.load(SeqCst)), (7, 1, 1));

        // Dropped midway: the caller stops waiting, the work does not.
        let caller = to_its_end(Box::pin(work(started.clone(), ended.clone())));
        let gave_up = tokio::time::timeout(Duration::from_millis(100), caller).await;
        assert!(gave_up.is_err());
        assert_eq!((started.load(SeqCst), ended.load(SeqCst)), (2, 1));
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!((started.load(SeqCst), ended.load(SeqCst)), (2, 2));

        // Never polled, then dropped: it runs, once, on its own.
        drop(to_its_end(Box::pin(work(started.clone(), ended.clone()))));
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!((started.load(SeqCst), ended.load(SeqCst)), (3, 3));
    }
}

//! Taking a deadline scope along to another task.

use std::future::Future;

use super::value::rescope;

/// Takes the current task's deadline [`scope`](super::scope) (its deadline,
/// and its ledger if it has one) along with `future`, wherever it is polled.
///
/// The scope is the one in force when `carry` is called; every poll of the
/// returned future runs inside it. A future built in a handler's scope and
/// handed to `tokio::spawn` keeps the handler's deadline, and its outbound
/// calls are still recorded in the handler's
/// [`TimeLedger`](super::server::TimeLedger). Outside any scope, `carry` changes
/// nothing: the future runs as it would have.
///
/// ```
/// use std::time::Duration;
/// use tower_resend::{deadline, Deadline};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let d = Deadline::after(Duration::from_secs(1));
/// deadline::scope(d, async move {
///     // A spawned task does not inherit the scope by itself…
///     let bare = tokio::spawn(async { Deadline::current() });
///     assert_eq!(bare.await.unwrap(), None);
///
///     // …a carried future takes it along.
///     let carried = tokio::spawn(deadline::carry(async { Deadline::current() }));
///     assert_eq!(carried.await.unwrap(), Some(d));
/// })
/// .await;
/// # }
/// ```
pub fn carry<F: Future>(future: F) -> impl Future<Output = F::Output> {
    let future = rescope(future);
    async move {
        match future {
            Ok(scoped) => scoped.await,
            Err(bare) => bare.await,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::deadline::server::{current_ledger, scope_with_ledger, Source, TimeLedger};
    use crate::deadline::{internal, scope, value::sync_scope, Deadline};

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    #[allow(clippy::async_yields_async)] // the point: made in the scope, awaited outside
    async fn a_carried_future_keeps_its_scope_in_another_task() {
        let d = Deadline::after(Duration::from_secs(2));
        let ledger = TimeLedger::new();
        let carried = scope_with_ledger(d, ledger.clone(), async {
            carry(async {
                internal("db", tokio::time::sleep(Duration::from_millis(30))).await;
                (Deadline::current(), current_ledger().is_some())
            })
        })
        .await;
        // The scope has ended here; the carried future still has it.
        assert_eq!(Deadline::current(), None);
        let (seen, has_ledger) = tokio::spawn(carried).await.unwrap();
        assert_eq!(seen, Some(d));
        assert!(has_ledger);
        let spent = &ledger.snapshot().finished[0];
        assert_eq!(
            (spent.source, &*spent.name, spent.spent),
            (Source::Internal, "db", Duration::from_millis(30))
        );
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn the_captured_scope_wins_over_the_one_it_is_polled_in() {
        let captured = Deadline::after(Duration::from_secs(5));
        let carried = sync_scope(captured, || carry(async { Deadline::current() }));
        // Polled inside a scope with an earlier deadline, it still sees the
        // scope it was made in; the poller's scope is back afterwards.
        let sooner = Deadline::after(Duration::from_secs(1));
        scope(sooner, async move {
            assert_eq!(carried.await, Some(captured));
            assert_eq!(Deadline::current(), Some(sooner));
        })
        .await;
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn outside_a_scope_it_is_transparent() {
        let carried = carry(async { Deadline::current() });
        // It runs as the bare future would: in whatever scope polls it.
        let d = Deadline::after(Duration::from_secs(1));
        assert_eq!(scope(d, carried).await, Some(d));
        assert_eq!(
            tokio::spawn(carry(async { Deadline::current() }))
                .await
                .unwrap(),
            None
        );
    }
}

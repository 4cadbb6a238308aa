//! A store call, bounded by the store timeout and timed on the layer's
//! metrics.

use std::future::Future;
use std::time::Duration;

use futures_util::FutureExt;
use tokio::time::Instant;

use super::telemetry::{Op, ServerMetrics};
use crate::store::StoreError;

/// `fut`, a store call, given up after `limit` (a store that does not
/// answer in time cannot be reached). A call that answers at once (the
/// memory store's) arms no timer.
pub(crate) fn with_timeout<T, F>(
    limit: Duration,
    fut: F,
) -> impl Future<Output = Result<T, StoreError>> + use<T, F>
where
    F: Future<Output = Result<T, StoreError>>,
{
    bounded(None, limit, || fut)
}

/// The call `make` makes, bounded as by [`with_timeout`], timed and its
/// errors counted on `metrics` when there are instruments (no clock is
/// read otherwise).
pub(crate) fn call<'a, T, M, F>(
    metrics: &'a ServerMetrics,
    op: Op,
    limit: Duration,
    make: M,
) -> impl Future<Output = Result<T, StoreError>> + use<'a, T, M, F>
where
    M: FnOnce() -> F,
    F: Future<Output = Result<T, StoreError>>,
{
    bounded(Some((metrics, op)), limit, make)
}

/// Both: a function returning an async block, the store's future made in
/// it (a future handed in, or an `async fn` awaiting another, would be kept
/// twice in every keyed request's box).
#[allow(clippy::manual_async_fn)]
fn bounded<'a, T, M, F>(
    timed: Option<(&'a ServerMetrics, Op)>,
    limit: Duration,
    make: M,
) -> impl Future<Output = Result<T, StoreError>> + use<'a, T, M, F>
where
    M: FnOnce() -> F,
    F: Future<Output = Result<T, StoreError>>,
{
    async move {
        let start = timed
            .filter(|(metrics, _)| metrics.is_on())
            .map(|_| Instant::now());
        let mut fut = std::pin::pin!(make());
        let out = match fut.as_mut().now_or_never() {
            Some(answered) => answered,
            // Boxed: the timer is for a store across a network, whose
            // answer takes far longer than the allocation; the memory
            // store's calls, which answer at once, keep no room for it.
            None => match Box::pin(tokio::time::timeout(limit, fut)).await {
                Ok(answered) => answered,
                Err(_) => Err(StoreError::new(format!("no answer within {limit:?}"))),
            },
        };
        if let (Some((metrics, op)), Some(start)) = (timed, start) {
            metrics.store_call(op, start.elapsed(), out.is_ok());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store that never answers is given up at the limit, saying so; one
    /// that answers at once is not delayed.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_store_call_gives_up_at_its_limit() {
        let start = Instant::now();
        let hung = with_timeout(
            Duration::from_secs(2),
            std::future::pending::<Result<(), StoreError>>(),
        )
        .await;
        assert!(hung
            .unwrap_err()
            .to_string()
            .contains("no answer within 2s"));
        assert_eq!(start.elapsed(), Duration::from_secs(2));
        let at_once = with_timeout(Duration::from_secs(2), async { Ok(7) }).await;
        assert_eq!(at_once.unwrap(), 7);
        assert_eq!(start.elapsed(), Duration::from_secs(2));
    }
}

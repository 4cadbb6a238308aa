//! The key claimed inside the handler's own transaction: with the `BEGIN`,
//! in one round trip, when the key is new; the long way (a transaction,
//! then `INSERT ... ON CONFLICT` in it) when it is not.

use std::time::Duration;

use sqlx::{Postgres, Transaction};
use tokio::time::Instant;
use tower_resend::Deadline;

use super::tx::begin;
use super::PostgresTransactional;
use crate::idempotency::config::Config;
use crate::idempotency::store_call::with_timeout;
use crate::store::postgres::sql::{found, millis, pg_error};
use crate::store::{Begin, Fingerprint, StoreError};

/// How long a keyed request waits on another holding its key: until just
/// before its deadline (a tenth of what is left, 100 ms at most, kept to
/// answer 409 in time), or one store timeout without one.
pub(super) fn wait_for(config: &Config, deadline: Option<Deadline>) -> Duration {
    deadline.map_or(config.store_timeout, |d| {
        let left = d.remaining();
        left.saturating_sub((left / 10).min(Duration::from_millis(100)))
    })
}

/// What claiming found: what holds the key, and the transaction when it
/// is this request's.
pub(super) type ClaimAnswer = (
    Result<Begin, StoreError>,
    Option<Transaction<'static, Postgres>>,
);

/// The key's claim, as the statements write it.
pub(super) struct KeyRow<'a> {
    pub(super) scope: &'a str,
    pub(super) key: &'a str,
    pub(super) token: &'a str,
    pub(super) fingerprint: Fingerprint,
}

/// Begins the transaction and claims the key in it: in one round trip if
/// the key is new ([`claim_new`]); else, or if that did not end within
/// half the wait, the long way ([`claim_long`]). A concurrent holder is
/// waited on for `wait` in all; each wait for the store is bounded by its
/// timeout.
pub(super) async fn claim(
    backend: &PostgresTransactional,
    config: &Config,
    row: &KeyRow<'_>,
    wait: Duration,
) -> ClaimAnswer {
    let started = Instant::now();
    let ttl = millis(config.ttl.record);
    if let Some(sql) =
        backend
            .sql
            .claim_then_begin(row.scope, row.key, &row.fingerprint, row.token, ttl)
    {
        // Half the wait at most: were it spent waiting for a connection
        // rather than on a holder, the long way still has time to look.
        let bound = (wait / 2).min(config.store_timeout);
        match claim_new(backend, row.key, sql, bound).await {
            OneTrip::Claimed(tx) => return (Ok(Begin::Acquired), Some(tx)),
            OneTrip::Unavailable(e) => return (Err(e), None),
            OneTrip::LongWay => {}
        }
    }
    let wait = wait.saturating_sub(started.elapsed());
    claim_long(backend, config, row, wait).await
}

/// What the claim in one round trip found.
enum OneTrip {
    /// The key was new, and is ours: the transaction is begun, with the
    /// claim in it.
    Claimed(Transaction<'static, Postgres>),
    /// The key is not new (a record, a live or an expired claim), the
    /// database refused the claim for another reason, or the claim did not
    /// end within its bound: the long way decides. Nothing of it is left
    /// (see [`begin`]).
    LongWay,
    /// No transaction could be begun.
    Unavailable(StoreError),
}

/// The claim and the `BEGIN` in one round trip: `INSERT ...; BEGIN` as the
/// transaction's first statement (`Pool::begin_with`), which succeeds only
/// if the key is new. Bounded by `bound`: the time it may wait for a
/// connection and on a concurrent holder's uncommitted row.
async fn claim_new(
    backend: &PostgresTransactional,
    key: &str,
    sql: String,
    bound: Duration,
) -> OneTrip {
    match tokio::time::timeout(bound, begin(&backend.pool, Some(sql))).await {
        Ok(Ok(tx)) => {
            tracing::trace!(key, "idempotency key claimed with its transaction's BEGIN");
            OneTrip::Claimed(tx)
        }
        // A missing table says so, whichever way it is taken.
        Ok(Err(sqlx::Error::Database(e))) if e.code().as_deref() == Some("42P01") => {
            OneTrip::Unavailable(pg_error("claim failed")(sqlx::Error::Database(e)))
        }
        // The INSERT failed, and with it the query: its implicit
        // transaction is rolled back, and the connection went back to the
        // pool out of any transaction.
        Ok(Err(sqlx::Error::Database(e))) => {
            tracing::trace!(key, reason = %e, "idempotency key not new: claimed the long way");
            OneTrip::LongWay
        }
        Ok(Err(e)) => OneTrip::Unavailable(pg_error("cannot begin a transaction")(e)),
        // Waiting on a holder, or for a connection: the long way tells
        // which (and the claim, finished on its own, is rolled back).
        Err(_) => {
            tracing::trace!(
                key,
                "idempotency key claim still waiting: claimed the long way"
            );
            OneTrip::LongWay
        }
    }
}

/// Begins the transaction and claims the key in it, the long way: `INSERT
/// ... ON CONFLICT` on the primary key, which waits on a concurrent
/// holder's uncommitted row (bounded by `wait`), then reads what holds the
/// key. A holder that has not ended within the wait is in progress.
async fn claim_long(
    backend: &PostgresTransactional,
    config: &Config,
    row: &KeyRow<'_>,
    wait: Duration,
) -> ClaimAnswer {
    let begun = with_timeout(config.store_timeout, async {
        begin(&backend.pool, None)
            .await
            .map_err(pg_error("cannot begin a transaction"))
    })
    .await;
    let mut tx = match begun {
        Ok(tx) => tx,
        Err(e) => return (Err(e), None),
    };
    let in_progress = Ok(Begin::InProgress {
        fingerprint: row.fingerprint,
    });
    if wait.is_zero() {
        // The wait went by (in the claim in one round trip, then here),
        // and the store answers: another request holds the key.
        let _ = tx.rollback().await;
        return (in_progress, None);
    }
    for _ in 0..3 {
        let inserted = tokio::time::timeout(
            wait,
            backend
                .query(&backend.sql.begin)
                .bind(row.scope)
                .bind(row.key)
                .bind(&row.fingerprint.0[..])
                .bind(row.token)
                .bind(millis(config.ttl.record))
                .fetch_optional(&mut *tx),
        )
        .await;
        let holder = match inserted {
            // Another request holds the key and has not ended within our
            // wait. (The transaction, its statement cut, is dropped: sqlx
            // rolls it back or closes the connection.)
            Err(_) => return (in_progress, None),
            Ok(Err(e)) => return (Err(pg_error("claim failed")(e)), None),
            Ok(Ok(Some(_))) => return (Ok(Begin::Acquired), Some(tx)),
            Ok(Ok(None)) => {
                let read = backend
                    .query(&backend.sql.select)
                    .bind(row.scope)
                    .bind(row.key)
                    .fetch_optional(&mut *tx)
                    .await
                    .map_err(pg_error("read failed"));
                match read.and_then(found) {
                    // Gone since: try again.
                    Ok(None) => continue,
                    Ok(Some(holder)) => Ok(holder),
                    Err(e) => Err(e),
                }
            }
        };
        let _ = tx.rollback().await;
        return (holder, None);
    }
    let _ = tx.rollback().await;
    (
        Err(StoreError::new("PostgreSQL record kept vanishing")),
        None,
    )
}

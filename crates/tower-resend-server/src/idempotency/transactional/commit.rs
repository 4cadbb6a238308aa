//! The end of a transaction kept: the key's record written in it, then the
//! COMMIT (in one round trip when the response is small), and what became
//! of it. Only a COMMIT that may or may not have happened is unknown: a
//! statement the database refused means nothing committed.

use sqlx::{Postgres, Transaction};

use super::tx::IN_FAILED_TRANSACTION;
use super::{PostgresTransactional, Record};
use crate::idempotency::rules::{Commit, Sqlstate};
use crate::store::postgres::sql::{ROW_GONE, ROW_GONE_CODE};
use crate::store::StoredResponse;

/// The largest response (encoded) recorded in the COMMIT's own round trip:
/// 64 KiB. It goes into the query as text (twice as long, in hex); a larger
/// one is bound as a parameter, in a round trip of its own.
const ONE_ROUND_TRIP_RECORD: usize = 64 * 1024;

/// The COMMIT of a request without a record, checked first: PostgreSQL
/// answers the COMMIT of an aborted transaction with a ROLLBACK, and no
/// error, so a handler's statement that failed unanswered would pass for
/// committed work. The `SELECT 1` fails in an aborted transaction (25P02),
/// and the rest of the query is skipped; in the same round trip as the
/// COMMIT. The `BEGIN` is [`record_then_commit`]'s: the transaction `tx`
/// still counts as open.
const CHECKED_COMMIT: &str = "SELECT 1; COMMIT; BEGIN";

/// Writes the key's record (if any) in `tx`, and commits: the work and its
/// record together. `failed`: what the SQLSTATE of the handler's last
/// failed statement says, if one failed.
pub(super) async fn commit(
    backend: &PostgresTransactional,
    mut tx: Transaction<'static, Postgres>,
    record: Option<&Record>,
    stored: &StoredResponse,
    failed: Option<Sqlstate>,
) -> Commit {
    let Some(record) = record else {
        return checked_commit(tx, failed).await;
    };
    let done = stored.encode();
    if done.len() <= ONE_ROUND_TRIP_RECORD && backend.record_fn_there(&mut tx).await {
        let sql = backend
            .sql
            .record_then_commit(&record.scope, &record.key, &record.token, &done);
        if let Some(sql) = sql {
            return record_then_commit(backend, tx, &record.key, &sql, failed).await;
        }
    }
    tracing::trace!(
        key = &*record.key,
        bytes = done.len(),
        "idempotent response recorded, then committed"
    );
    let written = backend
        .query(&backend.sql.record)
        .bind(&record.scope)
        .bind(&record.key)
        .bind(&record.token)
        .bind(done)
        .execute(&mut *tx)
        .await
        .map(|done| done.rows_affected());
    // No COMMIT is sent unless the record was written: whatever failed
    // here, nothing committed.
    match written {
        Ok(1) => committed(tx).await,
        Ok(_) => {
            tracing::error!(key = &*record.key, "the claimed row is gone: changed or deleted through the handler's transaction; rolled back");
            let _ = tx.rollback().await;
            Commit::Refused
        }
        Err(e) => {
            let _ = tx.rollback().await;
            refused(&e, failed)
        }
    }
}

/// What a statement before the COMMIT (or the COMMIT) failing means:
/// nothing committed; the handler's own statement had failed (the
/// transaction was aborted: `failed` says what its SQLSTATE means), the
/// COMMIT was refused by a constraint or a conflict, or the record could
/// not be written.
fn refused(e: &sqlx::Error, failed: Option<Sqlstate>) -> Commit {
    let code = match e {
        sqlx::Error::Database(db) => db.code(),
        _ => None,
    };
    match code.as_deref() {
        Some(IN_FAILED_TRANSACTION) => {
            tracing::debug!(
                ?failed,
                "a statement of the handler's failed: its transaction rolls back"
            );
            Commit::Aborted(failed.unwrap_or(Sqlstate::Other))
        }
        Some(code) if Sqlstate::of(code) != Sqlstate::Other => {
            tracing::debug!(error = %e, "the database refused the COMMIT: rolled back");
            Commit::Aborted(Sqlstate::of(code))
        }
        _ => {
            tracing::error!(error = %e, "the response of a keyed request could not be recorded: its transaction is rolled back");
            Commit::Refused
        }
    }
}

/// `tx` committed. A COMMIT the database refuses (a deferred constraint,
/// a serialization failure) rolled back; one whose answer was lost may or
/// may not have happened. (After a record written in `tx`: an aborted
/// transaction refused the record already.)
async fn committed(tx: Transaction<'static, Postgres>) -> Commit {
    match tx.commit().await {
        Ok(()) => Commit::Done,
        Err(sqlx::Error::Database(e)) => {
            tracing::debug!(error = %e, "the database refused the COMMIT: rolled back");
            Commit::Aborted(e.code().map_or(Sqlstate::Other, |c| Sqlstate::of(&c)))
        }
        Err(e) => {
            tracing::error!(error = %e, "a keyed request's COMMIT may or may not have happened");
            Commit::Unknown
        }
    }
}

/// The record and the COMMIT in one round trip: `sql` is
/// [`record_then_commit`](crate::store::postgres::sql::Sql::record_then_commit)'s,
/// whose COMMIT runs only if its record function wrote the claimed row. A
/// statement that fails skips the rest of the query, so a database error
/// means the COMMIT did not run, or ran and was refused: nothing committed.
async fn record_then_commit(
    backend: &PostgresTransactional,
    mut tx: Transaction<'static, Postgres>,
    key: &str,
    sql: &str,
    failed: Option<Sqlstate>,
) -> Commit {
    // (Through `Executor` itself, whose boxed future is plainly `Send`.)
    match sqlx::Executor::execute(&mut *tx, sqlx::raw_sql(sql)).await {
        Ok(_) => {
            tracing::trace!(key, "idempotent response recorded with the COMMIT");
            // Committed; the query's last statement began an empty
            // transaction, the one `tx` still counts as open. Dropped, it
            // queues a ROLLBACK of that one, which sqlx sends with its check
            // of the connection on the way back to the pool: no round trip
            // of its own, and the connection is back out of any transaction.
            drop(tx);
            Commit::Done
        }
        // The record function failed, and said why: the claimed row is gone.
        Err(sqlx::Error::Database(e))
            if e.code().as_deref() == Some(ROW_GONE_CODE) && e.message() == ROW_GONE =>
        {
            tracing::error!(key, "the claimed row is gone: changed or deleted through the handler's transaction; rolled back");
            let _ = tx.rollback().await;
            Commit::Refused
        }
        // The function is gone (dropped since it was looked up).
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42883") => {
            backend.record_fn_missing();
            tracing::error!(error = %e, "the record function is missing: rolled back");
            let _ = tx.rollback().await;
            Commit::Refused
        }
        Err(e @ sqlx::Error::Database(_)) => {
            let _ = tx.rollback().await;
            refused(&e, failed)
        }
        // Lost on the way: the COMMIT may have run.
        Err(e) => {
            tracing::error!(error = %e, "a keyed request's record and COMMIT may or may not have happened");
            Commit::Unknown
        }
    }
}

/// A request without a record: its COMMIT, after a check that its
/// transaction was not aborted ([`CHECKED_COMMIT`]), in one round trip.
async fn checked_commit(
    mut tx: Transaction<'static, Postgres>,
    failed: Option<Sqlstate>,
) -> Commit {
    match sqlx::Executor::execute(&mut *tx, sqlx::raw_sql(CHECKED_COMMIT)).await {
        Ok(_) => {
            // Committed; the empty transaction begun after it is rolled
            // back when `tx` goes (see `record_then_commit`).
            drop(tx);
            Commit::Done
        }
        Err(e @ sqlx::Error::Database(_)) => {
            let _ = tx.rollback().await;
            refused(&e, failed)
        }
        Err(e) => {
            tracing::error!(error = %e, "a transaction's COMMIT may or may not have happened");
            Commit::Unknown
        }
    }
}

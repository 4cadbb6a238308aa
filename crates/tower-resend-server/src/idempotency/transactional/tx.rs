//! The handler's transaction: lent to it as a request extension
//! ([`HandlerTransaction`], [`IdempotentTx`]), and begun so that it is never
//! left half begun ([`begin`]).

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use futures_util::future::BoxFuture;
use futures_util::stream::BoxStream;
use futures_util::{FutureExt, StreamExt, TryStreamExt};
#[cfg(feature = "axum")]
use http::StatusCode;
use sqlx::postgres::{PgConnection, PgPool, PgQueryResult, PgRow, PgStatement, PgTypeInfo};
use sqlx::{Describe, Either, Execute, Executor, Postgres, Transaction};
use tokio::sync::{Mutex, OwnedMappedMutexGuard, OwnedMutexGuard};

use crate::idempotency::rules::Sqlstate;

/// The transaction of one request, lent to its handler and taken back when
/// the handler ends.
pub(crate) type TxCell = Arc<Mutex<Option<TxConnection>>>;

/// SQLSTATE 25P02, `in_failed_sql_transaction`: a statement of the
/// transaction failed before, and it can only roll back.
pub(super) const IN_FAILED_TRANSACTION: &str = "25P02";

/// The handler's transaction, as [`IdempotentTx`] lends it: a
/// [`PgConnection`] (through `Deref`), and an [`Executor`] of its own
/// (`&mut *tx`) that notes the SQLSTATE of a statement that fails, so that
/// a failure the handler does not answer is answered by what it means
/// (see [`PostgresTransactional`](super::PostgresTransactional)).
/// Statements run on the connection itself (`&mut **tx`, or a function
/// that takes a `&mut PgConnection`) work all the same, unnoted: their
/// failure, unanswered, is a 500.
///
/// ```no_run
/// use sqlx::PgConnection;
/// use tower_resend_server::IdempotentTx;
///
/// async fn insert(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
///     sqlx::query("INSERT INTO orders DEFAULT VALUES").execute(conn).await.map(drop)
/// }
///
/// async fn handler(mut tx: IdempotentTx) -> Result<(), sqlx::Error> {
///     // Noted: a unique violation left unanswered is a final 422.
///     sqlx::query("INSERT INTO orders DEFAULT VALUES").execute(&mut *tx).await?;
///     // The connection itself: unnoted.
///     insert(&mut tx).await
/// }
/// ```
pub struct TxConnection {
    tx: Transaction<'static, Postgres>,
    /// What the SQLSTATE of the last statement that failed says (not the
    /// 25P02s that follow it).
    failed: Option<Sqlstate>,
}

impl std::fmt::Debug for TxConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TxConnection")
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

impl TxConnection {
    pub(super) fn new(tx: Transaction<'static, Postgres>) -> Self {
        Self { tx, failed: None }
    }

    /// The transaction, and what its last failed statement's SQLSTATE
    /// says.
    pub(super) fn into_parts(self) -> (Transaction<'static, Postgres>, Option<Sqlstate>) {
        (self.tx, self.failed)
    }
}

/// Notes what a failed statement's SQLSTATE says.
fn note(failed: &mut Option<Sqlstate>, e: &sqlx::Error) {
    if let sqlx::Error::Database(db) = e {
        match db.code().as_deref() {
            Some(IN_FAILED_TRANSACTION) => {}
            Some(code) => *failed = Some(Sqlstate::of(code)),
            None => *failed = Some(Sqlstate::Other),
        }
    }
}

impl Deref for TxConnection {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.tx
    }
}

impl DerefMut for TxConnection {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.tx
    }
}

impl<'c> Executor<'c> for &'c mut TxConnection {
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxStream<'e, Result<Either<PgQueryResult, PgRow>, sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        let TxConnection { tx, failed } = self;
        (&mut **tx)
            .fetch_many(query)
            .inspect_err(move |e| note(failed, e))
            .boxed()
    }

    fn fetch_optional<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxFuture<'e, Result<Option<PgRow>, sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        let TxConnection { tx, failed } = self;
        (&mut **tx)
            .fetch_optional(query)
            .inspect(move |r| {
                if let Err(e) = r {
                    note(failed, e);
                }
            })
            .boxed()
    }

    fn prepare_with<'e, 'q: 'e>(
        self,
        sql: &'q str,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, Result<PgStatement<'q>, sqlx::Error>>
    where
        'c: 'e,
    {
        let TxConnection { tx, failed } = self;
        (&mut **tx)
            .prepare_with(sql, parameters)
            .inspect(move |r| {
                if let Err(e) = r {
                    note(failed, e);
                }
            })
            .boxed()
    }

    fn describe<'e, 'q: 'e>(
        self,
        sql: &'q str,
    ) -> BoxFuture<'e, Result<Describe<Postgres>, sqlx::Error>>
    where
        'c: 'e,
    {
        let TxConnection { tx, failed } = self;
        (&mut **tx)
            .describe(sql)
            .inspect(move |r| {
                if let Err(e) = r {
                    note(failed, e);
                }
            })
            .boxed()
    }
}

/// The transaction a handler does its work in, under
/// [`PostgresTransactional`](super::PostgresTransactional): a request extension that the layer puts on
/// every unsafe request it runs. Get its connection with
/// [`IdempotentTx::of`] (or, in axum, take an [`IdempotentTx`] argument).
#[derive(Clone)]
pub struct HandlerTransaction(pub(crate) TxCell);

impl std::fmt::Debug for HandlerTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandlerTransaction").finish_non_exhaustive()
    }
}

/// The handler's transaction, as a [`TxConnection`] to run statements on:
/// `sqlx::query(..).execute(&mut *tx)` (a [`PgConnection`] through
/// `Deref`, wherever one is asked for). The layer commits it (with the
/// key's record) or rolls it back when the handler ends; the handler never
/// does.
///
/// An axum extractor (feature `axum`): a handler's `mut tx: IdempotentTx`
/// argument. Held across the handler's awaits, it is the handler's alone;
/// drop it before the handler returns (as a handler argument is).
pub struct IdempotentTx(OwnedMappedMutexGuard<Option<TxConnection>, TxConnection>);

impl std::fmt::Debug for IdempotentTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotentTx").finish_non_exhaustive()
    }
}

/// There is no transaction to lend: the request was not run by
/// [`PostgresTransactional`](super::PostgresTransactional) (a safe method, another route, another
/// layer), or its handler has ended.
#[derive(Debug)]
pub struct NoTransaction;

impl std::fmt::Display for NoTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("no idempotent transaction: the request is not an unsafe one under IdempotencyLayer::new(PostgresStore::new(pool).transactional())")
    }
}

impl std::error::Error for NoTransaction {}

impl IdempotentTx {
    /// The transaction of the request whose extensions these are.
    pub async fn of(extensions: &http::Extensions) -> Result<Self, NoTransaction> {
        let handle = extensions
            .get::<HandlerTransaction>()
            .ok_or(NoTransaction)?;
        handle.lock().await
    }
}

impl HandlerTransaction {
    /// The transaction's connection, for as long as the guard lives.
    pub async fn lock(&self) -> Result<IdempotentTx, NoTransaction> {
        let guard = Arc::clone(&self.0).lock_owned().await;
        OwnedMutexGuard::try_map(guard, Option::as_mut)
            .map(IdempotentTx)
            .map_err(|_| NoTransaction)
    }
}

impl Deref for IdempotentTx {
    type Target = TxConnection;

    fn deref(&self) -> &TxConnection {
        &self.0
    }
}

impl DerefMut for IdempotentTx {
    fn deref_mut(&mut self) -> &mut TxConnection {
        &mut self.0
    }
}

#[cfg(feature = "axum")]
impl<S: Send + Sync> axum::extract::FromRequestParts<S> for IdempotentTx {
    type Rejection = (StatusCode, &'static str);

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _: &S,
    ) -> Result<Self, Self::Rejection> {
        Self::of(&parts.extensions).await.map_err(|_| {
            tracing::error!("{NoTransaction}");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "this route needs an idempotent transaction",
            )
        })
    }
}

/// A transaction of `pool`'s, begun with `statement` (a bare `BEGIN`
/// without one): every transaction the layer begins goes through here, in
/// a task of its own, so that a begin is never cut midway. sqlx counts a
/// transaction as begun only once its statement has answered, and its own
/// guard rolls back only a counted one: a `begin` dropped while its
/// statement is on the wire (a store timeout that ran out then, a caller
/// gone before the handler started) would let its connection go back to
/// the pool inside the transaction it began — the user's pool, whose next
/// user then works in it, and once a statement fails there has every
/// statement refused (25P02) for the life of the connection. (With a
/// `claim_then_begin` statement, the claim would be in it as well.) This is
/// sqlx's issue 4393 (transact-rs/sqlx), mended there by PR 4394, after the
/// 0.8.6 this workspace builds with. Here, a caller that stops waiting
/// leaves the task to finish the begin, and the transaction it began, if
/// any, is dropped there, which rolls it back. (A begin still waiting for a
/// connection waits on in that task, bounded by the pool's acquire
/// timeout.) Tests: `a_begin_cut_on_the_wire_leaves_no_transaction_behind`,
/// and the transactional chaos run's check of the pool at its end.
pub(crate) async fn begin(
    pool: &PgPool,
    statement: Option<String>,
) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
    let pool = pool.clone();
    let beginning = tokio::spawn(async move {
        match statement {
            Some(sql) => pool.begin_with(sql).await,
            None => pool.begin().await,
        }
    });
    match beginning.await {
        Ok(begun) => begun,
        // (The runtime is going away.)
        Err(e) => Err(sqlx::Error::Io(std::io::Error::other(e))),
    }
}

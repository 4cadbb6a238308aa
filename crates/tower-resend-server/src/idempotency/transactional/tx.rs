//! The handler's transaction: lent to it as a request extension
//! ([`HandlerTransaction`], [`IdempotentTx`]), and begun so that it is never
//! left half begun ([`begin`]).

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

#[cfg(feature = "axum")]
use http::StatusCode;
use sqlx::postgres::{PgConnection, PgPool};
use sqlx::{Postgres, Transaction};
use tokio::sync::{Mutex, OwnedMappedMutexGuard, OwnedMutexGuard};

/// The transaction of one request, lent to its handler and taken back when
/// the handler ends.
pub(crate) type Slot = Arc<Mutex<Option<Transaction<'static, Postgres>>>>;

/// The transaction a handler does its work in, under
/// [`PostgresTransactional`](super::PostgresTransactional): a request extension that the layer puts on
/// every unsafe request it runs. Get its connection with
/// [`IdempotentTx::of`] (or, in axum, take an [`IdempotentTx`] argument).
#[derive(Clone)]
pub struct HandlerTransaction(pub(crate) Slot);

impl std::fmt::Debug for HandlerTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandlerTransaction").finish_non_exhaustive()
    }
}

/// The handler's transaction, as a [`PgConnection`] to run statements on:
/// `sqlx::query(..).execute(&mut *tx)`. The layer commits it (with the
/// key's record) or rolls it back when the handler ends; the handler never
/// does.
///
/// An axum extractor (feature `axum`): a handler's `mut tx: IdempotentTx`
/// argument. Held across the handler's awaits, it is the handler's alone;
/// drop it before the handler returns (as a handler argument is).
pub struct IdempotentTx(
    OwnedMappedMutexGuard<Option<Transaction<'static, Postgres>>, PgConnection>,
);

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
        OwnedMutexGuard::try_map(guard, |tx| tx.as_mut().map(|tx| &mut **tx))
            .map(IdempotentTx)
            .map_err(|_| NoTransaction)
    }
}

impl Deref for IdempotentTx {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.0
    }
}

impl DerefMut for IdempotentTx {
    fn deref_mut(&mut self) -> &mut PgConnection {
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

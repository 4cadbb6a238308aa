//! Transactional idempotency on PostgreSQL: the key is claimed inside the
//! handler's own transaction, and the record commits with its work.

use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::Body;
use sqlx::postgres::{PgConnection, PgPool};
use sqlx::{Postgres, Transaction};
use tokio::sync::{Mutex, OwnedMappedMutexGuard, OwnedMutexGuard};
use tokio::time::{Instant, Sleep};
use tower_resend::deadline::{Snapshot, TimeLedger};
use tower_resend::{BoxError, Deadline};
use tower_service::Service;

use super::backend::{sealed::Sealed, Backend, Handler, Keyed, RequestBody, ResponseBody};
use super::future::{handler_started, Slow};
use super::request;
use super::response::{json_error, retry_later};
use super::rules::{self, Ended, OnBegin, OnEnd};
use super::run::{
    answer, deadline_response, poll_catching, read_keyed_body, replay, stored_headers, unavailable,
};
use super::service::{with_timeout, Shared};
use super::telemetry::{self, Op, Outcome};
use super::NothingDone;
use crate::body::{read_capped, MaybeBuffered};
use crate::store::postgres::{
    found, migrate, migration_sql, millis, pg_error, record_function_sql, Sql, ROW_GONE,
    ROW_GONE_CODE,
};
use crate::store::{LeaseToken, StoreError, StoredResponse};

/// Transactional idempotency on PostgreSQL (feature `postgres`): the
/// strongest mode. The handler gets a transaction ([`IdempotentTx`]) in
/// which its key is already claimed; its own writes and the stored response
/// **commit together or not at all**, and the database's primary key on
/// (scope, key) decides who runs, so it cannot race.
///
/// What it adds over a lease in a [`Store`](crate::Store): no window. With a
/// lease, work committed by a process that dies before it stores the
/// response exists without its record, and a retry runs it again. Here a
/// crash, an error, a panic or the deadline rolls back both the work and the
/// claim: the retry runs on a clean slate. And the key costs no commit of
/// its own — only the handler's — nor, for a new key, a round trip of its
/// own: the claim goes with the `BEGIN`, the record with the `COMMIT`.
///
/// What it needs: **the handler's writes go through the given
/// transaction** (`&mut *tx` is a [`PgConnection`]). Work done elsewhere
/// (another pool, an outbound call) is not rolled back with it; outbound
/// calls through a tower-resend stack with
/// [`idempotency_keys`](tower_resend::StackBuilder::idempotency_keys) carry keys
/// derived from the inbound one, so a re-run is deduplicated downstream.
///
/// For an unsafe request (POST, PATCH, …):
/// - with a key: the transaction begins with the key's claim, in one round
///   trip (`INSERT ...; BEGIN`: a plain INSERT, which succeeds only for a
///   new key). A key that is not new takes the long way: a transaction, and
///   `INSERT ... ON CONFLICT` in it. A concurrent request with the same key
///   waits on the first one's row — until the first commits (then it
///   replays), rolls back (then it runs), or its own inbound deadline (or,
///   without one, the
///   [store timeout](crate::IdempotencyLayer::store_timeout)) runs out (then
///   409). A finished key replays, another fingerprint gets 422;
/// - without a key: the handler gets a transaction too, committed by the
///   same rule, with no record;
/// - the end: a response is committed with its record (5xx included, as
///   everywhere: the handler may have had effects outside the transaction),
///   unless it is marked [`NothingDone`] or is a 429 (rolled back). A
///   response of up to 64 KiB is recorded in the COMMIT's round trip, by
///   the table's record function (made by [`migrate`](Self::migrate)),
///   which fails unless it wrote the claimed row, so the COMMIT cannot run
///   without it; a larger one (or, without the function, any) by an UPDATE
///   of its own, then the COMMIT. A handler error, a panic, a body that
///   fails, the deadline, or a claim the handler deleted (or changed)
///   through its transaction: rolled back, and nothing is recorded (500 of
///   the layer's own, or the deadline's answer). A commit whose outcome is
///   unknown (the connection lost during it) answers 503: retrying with the
///   same key is safe either way;
/// - a caller that goes away does not cancel the handler: it runs to its
///   end, and commits.
///
/// Safe methods pass straight through, with no transaction.
///
/// The lease settings of the layer do not apply (the open transaction holds
/// the key); records live [`record_ttl`](crate::IdempotencyLayer::record_ttl).
///
/// The claim and the record are simple queries, which bind no parameters:
/// their values (scope, key, stored response) are written into them as
/// literals, quoted so that none can end its literal. (A simple query is
/// planned each time it is sent; the record's UPDATE is therefore in a
/// function, whose plan PostgreSQL keeps.) sqlx's statement log
/// shows them as sent (at DEBUG, and at WARN for a statement slower than
/// its threshold, 1 s by default): set the pool's
/// [`log_statements`](sqlx::ConnectOptions::log_statements) and
/// [`log_slow_statements`](sqlx::ConnectOptions::log_slow_statements) if
/// stored responses must not reach the log.
///
/// ```no_run
/// use axum::{routing::post, Router};
/// use tower_resend_server::{IdempotencyLayer, IdempotentTx, PostgresStore};
///
/// async fn create_order(mut tx: IdempotentTx, body: String) -> Result<String, String> {
///     sqlx::query("INSERT INTO orders (body) VALUES ($1)")
///         .bind(&body)
///         .execute(&mut *tx)
///         .await
///         .map_err(|e| e.to_string())?;
///     Ok("created".to_owned())
/// }
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = sqlx::PgPool::connect("postgres://app@db/app").await?;
/// let backend = PostgresStore::new(pool).transactional();
/// backend.migrate().await?;
/// let app: Router = Router::new()
///     .route("/orders", post(create_order))
///     .layer(IdempotencyLayer::new(backend));
/// # let _ = app;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PostgresTransactional {
    pool: PgPool,
    sql: Arc<Sql>,
    prepared: bool,
    record_fn: Arc<RecordFn>,
}

/// Whether the table's record function is there (made by
/// [`PostgresTransactional::migrate`]): the record goes with the COMMIT
/// only through it. Looked up once, and again now and then while it is
/// missing (it may be made later, by a migration of your own).
#[derive(Debug, Default)]
struct RecordFn {
    state: AtomicU8,
    /// Records written the long way since it was last looked up.
    missed: AtomicU32,
}

impl RecordFn {
    const UNKNOWN: u8 = 0;
    const THERE: u8 = 1;
    const MISSING: u8 = 2;
    /// How many records go the long way before it is looked up again.
    const LOOK_AGAIN: u32 = 1000;
}

impl std::fmt::Debug for PostgresTransactional {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresTransactional")
            .field("table", &self.sql.table)
            .finish_non_exhaustive()
    }
}

impl PostgresTransactional {
    pub(crate) fn from_store(pool: PgPool, sql: Arc<Sql>, prepared: bool) -> Self {
        Self {
            pool,
            sql,
            prepared,
            record_fn: Arc::default(),
        }
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The table's definition and its purge index (see
    /// [`PostgresStore::migration_sql`](crate::PostgresStore::migration_sql)),
    /// and the function that records a response in the COMMIT's round trip
    /// (`<table>_record`, in the table's schema; `CREATE OR REPLACE`), as
    /// SQL. Without the function the layer works all the same, with one
    /// round trip more for the record.
    pub fn migration_sql(&self) -> String {
        let table = &self.sql.table;
        migration_sql(table) + &record_function_sql(table)
    }

    /// Creates the table and its index if they do not exist, and the
    /// record function (see [`migration_sql`](Self::migration_sql)). Safe
    /// to run from several processes at once. A failure's message carries
    /// the database's reason.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        migrate(&self.pool, &self.sql.table, true).await?;
        self.record_fn
            .state
            .store(RecordFn::THERE, Ordering::Relaxed);
        Ok(())
    }

    /// Whether the record can go with the COMMIT, through the table's
    /// record function: looked up (in `tx`) the first time, then known;
    /// while it is missing, looked up again every
    /// [`LOOK_AGAIN`](RecordFn::LOOK_AGAIN) records.
    async fn record_fn_there(&self, tx: &mut Transaction<'static, Postgres>) -> bool {
        let known = &self.record_fn;
        match known.state.load(Ordering::Relaxed) {
            RecordFn::THERE => return true,
            RecordFn::UNKNOWN => {}
            _ => {
                let missed = known.missed.fetch_add(1, Ordering::Relaxed);
                if missed % RecordFn::LOOK_AGAIN != RecordFn::LOOK_AGAIN - 1 {
                    return false;
                }
            }
        }
        let there = self
            .query("SELECT to_regprocedure($1) IS NOT NULL")
            .bind(self.sql.record_fn_signature())
            .fetch_one(&mut **tx)
            .await
            .and_then(|row| sqlx::Row::try_get::<bool, _>(&row, 0));
        match there {
            Ok(there) => {
                if !there {
                    tracing::warn!(
                        function = %self.sql.record_fn,
                        "the table's record function is missing (PostgresTransactional::migrate makes it): each record takes a round trip of its own"
                    );
                }
                let state = if there {
                    RecordFn::THERE
                } else {
                    RecordFn::MISSING
                };
                known.state.store(state, Ordering::Relaxed);
                there
            }
            // The transaction is unusable (the handler left it failed, say):
            // the long way finds out, and says so.
            Err(_) => false,
        }
    }

    /// The record function turned out to be missing (dropped since it was
    /// looked up).
    fn record_fn_missing(&self) {
        self.record_fn.missed.store(0, Ordering::Relaxed);
        self.record_fn
            .state
            .store(RecordFn::MISSING, Ordering::Relaxed);
    }

    fn query<'q>(
        &self,
        sql: &'q str,
    ) -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments> {
        sqlx::query(sql).persistent(self.prepared)
    }
}

impl Backend for PostgresTransactional {}

/// The transaction of one request, lent to its handler and taken back when
/// the handler ends.
type Slot = Arc<Mutex<Option<Transaction<'static, Postgres>>>>;

/// The transaction a handler does its work in, under
/// [`PostgresTransactional`]: a request extension that the layer puts on
/// every unsafe request it runs. Get its connection with
/// [`IdempotentTx::of`] (or, in axum, take an [`IdempotentTx`] argument).
#[derive(Clone)]
pub struct HandlerTransaction(Slot);

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
/// [`PostgresTransactional`] (a safe method, another route, another
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

/// How long a keyed request waits on another holding its key: until just
/// before its deadline (a tenth of what is left, 100 ms at most, kept to
/// answer 409 in time), or one store timeout without one.
fn wait_for(config: &super::layer::Config, deadline: Option<Deadline>) -> Duration {
    deadline.map_or(config.store_timeout, |d| {
        let left = d.remaining();
        left.saturating_sub((left / 10).min(Duration::from_millis(100)))
    })
}

// The sealed trait names crate-private types.
#[allow(private_interfaces, private_bounds)]
impl Sealed for PostgresTransactional {
    const TAKES_UNKEYED: bool = true;

    fn keyed<S, B, RB>(
        shared: Arc<Shared<Self>>,
        keyed: Keyed,
        inner: S,
        parts: http::request::Parts,
        body: B,
    ) -> Slow<RB, S::Error>
    where
        S: Handler<B, RB>,
        B: RequestBody,
        RB: ResponseBody,
    {
        use tracing::Instrument;
        let span = telemetry::request_span(&parts.method);
        Box::pin(run_keyed(shared, keyed, inner, parts, body, span.clone()).instrument(span))
    }

    fn unkeyed<S, B, RB>(
        shared: Arc<Shared<Self>>,
        deadline: Option<Deadline>,
        inner: S,
        req: Request<MaybeBuffered<B>>,
    ) -> Slow<RB, S::Error>
    where
        S: Handler<B, RB>,
        B: RequestBody,
        RB: ResponseBody,
    {
        Box::pin(run_unkeyed(shared, deadline, inner, req))
    }
}

/// What claiming the key found.
enum Claimed<RB> {
    Run(Transaction<'static, Postgres>),
    /// The request is answered without running: what became of it, and
    /// the answer.
    Answer(Outcome, Response<MaybeBuffered<RB>>),
}

/// Begins the transaction and claims the key in it: in one round trip if
/// the key is new ([`claim_new`]); else, or if that did not end within
/// half the wait, the long way ([`claim_long`]), which decides by the
/// rules in what is left of it. A concurrent holder is waited on for
/// `wait` in all; each wait for the store is bounded by its timeout.
async fn claim<RB>(
    backend: &PostgresTransactional,
    config: &super::layer::Config,
    scope: &str,
    key: &str,
    token: &str,
    fingerprint: crate::store::Fingerprint,
    wait: Duration,
) -> Claimed<RB> {
    let started = Instant::now();
    let ttl = millis(config.ttl.record);
    if let Some(sql) = backend
        .sql
        .claim_then_begin(scope, key, &fingerprint, token, ttl)
    {
        // Half the wait at most: were it spent waiting for a connection
        // rather than on a holder, the long way still has time to look.
        let bound = (wait / 2).min(config.store_timeout);
        match claim_new(backend, key, sql, bound).await {
            OneTrip::Claimed(tx) => return Claimed::Run(tx),
            OneTrip::Unavailable(e) => {
                return Claimed::Answer(Outcome::StoreUnavailable, unavailable(&e))
            }
            OneTrip::LongWay => {}
        }
    }
    let wait = wait.saturating_sub(started.elapsed());
    claim_long(backend, config, scope, key, token, fingerprint, wait).await
}

/// What the claim in one round trip found.
enum OneTrip {
    /// The key was new, and is ours: the transaction is begun, with the
    /// claim in it.
    Claimed(Transaction<'static, Postgres>),
    /// The key is not new (a record, a live or an expired claim), the
    /// database refused the claim for another reason, or the claim did not
    /// end within its bound: the long way decides. Nothing of it is left
    /// (see [`Begin`]).
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

type Beginning =
    Pin<Box<dyn Future<Output = Result<Transaction<'static, Postgres>, sqlx::Error>> + Send>>;

/// A transaction of `pool`'s, begun with `statement` (a bare `BEGIN`
/// without one): every transaction the layer begins goes through here, as
/// a [`Begin`] that is never cut midway.
fn begin(pool: &PgPool, statement: Option<String>) -> Begin {
    let pool = pool.clone();
    Begin(Some(Box::pin(async move {
        match statement {
            Some(sql) => pool.begin_with(sql).await,
            None => pool.begin().await,
        }
    })))
}

/// A `begin` of sqlx's in flight, which is never dropped unfinished. sqlx
/// counts a transaction as begun only once its statement has answered, and
/// its own guard rolls back only a counted one: a `begin` dropped while its
/// statement is on the wire (a store timeout that ran out then, a caller
/// gone before the handler started) would let its connection go back to
/// the pool inside the transaction it began — the user's pool, whose next
/// user then works in it, and once a statement fails there has every
/// statement refused (25P02) for the life of the connection. (With a
/// `claim_then_begin` statement, the claim would be in it as well.) This
/// is sqlx's issue 4393 (transact-rs/sqlx), mended there by PR 4394,
/// after the 0.8.6 this workspace builds with.
/// Dropped before it ends, it is finished in a task of its own, and the
/// transaction it began, if any, is dropped there, which rolls it back.
/// (sqlx cannot tell a `begin` still waiting for a connection, which could
/// be dropped safely, from one whose `BEGIN` is out, so a dropped one that
/// was still waiting waits on in that task, bounded by the pool's acquire
/// timeout, and then holds its connection for its `BEGIN` and `ROLLBACK`
/// alone.) Tests: `a_begin_cut_on_the_wire_leaves_no_transaction_behind`,
/// and the transactional chaos run's check of the pool at its end.
struct Begin(Option<Beginning>);

impl Future for Begin {
    type Output = Result<Transaction<'static, Postgres>, sqlx::Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(beginning) = self.0.as_mut() else {
            return Poll::Pending;
        };
        let begun = std::task::ready!(beginning.as_mut().poll(cx));
        self.0 = None;
        Poll::Ready(begun)
    }
}

impl Drop for Begin {
    fn drop(&mut self) {
        let Some(beginning) = self.0.take() else {
            return;
        };
        // (Without a runtime sqlx cannot release a connection at all.)
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                // A transaction begun, dropped, queues its ROLLBACK, which
                // sqlx sends before the connection goes back to the pool.
                drop(beginning.await);
            });
        }
    }
}

/// Begins the transaction and claims the key in it, the long way: `INSERT
/// ... ON CONFLICT` on the primary key, which waits on a concurrent
/// holder's uncommitted row (bounded by `wait`), then reads what holds the
/// key.
async fn claim_long<RB>(
    backend: &PostgresTransactional,
    config: &super::layer::Config,
    scope: &str,
    key: &str,
    token: &str,
    fingerprint: crate::store::Fingerprint,
    wait: Duration,
) -> Claimed<RB> {
    let begun = with_timeout(config.store_timeout, async {
        begin(&backend.pool, None)
            .await
            .map_err(pg_error("cannot begin a transaction"))
    })
    .await;
    let mut tx = match begun {
        Ok(tx) => tx,
        Err(e) => return Claimed::Answer(Outcome::StoreUnavailable, unavailable(&e)),
    };
    let in_progress = || {
        retry_later(
            StatusCode::CONFLICT,
            "idempotency_key_in_progress",
            "a request with this idempotency key is in progress; retry later",
            config.retry_after,
        )
    };
    if wait.is_zero() {
        // The wait went by (in the claim in one round trip, then here),
        // and the store answers: another request holds the key.
        let _ = tx.rollback().await;
        return Claimed::Answer(Outcome::InProgress, in_progress());
    }
    for _ in 0..3 {
        let inserted = tokio::time::timeout(
            wait,
            backend
                .query(&backend.sql.begin)
                .bind(scope)
                .bind(key)
                .bind(&fingerprint.0[..])
                .bind(token)
                .bind(millis(config.ttl.record))
                .fetch_optional(&mut *tx),
        )
        .await;
        let found = match inserted {
            // Another request holds the key and has not ended within our
            // wait: 409. (The transaction, its statement cut, is dropped:
            // sqlx rolls it back or closes the connection.)
            Err(_) => return Claimed::Answer(Outcome::InProgress, in_progress()),
            Ok(Err(e)) => {
                return Claimed::Answer(
                    Outcome::StoreUnavailable,
                    unavailable(&pg_error("claim failed")(e)),
                )
            }
            Ok(Ok(Some(_))) => return Claimed::Run(tx),
            Ok(Ok(None)) => {
                let row = backend
                    .query(&backend.sql.select)
                    .bind(scope)
                    .bind(key)
                    .fetch_optional(&mut *tx)
                    .await
                    .map_err(pg_error("read failed"));
                match row.and_then(found) {
                    Ok(None) => continue,
                    Ok(Some(begin)) => Ok(begin),
                    Err(e) => Err(e),
                }
            }
        };
        let answer = match rules::on_begin(found, fingerprint) {
            OnBegin::Run => continue,
            OnBegin::Unavailable(e) => (Outcome::StoreUnavailable, unavailable(&e)),
            OnBegin::Replay(response) => (Outcome::Replayed, replay(response)),
            OnBegin::InProgress => (Outcome::InProgress, in_progress()),
            OnBegin::Mismatch => (
                Outcome::Mismatch,
                json_error(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "idempotency_key_reused",
                    "this idempotency key was used with another request (method, path or body differ)",
                ),
            ),
        };
        let _ = tx.rollback().await;
        return Claimed::Answer(answer.0, answer.1);
    }
    Claimed::Answer(
        Outcome::StoreUnavailable,
        unavailable(&StoreError::new("PostgreSQL record kept vanishing")),
    )
}

async fn run_keyed<S, B, RB>(
    shared: Arc<Shared<PostgresTransactional>>,
    keyed: Keyed,
    inner: S,
    parts: http::request::Parts,
    body: B,
    span: tracing::Span,
) -> Result<Response<MaybeBuffered<RB>>, S::Error>
where
    S: Handler<B, RB>,
    B: RequestBody,
    RB: ResponseBody,
{
    let started_at = Instant::now();
    let config = &shared.config;
    let metrics = config.stats.metrics();
    // What became of the request (on its span, and counted), and its answer.
    let answered = |outcome: Outcome, response: Response<MaybeBuffered<RB>>| {
        telemetry::outcome(&span, metrics, outcome);
        telemetry::answered(&span, response.status());
        response
    };
    let bytes = match read_keyed_body(body, config.request_cap).await {
        Ok(bytes) => bytes,
        Err((outcome, response)) => return Ok(answered(outcome, response)),
    };
    let fingerprint = request::fingerprint(&parts, &bytes);
    let wait = wait_for(config, keyed.deadline);
    let key = keyed.key.as_str();
    let token = LeaseToken::random().to_string();
    let claimed = claim(
        &shared.store,
        config,
        &keyed.scope,
        key,
        &token,
        fingerprint,
        wait,
    );
    // The claim is the store call that begins a keyed request.
    let timing = metrics.is_on().then(Instant::now);
    let claimed = claimed.await;
    if let Some(start) = timing {
        let reached = !matches!(claimed, Claimed::Answer(Outcome::StoreUnavailable, _));
        metrics.store_call(Op::Begin, start.elapsed(), reached);
    }
    let tx = match claimed {
        Claimed::Run(tx) => {
            telemetry::outcome(&span, metrics, Outcome::Ran);
            tx
        }
        Claimed::Answer(outcome, response) => return Ok(answered(outcome, response)),
    };
    let record = Record {
        scope: &keyed.scope,
        key,
        token: &token,
    };
    // The handler's outbound calls derive their keys from this one, and
    // keep the inbound deadline, wherever the work goes on.
    let (scope, key_value) = (keyed.scope.clone(), keyed.key.header_value().clone());
    let handler = move |req| {
        tower_resend::idempotency::derive_keys(
            scope,
            key_value,
            tower_resend::deadline::carry(inner_call(inner, req)),
        )
    };
    let run = Run {
        backend: &shared.store,
        config,
        deadline: keyed.deadline,
        grpc: keyed.grpc,
        started_at,
    };
    let result = run.handle(tx, Some(record), handler, parts, bytes).await;
    if let Ok(response) = &result {
        telemetry::answered(&span, response.status());
    }
    result
}

fn inner_call<S, R>(mut inner: S, req: R) -> S::Future
where
    S: Service<R>,
{
    inner.call(req)
}

async fn run_unkeyed<S, B, RB>(
    shared: Arc<Shared<PostgresTransactional>>,
    deadline: Option<Deadline>,
    inner: S,
    req: Request<MaybeBuffered<B>>,
) -> Result<Response<MaybeBuffered<RB>>, S::Error>
where
    S: Handler<B, RB>,
    B: RequestBody,
    RB: ResponseBody,
{
    let started_at = Instant::now();
    let config = &shared.config;
    let begun = with_timeout(config.store_timeout, async {
        begin(&shared.store.pool, None)
            .await
            .map_err(pg_error("cannot begin a transaction"))
    })
    .await;
    let tx = match begun {
        Ok(tx) => tx,
        Err(e) => return Ok(unavailable(&e)),
    };
    let run = Run {
        backend: &shared.store,
        config,
        deadline,
        grpc: false,
        started_at,
    };
    let (parts, body) = req.into_parts();
    run.handle_with_body(
        tx,
        None,
        |req| tower_resend::deadline::carry(inner_call(inner, req)),
        parts,
        body,
    )
    .await
}

/// The key's record, for a keyed request.
struct Record<'a> {
    scope: &'a str,
    key: &'a str,
    /// The token the claim was written with: the record's write checks it.
    token: &'a str,
}

/// What the end of a request under a transaction needs.
struct Run<'a> {
    backend: &'a PostgresTransactional,
    config: &'a super::layer::Config,
    deadline: Option<Deadline>,
    grpc: bool,
    started_at: Instant,
}

impl Run<'_> {
    /// Runs the handler on a buffered body, in `tx`.
    async fn handle<B, RB, E, F, Fut>(
        &self,
        tx: Transaction<'static, Postgres>,
        record: Option<Record<'_>>,
        handler: F,
        parts: http::request::Parts,
        bytes: Bytes,
    ) -> Result<Response<MaybeBuffered<RB>>, E>
    where
        F: FnOnce(Request<MaybeBuffered<B>>) -> Fut,
        Fut: Future<Output = Result<Response<RB>, E>> + Send,
        RB: Body<Data = Bytes> + Send + Unpin + 'static,
        RB::Error: Into<BoxError>,
    {
        self.handle_with_body(tx, record, handler, parts, MaybeBuffered::full(bytes))
            .await
    }

    /// Runs the handler in `tx`, and commits or rolls back by the rules.
    async fn handle_with_body<B, RB, E, F, Fut>(
        &self,
        tx: Transaction<'static, Postgres>,
        record: Option<Record<'_>>,
        handler: F,
        mut parts: http::request::Parts,
        body: MaybeBuffered<B>,
    ) -> Result<Response<MaybeBuffered<RB>>, E>
    where
        F: FnOnce(Request<MaybeBuffered<B>>) -> Fut,
        Fut: Future<Output = Result<Response<RB>, E>> + Send,
        RB: Body<Data = Bytes> + Send + Unpin + 'static,
        RB::Error: Into<BoxError>,
    {
        // From here on the work is the layer's: a caller that goes away does
        // not cancel it.
        handler_started();
        let slot: Slot = Arc::new(Mutex::new(Some(tx)));
        parts
            .extensions
            .insert(HandlerTransaction(Arc::clone(&slot)));
        let ledger = tower_resend::deadline::current_ledger();
        let req = Request::from_parts(parts, body);
        let ended = Cut::new(self.deadline, ledger.as_ref(), handler(req)).await;
        // The transaction comes back: the handler has ended, and its guard
        // with it (a guard it let escape is waited for, for a while).
        let tx = match with_timeout(self.config.store_timeout, async {
            Ok::<_, StoreError>(slot.lock().await.take())
        })
        .await
        {
            Ok(Some(tx)) => tx,
            _ => {
                tracing::error!("the handler's transaction is still in use after it ended: it is rolled back when let go");
                return Ok(rolled_back("transaction_in_use"));
            }
        };
        let end = match &ended {
            Cutting::Done(Ok(resp)) => Ended::Answered {
                status: resp.status(),
                nothing_done: resp.extensions().get::<NothingDone>().is_some(),
            },
            Cutting::Done(Err(_)) => Ended::Failed,
            Cutting::Panicked => Ended::Panicked,
            Cutting::DeadlineCut(_) => Ended::DeadlineCut,
        };
        let mut result = match (rules::on_end(end), ended) {
            (OnEnd::StoreResponse, Cutting::Done(result)) => result,
            (OnEnd::Release, Cutting::Done(result)) => {
                // Nothing was done: nor is anything kept.
                let _ = tx.rollback().await;
                return result.map(|resp| resp.map(MaybeBuffered::inner));
            }
            (_, ended) => {
                // Rolled back: the work is undone with the claim, so the
                // caller may send it again (with the same key).
                let _ = tx.rollback().await;
                return match ended {
                    Cutting::Done(Err(e)) => Err(e),
                    Cutting::DeadlineCut(cut) => Ok(answer(deadline_response(
                        self.started_at,
                        self.deadline,
                        self.grpc,
                        cut,
                    ))),
                    Cutting::Panicked => Ok(rolled_back("handler_panicked")),
                    Cutting::Done(Ok(_)) => Ok(rolled_back("handler_failed")),
                };
            }
        };
        let Ok(resp) = &mut result else {
            return result.map(|resp| resp.map(MaybeBuffered::inner));
        };
        let status = resp.status();
        let headers = stored_headers(resp.headers(), &self.config.per_caller);
        let read = Cut::new(
            self.deadline,
            ledger.as_ref(),
            read_capped(resp.body_mut(), self.config.response_cap),
        )
        .await;
        let (bytes, whole) = match read {
            Cutting::Done(Ok(read)) => read,
            Cutting::Done(Err(e)) => {
                tracing::warn!(error = %e, "a response's body failed after its head: its transaction is rolled back");
                let _ = tx.rollback().await;
                return Ok(rolled_back("response_lost"));
            }
            Cutting::Panicked => {
                let _ = tx.rollback().await;
                return Ok(rolled_back("handler_panicked"));
            }
            Cutting::DeadlineCut(cut) => {
                let _ = tx.rollback().await;
                return Ok(answer(deadline_response(
                    self.started_at,
                    self.deadline,
                    self.grpc,
                    cut,
                )));
            }
        };
        // The record's commit is the store call that completes a keyed
        // request.
        let metrics = self.config.stats.metrics();
        let timing = (record.is_some() && metrics.is_on()).then(Instant::now);
        let committed = self
            .commit(tx, record.as_ref(), status, headers, &bytes, whole)
            .await;
        if let Some(start) = timing {
            let reached = !matches!(committed, Commit::Unknown(_));
            metrics.store_call(Op::Complete, start.elapsed(), reached);
        }
        match committed {
            Commit::Done => {}
            Commit::RolledBack(e) => {
                tracing::error!(error = %e, "the response of a keyed request could not be recorded: its transaction is rolled back");
                return Ok(rolled_back("handler_failed"));
            }
            Commit::Unknown(e) => {
                tracing::error!(error = %e, "the transaction of a keyed request may not have committed");
                return Ok(retry_later(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "commit_outcome_unknown",
                    "the operation's transaction may or may not have committed; send it again with the same key: it is replayed if it did",
                    Duration::from_secs(1),
                ));
            }
        }
        result.map(|resp| {
            let (parts, body) = resp.into_parts();
            if whole {
                Response::from_parts(parts, MaybeBuffered::full(bytes))
            } else {
                Response::from_parts(parts, MaybeBuffered::chain(bytes, body))
            }
        })
    }

    /// Writes the key's record (if any) in `tx`, and commits: the work and
    /// its record together. A response of at most [`ONE_ROUND_TRIP_RECORD`]
    /// encoded bytes is recorded and committed in one round trip; a larger
    /// one by a bound UPDATE, then the COMMIT.
    async fn commit(
        &self,
        mut tx: Transaction<'static, Postgres>,
        record: Option<&Record<'_>>,
        status: StatusCode,
        headers: http::HeaderMap,
        bytes: &Bytes,
        whole: bool,
    ) -> Commit {
        let Some(record) = record else {
            return committed(tx).await;
        };
        let done = StoredResponse {
            status,
            headers,
            body: if whole { bytes.clone() } else { Bytes::new() },
            body_omitted: !whole,
        }
        .encode();
        if done.len() <= ONE_ROUND_TRIP_RECORD && self.backend.record_fn_there(&mut tx).await {
            let sql =
                self.backend
                    .sql
                    .record_then_commit(record.scope, record.key, record.token, &done);
            if let Some(sql) = sql {
                return record_then_commit(self.backend, tx, record.key, &sql).await;
            }
        }
        tracing::trace!(
            key = record.key,
            bytes = done.len(),
            "idempotent response recorded, then committed"
        );
        let written = self
            .backend
            .query(&self.backend.sql.record)
            .bind(record.scope)
            .bind(record.key)
            .bind(record.token)
            .bind(done)
            .execute(&mut *tx)
            .await
            .map(|done| done.rows_affected());
        // No COMMIT is sent unless the record was written.
        match written {
            Ok(1) => committed(tx).await,
            Ok(_) => {
                let _ = tx.rollback().await;
                Commit::RolledBack(StoreError::new(GONE))
            }
            Err(e) => {
                let _ = tx.rollback().await;
                Commit::Unknown(pg_error("storing the response failed")(e))
            }
        }
    }
}

/// The largest response (encoded) recorded in the COMMIT's own round trip:
/// 64 KiB. It goes into the query as text (twice as long, in hex); a larger
/// one is bound as a parameter, in a round trip of its own.
const ONE_ROUND_TRIP_RECORD: usize = 64 * 1024;

/// How the end of a request's transaction went.
enum Commit {
    Done,
    /// Nothing was committed: the claimed row was gone when the record was
    /// to be written (changed or deleted through the handler's own
    /// transaction, as nothing else can see it), and the transaction is
    /// rolled back.
    RolledBack(StoreError),
    /// The commit may or may not have happened: it, or the record before
    /// it, failed (the connection lost during it, say).
    Unknown(StoreError),
}

const GONE: &str = "the claimed row is gone: changed or deleted through the handler's transaction";

/// `tx` committed.
async fn committed(tx: Transaction<'static, Postgres>) -> Commit {
    match tx.commit().await {
        Ok(()) => Commit::Done,
        Err(e) => Commit::Unknown(pg_error("commit failed")(e)),
    }
}

/// The record and the COMMIT in one round trip: `sql` is
/// [`record_then_commit`](crate::store::postgres::Sql::record_then_commit)'s,
/// whose COMMIT runs only if its record function wrote the claimed row.
async fn record_then_commit(
    backend: &PostgresTransactional,
    mut tx: Transaction<'static, Postgres>,
    key: &str,
    sql: &str,
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
        // The record function failed, and said why: the rest of the query
        // (the COMMIT) was skipped.
        Err(sqlx::Error::Database(e))
            if e.code().as_deref() == Some(ROW_GONE_CODE) && e.message() == ROW_GONE =>
        {
            let _ = tx.rollback().await;
            Commit::RolledBack(StoreError::new(GONE))
        }
        // The function is gone (dropped since it was looked up): the first
        // statement failed, and the COMMIT was skipped as well.
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42883") => {
            backend.record_fn_missing();
            let _ = tx.rollback().await;
            Commit::RolledBack(StoreError::with_source(
                "the record function is missing",
                sqlx::Error::Database(e),
            ))
        }
        // Any other failure may have come from the COMMIT or after it.
        Err(e) => Commit::Unknown(pg_error("storing the response and committing failed")(e)),
    }
}

/// A 500 of the layer's own for an operation rolled back: nothing of it
/// was committed, so it may be sent again.
fn rolled_back<B>(code: &'static str) -> Response<MaybeBuffered<B>> {
    json_error(
        StatusCode::INTERNAL_SERVER_ERROR,
        code,
        "the operation failed, and its transaction was rolled back: nothing of it was committed, so it may be sent again (with the same key)",
    )
}

/// How a [`Cut`] future ended.
enum Cutting<T> {
    Done(T),
    Panicked,
    /// Cut by the deadline: where the time went, as of the cut (taken
    /// before the future is dropped, which ends the work it was doing).
    DeadlineCut(Snapshot),
}

pin_project_lite::pin_project! {
    /// `fut`, cut when the deadline runs out, its panic caught. `fut` is
    /// polled first, so an answer that is ready wins a tie with the clock;
    /// the timer is armed only once `fut` has waited.
    struct Cut<'a, F> {
        #[pin]
        fut: F,
        deadline: Option<Instant>,
        ledger: Option<&'a TimeLedger>,
        timer: Option<Pin<Box<Sleep>>>,
    }
}

impl<'a, F> Cut<'a, F> {
    fn new(deadline: Option<Deadline>, ledger: Option<&'a TimeLedger>, fut: F) -> Self {
        Self {
            fut,
            deadline: deadline.map(|d| d.instant()),
            ledger,
            timer: None,
        }
    }
}

impl<F: Future> Future for Cut<'_, F> {
    type Output = Cutting<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        match poll_catching(this.fut, cx) {
            Poll::Ready(Ok(out)) => return Poll::Ready(Cutting::Done(out)),
            Poll::Ready(Err(what)) => {
                tracing::error!(panic = %what, "a handler panicked: its transaction is rolled back");
                return Poll::Ready(Cutting::Panicked);
            }
            Poll::Pending => {}
        }
        let Some(deadline) = *this.deadline else {
            return Poll::Pending;
        };
        let timer = this
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Cutting::DeadlineCut(
                this.ledger.map(TimeLedger::snapshot).unwrap_or_default(),
            )),
            Poll::Pending => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower_resend::deadline::Source;

    /// A cut says what was running at the cut: the handler's upstream call,
    /// still in flight (its future not yet dropped).
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_cut_names_the_work_running_at_the_cut() {
        let ledger = TimeLedger::new();
        let deadline = Deadline::after(Duration::from_secs(1));
        let handler = async {
            let _call = ledger.start(Source::Upstream, "shipping".into());
            tokio::time::sleep(Duration::from_secs(60)).await;
        };
        let Cutting::DeadlineCut(cut) = Cut::new(Some(deadline), Some(&ledger), handler).await
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
}

//! Transactional idempotency on PostgreSQL: the key is claimed inside the
//! handler's own transaction, and the record commits with its work.

use std::sync::atomic::{AtomicU32, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::{Extensions, StatusCode};
use sqlx::postgres::PgPool;
use sqlx::{Postgres, Transaction};

use self::claim::{claim, wait_for, KeyRow};
use self::commit::commit;
use self::tx::{begin, TxCell};
pub use self::tx::{HandlerTransaction, IdempotentTx, NoTransaction, TxConnection};
use super::backend::{sealed::Sealed, Backend, Claimed, KeyClaim};
use super::config::Shared;
use super::rules::{Kept, Mode, Sqlstate};
use super::store_call::with_timeout;
use super::telemetry::Op;
use crate::store::postgres::sql::{migrate, migration_sql, pg_error, record_function_sql, Sql};
use crate::store::PostgresStore;
use crate::store::{LeaseState, LeaseToken, StoreError, StoredResponse};

mod claim;
mod commit;
mod tx;

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
/// transaction** (`&mut *tx` is a [`PgConnection`](sqlx::postgres::PgConnection)). Work done elsewhere
/// (another pool, an outbound call) is not rolled back with it; outbound
/// calls through a tower-resend stack with
/// [`idempotency_keys`](tower_resend::stack::StackBuilder::idempotency_keys) carry keys
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
/// - the end: a response is committed with its record, unless it says
///   nothing was done (it is marked [`NothingDone`](super::NothingDone), is
///   a 429, or a gRPC UNAVAILABLE) or it is a server error (a 5xx, or a
///   gRPC UNKNOWN, INTERNAL, DATA_LOSS, UNIMPLEMENTED or
///   DEADLINE_EXCEEDED): then the transaction rolls back, the database
///   undoes the work with the claim, and a retry with the same key runs
///   (brandur's atomic phases). A handler whose 5xx reports work that must
///   not run again (an effect outside the transaction) marks it
///   [`KeepResponse`](super::KeepResponse): it is committed and replayed.
///   A response of up to 64 KiB is recorded in the COMMIT's round trip, by
///   the table's record function (made by [`migrate`](Self::migrate)),
///   which fails unless it wrote the claimed row, so the COMMIT cannot run
///   without it; a larger one (or, without the function, any) by an UPDATE
///   of its own, then the COMMIT. A handler error, a panic, a body that
///   fails, the deadline, or a claim the handler deleted (or changed)
///   through its transaction: rolled back, and nothing is recorded (the
///   handler's error, a 500 of the layer's own, or the deadline's answer).
///   A statement of the handler's that failed (a unique violation, say)
///   aborts the transaction, which can then only roll back: the handler's
///   own answer to it (a 4xx or 5xx of its choosing) is the answer,
///   unkept. A success answered over an aborted transaction (or a COMMIT
///   the database refused) is answered by the failed statement's SQLSTATE,
///   which the transaction's executor ([`TxConnection`], `&mut *tx`) notes:
///   a violated constraint (class 23) by a final 422
///   ([`constraint_violation`](crate::problems#constraint_violation): the
///   same request fails the same way every time); a serialization failure
///   or a deadlock (40001, 40P01) by a 503 with `Retry-After: 1`
///   ([`transaction_conflict`](crate::problems#transaction_conflict): the
///   next try may pass); any other by a 500
///   ([`transaction_aborted`](crate::problems#transaction_aborted)). gRPC
///   alike: FAILED_PRECONDITION, UNAVAILABLE with a pushback, INTERNAL. The
///   key is free in every case. Without a key the same: the COMMIT is
///   checked, in its own round trip, since PostgreSQL answers the COMMIT of
///   an aborted transaction with a ROLLBACK and no error. Only a COMMIT whose outcome is unknown
///   (the connection lost during it) answers 503: retrying with the same
///   key is safe either way;
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
/// use axum::{http::StatusCode, routing::post, Router};
/// use tower_resend_server::{IdempotencyLayer, IdempotentTx, PostgresStore};
///
/// // A failed statement is answered with an error status (never a 200
/// // carrying the database's text): a 4xx or 5xx, which the layer rolls
/// // back, the key's claim with it.
/// async fn create_order(
///     mut tx: IdempotentTx,
///     body: String,
/// ) -> Result<String, (StatusCode, &'static str)> {
///     sqlx::query("INSERT INTO orders (body) VALUES ($1)")
///         .bind(&body)
///         .execute(&mut *tx)
///         .await
///         .map_err(|e| match e.as_database_error() {
///             Some(db) if db.is_unique_violation() => {
///                 (StatusCode::UNPROCESSABLE_ENTITY, "this order exists already")
///             }
///             _ => (StatusCode::INTERNAL_SERVER_ERROR, "the order could not be written"),
///         })?;
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
    /// record function (see [`migration_sql`](Self::migration_sql)) if it
    /// is not there as this version makes it. Safe to run from several
    /// processes at once, and at start-up while other instances work: what
    /// is there already is found in the catalog, and no lock is taken that
    /// their row writes would wait on. A failure's message carries the
    /// database's reason.
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
    pub(super) async fn record_fn_there(&self, tx: &mut Transaction<'static, Postgres>) -> bool {
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
    pub(super) fn record_fn_missing(&self) {
        self.record_fn.missed.store(0, Ordering::Relaxed);
        self.record_fn
            .state
            .store(RecordFn::MISSING, Ordering::Relaxed);
    }

    pub(super) fn query<'q>(
        &self,
        sql: &'q str,
    ) -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments> {
        sqlx::query(sql).persistent(self.prepared)
    }
}

impl PostgresStore {
    /// The same table, in transactional mode: the key is claimed inside the
    /// handler's own transaction, and the record commits with its work; see
    /// [`PostgresTransactional`].
    pub fn transactional(self) -> PostgresTransactional {
        let (pool, sql, prepared) = self.into_parts();
        PostgresTransactional {
            pool,
            sql,
            prepared,
            record_fn: Arc::default(),
        }
    }
}

impl Backend for PostgresTransactional {}

/// A key (or an unkeyed request) held by a transaction: begun with the
/// claim, lent to the handler, taken back, then committed with the record
/// or rolled back.
#[derive(Debug)]
// `pub` (in a private module) as the sealed `Backend`'s associated type:
// nameable nowhere outside the crate.
#[allow(unreachable_pub)]
pub struct HeldTx {
    /// The transaction while the layer holds it.
    tx: Option<Transaction<'static, Postgres>>,
    /// Where the handler borrows it from.
    slot: TxCell,
    /// The key's record, for a keyed request.
    record: Option<Record>,
    /// What the SQLSTATE of the handler's last failed statement says, once
    /// the transaction is taken back.
    failed: Option<Sqlstate>,
}

/// The key's row: what the record's write finds it by.
#[derive(Debug)]
pub(super) struct Record {
    pub(super) scope: String,
    pub(super) key: String,
    /// The token the claim was written with: the record's write checks it.
    pub(super) token: String,
}

impl HeldTx {
    fn new(tx: Option<Transaction<'static, Postgres>>, record: Option<Record>) -> Self {
        Self {
            tx,
            slot: TxCell::default(),
            record,
            failed: None,
        }
    }
}

// The sealed trait names crate-private types.
#[allow(private_interfaces)]
impl Sealed for PostgresTransactional {
    const MODE: Mode = Mode::Transaction;
    type Hold = HeldTx;

    async fn claim(shared: &Arc<Shared<Self>>, c: &KeyClaim<'_>) -> Claimed<HeldTx> {
        let config = &shared.config;
        let token = LeaseToken::random().to_string();
        let row = KeyRow {
            scope: c.scope,
            key: c.key.as_str(),
            token: &token,
            fingerprint: c.fingerprint,
        };
        // The claim is the store call that begins a keyed request.
        let metrics = config.stats.metrics();
        let start = metrics.is_on().then(tokio::time::Instant::now);
        let wait = wait_for(config, c.deadline);
        let (found, tx) = claim(&shared.store, config, &row, wait).await;
        if let Some(start) = start {
            metrics.store_call(Op::Begin, start.elapsed(), found.is_ok());
        }
        let record = Record {
            scope: c.scope.to_string(),
            key: c.key.as_str().to_owned(),
            token,
        };
        Claimed {
            found,
            hold: HeldTx::new(tx, Some(record)),
        }
    }

    async fn transact(shared: &Arc<Shared<Self>>) -> Result<HeldTx, StoreError> {
        let begun = with_timeout(shared.config.store_timeout, async {
            begin(&shared.store.pool, None)
                .await
                .map_err(pg_error("cannot begin a transaction"))
        })
        .await?;
        Ok(HeldTx::new(Some(begun), None))
    }

    fn start(hold: &mut HeldTx, extensions: &mut Extensions) {
        // (A fresh slot's lock is free: `try_lock` cannot fail here.)
        if let Ok(mut lent) = hold.slot.try_lock() {
            *lent = hold.tx.take().map(TxConnection::new);
        }
        extensions.insert(HandlerTransaction(Arc::clone(&hold.slot)));
    }

    fn renew_every(_: &HeldTx) -> Option<Duration> {
        // The open transaction holds the key: nothing to renew.
        None
    }

    async fn renew(_: &Arc<Shared<Self>>, _: &HeldTx) -> Result<LeaseState, StoreError> {
        Ok(LeaseState::Held)
    }

    async fn take_back(shared: &Arc<Shared<Self>>, hold: &mut HeldTx) -> bool {
        // The handler has ended, and its guard with it; a guard it let
        // escape is waited for, for a while.
        let taken = with_timeout(shared.config.store_timeout, async {
            Ok::<_, StoreError>(hold.slot.lock().await.take())
        })
        .await;
        match taken {
            Ok(Some(lent)) => {
                let (tx, failed) = lent.into_parts();
                hold.tx = Some(tx);
                hold.failed = failed;
                true
            }
            _ => false,
        }
    }

    async fn keep(
        shared: &Arc<Shared<Self>>,
        hold: &mut HeldTx,
        record: &StoredResponse,
        status: StatusCode,
    ) -> Kept {
        let Some(tx) = hold.tx.take() else {
            return Kept::Committed(super::rules::Commit::Refused, status);
        };
        // The record's commit is the store call that completes a keyed
        // request.
        let metrics = shared.config.stats.metrics();
        let start = (hold.record.is_some() && metrics.is_on()).then(tokio::time::Instant::now);
        let committed = commit(&shared.store, tx, hold.record.as_ref(), record, hold.failed).await;
        if let Some(start) = start {
            let reached = committed != super::rules::Commit::Unknown;
            metrics.store_call(Op::Complete, start.elapsed(), reached);
        }
        Kept::Committed(committed, status)
    }

    fn hold(_: &Arc<Shared<Self>>, _: HeldTx, _: StoredResponse) {
        // (Never asked: a transaction's end is committed or not, never held.)
        tracing::error!("a transaction's record cannot be held for later");
    }

    async fn release(_: &Arc<Shared<Self>>, hold: HeldTx) {
        if let Some(tx) = hold.tx {
            let _ = tx.rollback().await;
        }
    }
}

//! Idempotency records in PostgreSQL, on the application's own sqlx pool.

use std::fmt;
use std::sync::Arc;

use sqlx::postgres::{PgPool, PgRow};
use sqlx::{Postgres, Row};

use self::sql::{found, migrate, migration_sql, millis, pg_error, valid_table, Sql};
use super::{Begin, Claim, LeaseState, Store, StoreError, StoredResponse, Ttl};

pub(crate) mod sql;

/// The default table of a [`PostgresStore`]: `resend_idempotency`.
pub const DEFAULT_TABLE: &str = "resend_idempotency";

/// Idempotency records in PostgreSQL (feature `postgres`), on the
/// application's own [sqlx](https://docs.rs/sqlx) [`PgPool`]: TLS, pool size
/// and timeouts are the pool's.
///
/// One table, created by [`migrate`](Self::migrate) (or by your own
/// migrations, from [`migration_sql`](Self::migration_sql)), with a primary
/// key on (scope, key). `INSERT ... ON CONFLICT DO UPDATE ... WHERE expired`
/// decides who runs: of any number of concurrent requests with one key, the
/// database constraint lets exactly one insert (or take over an expired
/// row). A lease and a finished record are the same row; `expires_at` ends
/// either. Expired rows are taken over in place;
/// [`purge_expired`](Self::purge_expired) deletes the rest (run it from a
/// periodic job; an index on `expires_at` serves it).
///
/// Each keyed request costs two commits of its own (the lease, then the
/// response). [`transactional`](Self::transactional) puts the record in the
/// handler's own transaction instead: no commit of its own, and no window
/// between the work and its record.
///
/// While the database cannot be reached, requests with a key get 503.
///
/// ```no_run
/// use tower_resend_server::{IdempotencyLayer, PostgresStore};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = sqlx::PgPool::connect("postgres://app@db/app?sslmode=prefer").await?;
/// let store = PostgresStore::new(pool);
/// store.migrate().await?;
/// let layer = IdempotencyLayer::new(store);
/// # let _ = layer;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PostgresStore {
    pool: PgPool,
    sql: Arc<Sql>,
    prepared: bool,
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("table", &self.sql.table)
            .field("prepared", &self.prepared)
            .finish_non_exhaustive()
    }
}

impl PostgresStore {
    /// A store on `pool`, in the table [`DEFAULT_TABLE`].
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            sql: Arc::new(Sql::new(DEFAULT_TABLE)),
            prepared: true,
        }
    }

    /// A store on `pool`, in `table`: an SQL identifier (letters, digits,
    /// `_`; optionally `schema.table`), or an error saying it is not one.
    pub fn with_table(pool: PgPool, table: &str) -> Result<Self, StoreError> {
        if !valid_table(table) {
            return Err(StoreError::new(format!(
                "invalid table name {table:?}: letters, digits and `_` only, optionally schema.table"
            )));
        }
        Ok(Self {
            pool,
            sql: Arc::new(Sql::new(table)),
            prepared: true,
        })
    }

    /// Whether the store's statements are prepared once per connection
    /// (named prepared statements, cached by sqlx). Turn it off behind
    /// PgBouncer in transaction mode, which cannot keep named statements
    /// across transactions: each statement is then parsed where it runs.
    /// Default: on.
    #[must_use]
    pub fn prepared_statements(mut self, on: bool) -> Self {
        self.prepared = on;
        self
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The table.
    pub fn table(&self) -> &str {
        &self.sql.table
    }

    /// The table's definition and the index that serves
    /// [`purge_expired`](Self::purge_expired), as SQL: put it in a
    /// migration of your own (a sqlx migration file, say) rather than call
    /// [`migrate`](Self::migrate) at start-up. Each statement is
    /// `IF NOT EXISTS`.
    pub fn migration_sql(&self) -> String {
        migration_sql(&self.sql.table)
    }

    /// Creates the table and its index if they do not exist. Safe to run
    /// from several processes at once. A failure's message carries the
    /// database's reason.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        migrate(&self.pool, &self.sql.table, false).await
    }

    /// Deletes expired records and leases; returns how many.
    pub async fn purge_expired(&self) -> Result<u64, StoreError> {
        let sql = format!(
            "DELETE FROM {} WHERE expires_at <= clock_timestamp()",
            self.sql.table
        );
        let done = sqlx::query(&sql)
            .persistent(false)
            .execute(&self.pool)
            .await
            .map_err(pg_error("purge failed"))?;
        Ok(done.rows_affected())
    }

    /// The pool, the statements and whether they are prepared: what the
    /// transactional mode is made of
    /// ([`PostgresStore::transactional`](crate::PostgresStore::transactional)).
    pub(crate) fn into_parts(self) -> (PgPool, Arc<Sql>, bool) {
        (self.pool, self.sql, self.prepared)
    }
}

/// What a `complete` found: a row written, or none (another holder's).
fn held(row: Option<PgRow>) -> LeaseState {
    if row.is_some() {
        LeaseState::Held
    } else {
        LeaseState::Lost
    }
}

/// What a `renew` found: the lease extended (`done` false), the claim's own
/// finished record (`done` true), or another holder's (no row).
fn renewed(row: Option<PgRow>) -> Result<LeaseState, StoreError> {
    let Some(row) = row else {
        return Ok(LeaseState::Lost);
    };
    let done: bool = row
        .try_get(0)
        .map_err(|e| StoreError::with_source("unreadable renewal in PostgreSQL", e))?;
    Ok(if done {
        LeaseState::Completed
    } else {
        LeaseState::Held
    })
}

impl PostgresStore {
    fn query<'q>(
        &self,
        sql: &'q str,
    ) -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments> {
        sqlx::query(sql).persistent(self.prepared)
    }
}

impl Store for PostgresStore {
    async fn begin(&self, claim: &Claim<'_>, ttl: Ttl) -> Result<Begin, StoreError> {
        let key = &claim.key;
        let token = claim.token.to_string();
        // A row released or expired between the INSERT and the SELECT is
        // gone: try again (a few times at most).
        for _ in 0..3 {
            let inserted = self
                .query(&self.sql.begin)
                .bind(key.scope)
                .bind(key.key)
                .bind(&claim.fingerprint.0[..])
                .bind(&token)
                .bind(millis(ttl.lease))
                .fetch_optional(&self.pool)
                .await
                .map_err(pg_error("lease failed"))?;
            if inserted.is_some() {
                return Ok(Begin::Acquired);
            }
            let row = self
                .query(&self.sql.select)
                .bind(key.scope)
                .bind(key.key)
                .fetch_optional(&self.pool)
                .await
                .map_err(pg_error("read failed"))?;
            if let Some(begin) = found(row)? {
                return Ok(begin);
            }
        }
        Err(StoreError::new("PostgreSQL record kept vanishing"))
    }

    async fn renew(&self, claim: &Claim<'_>, ttl: Ttl) -> Result<LeaseState, StoreError> {
        let row = self
            .query(&self.sql.renew)
            .bind(claim.key.scope)
            .bind(claim.key.key)
            .bind(&claim.fingerprint.0[..])
            .bind(claim.token.to_string())
            .bind(millis(ttl.lease))
            .fetch_optional(&self.pool)
            .await
            .map_err(pg_error("lease renewal failed"))?;
        renewed(row)
    }

    async fn complete(
        &self,
        claim: &Claim<'_>,
        response: &StoredResponse,
        ttl: Ttl,
    ) -> Result<LeaseState, StoreError> {
        let row = self
            .query(&self.sql.complete)
            .bind(claim.key.scope)
            .bind(claim.key.key)
            .bind(&claim.fingerprint.0[..])
            .bind(claim.token.to_string())
            .bind(millis(ttl.record))
            .bind(response.encode())
            .fetch_optional(&self.pool)
            .await
            .map_err(pg_error("storing the response failed"))?;
        Ok(held(row))
    }

    async fn release(&self, claim: &Claim<'_>) -> Result<(), StoreError> {
        self.query(&self.sql.release)
            .bind(claim.key.scope)
            .bind(claim.key.key)
            .bind(claim.token.to_string())
            .execute(&self.pool)
            .await
            .map_err(pg_error("release failed"))?;
        Ok(())
    }
}

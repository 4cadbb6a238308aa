//! Idempotency records in PostgreSQL, on the application's own sqlx pool.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgPool, PgRow};
use sqlx::{Executor, Postgres, Row};

use super::{Begin, Claim, Fingerprint, LeaseState, Store, StoreError, StoredResponse, Ttl};

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
/// use resend_server::{IdempotencyLayer, PostgresStore};
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

/// The statements, made once for the table.
pub(crate) struct Sql {
    pub(crate) table: String,
    pub(crate) begin: String,
    pub(crate) select: String,
    renew: String,
    pub(crate) complete: String,
    release: String,
    /// The transactional mode's record: the claimed row, made final in
    /// the same transaction. Its indexed columns (the key, `expires_at`,
    /// set at the claim) do not change, so PostgreSQL can update it in
    /// place (a HOT update, no new index entries).
    pub(crate) record: String,
}

impl Sql {
    fn new(t: &str) -> Self {
        Self {
            table: t.to_owned(),
            begin: format!(
                "INSERT INTO {t} AS r (scope, key, fingerprint, token, done, expires_at, response)
                 VALUES ($1, $2, $3, $4, false, clock_timestamp() + $5::bigint * interval '1 millisecond', NULL)
                 ON CONFLICT (scope, key) DO UPDATE
                   SET fingerprint = EXCLUDED.fingerprint, token = EXCLUDED.token, done = false,
                       expires_at = EXCLUDED.expires_at, response = NULL
                   WHERE r.expires_at <= clock_timestamp()
                 RETURNING 1"
            ),
            select: format!(
                "SELECT fingerprint, done, response FROM {t}
                 WHERE scope = $1 AND key = $2 AND expires_at > clock_timestamp()"
            ),
            // A renewal or completion whose row is gone (purged after it
            // expired unrenewed) writes it anew; one whose row is another
            // holder's writes nothing and returns no row. A finished row
            // keeps its token, so a holder's `complete` again (its first
            // answer was lost) finds its own row.
            renew: format!(
                "INSERT INTO {t} AS r (scope, key, fingerprint, token, done, expires_at, response)
                 VALUES ($1, $2, $3, $4, false, clock_timestamp() + $5::bigint * interval '1 millisecond', NULL)
                 ON CONFLICT (scope, key) DO UPDATE SET expires_at = EXCLUDED.expires_at
                   WHERE r.token = EXCLUDED.token AND NOT r.done
                 RETURNING 1"
            ),
            complete: format!(
                "INSERT INTO {t} AS r (scope, key, fingerprint, token, done, expires_at, response)
                 VALUES ($1, $2, $3, $4, true, clock_timestamp() + $5::bigint * interval '1 millisecond', $6)
                 ON CONFLICT (scope, key) DO UPDATE
                   SET done = true, response = EXCLUDED.response, expires_at = EXCLUDED.expires_at
                   WHERE r.token = EXCLUDED.token
                 RETURNING 1"
            ),
            release: format!(
                "DELETE FROM {t} WHERE scope = $1 AND key = $2 AND token = $3 AND NOT done"
            ),
            record: format!(
                "UPDATE {t} SET done = true, response = $4
                 WHERE scope = $1 AND key = $2 AND token = $3"
            ),
        }
    }
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("table", &self.sql.table)
            .field("prepared", &self.prepared)
            .finish_non_exhaustive()
    }
}

pub(crate) fn pg_error(what: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |e| StoreError::with_source(what, e)
}

/// True for an SQL identifier (letters, digits, `_`; optionally
/// `schema.table`), so that a table name can be written into statements.
pub(crate) fn valid_table(name: &str) -> bool {
    let ident = |s: &str| {
        !s.is_empty()
            && s.len() <= 63
            && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
            && !s.as_bytes()[0].is_ascii_digit()
    };
    match name.split_once('.') {
        Some((schema, table)) => ident(schema) && ident(table),
        None => ident(name),
    }
}

/// The purge index of `table`: its name, and its name as `to_regclass`
/// finds it (in the table's schema).
fn index_name(table: &str) -> (String, String) {
    let bare = format!("{}_expires_at", table.replace('.', "_"));
    let found = match table.split_once('.') {
        Some((schema, _)) => format!("{schema}.{bare}"),
        None => bare.clone(),
    };
    (bare, found)
}

/// The table's definition and its purge index, for `table`: two
/// statements, each `IF NOT EXISTS`, so it can run any number of times.
/// Pages are left a fifth empty (`fillfactor`), so that a lease made final
/// (in either mode) is rewritten in place, a HOT update without new index
/// entries.
pub(crate) fn migration_sql(table: &str) -> String {
    let (index, _) = index_name(table);
    format!(
        "CREATE TABLE IF NOT EXISTS {table} (
    scope text NOT NULL,
    key text NOT NULL,
    fingerprint bytea NOT NULL,
    token text,
    done boolean NOT NULL DEFAULT false,
    expires_at timestamptz NOT NULL,
    response bytea,
    PRIMARY KEY (scope, key)
) WITH (fillfactor = 80);
CREATE INDEX IF NOT EXISTS {index} ON {table} (expires_at);
"
    )
}

/// Runs [`migration_sql`] on `pool`. Safe to run from several processes
/// at once.
pub(crate) async fn migrate(pool: &PgPool, table: &str) -> Result<(), StoreError> {
    let sql = migration_sql(table);
    match pool.execute(sqlx::raw_sql(&sql)).await {
        Ok(_) => Ok(()),
        Err(e) => {
            // Two processes creating the table at once: one of them loses
            // the race on the catalog, and the table is there all the same.
            let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
                .bind(table)
                .fetch_one(pool)
                .await
                .unwrap_or(false);
            let indexed: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
                .bind(index_name(table).1)
                .fetch_one(pool)
                .await
                .unwrap_or(false);
            if exists && indexed {
                Ok(())
            } else {
                Err(StoreError::with_source("migration failed", e))
            }
        }
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
        migrate(&self.pool, &self.sql.table).await
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

    /// The same table, in transactional mode: the key is claimed inside the
    /// handler's own transaction, and the record commits with its work; see
    /// [`PostgresTransactional`](crate::PostgresTransactional).
    pub fn transactional(self) -> crate::PostgresTransactional {
        crate::PostgresTransactional::from_store(self.pool, self.sql, self.prepared)
    }
}

pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX).max(1)
}

/// What a `begin` that did not insert finds: the live row's state, or
/// `None` when it vanished meanwhile.
pub(crate) fn found(row: Option<PgRow>) -> Result<Option<Begin>, StoreError> {
    let Some(row) = row else { return Ok(None) };
    let bad = |e: sqlx::Error| StoreError::with_source("unreadable record in PostgreSQL", e);
    let fp: Vec<u8> = row.try_get(0).map_err(bad)?;
    let fingerprint = Fingerprint(
        fp.try_into()
            .map_err(|_| StoreError::new("unreadable record in PostgreSQL: fingerprint"))?,
    );
    let done: bool = row.try_get(1).map_err(bad)?;
    if !done {
        return Ok(Some(Begin::InProgress { fingerprint }));
    }
    let bytes: Vec<u8> = row.try_get(2).map_err(bad)?;
    let response = StoredResponse::decode(&bytes)
        .ok_or_else(|| StoreError::new("unreadable record in PostgreSQL: response"))?;
    Ok(Some(Begin::Completed {
        fingerprint,
        response,
    }))
}

fn held(row: Option<PgRow>) -> LeaseState {
    if row.is_some() {
        LeaseState::Held
    } else {
        LeaseState::Lost
    }
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
        Ok(held(row))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_are_identifiers() {
        assert!(valid_table("resend_idempotency"));
        assert!(valid_table("app.idem_2"));
        for bad in ["", "1abc", "a;drop table x", "a b", "a.b.c", "\"x\""] {
            assert!(!valid_table(bad), "{bad}");
        }
    }

    #[test]
    fn the_migration_makes_the_table_and_its_purge_index() {
        let sql = migration_sql("app.idem");
        assert!(sql.contains("CREATE TABLE IF NOT EXISTS app.idem ("));
        assert!(sql.contains("PRIMARY KEY (scope, key)"));
        assert!(
            sql.contains("CREATE INDEX IF NOT EXISTS app_idem_expires_at ON app.idem (expires_at)")
        );
    }
}

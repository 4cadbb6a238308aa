//! Idempotency records in PostgreSQL.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Mutex;
use tokio_postgres::{Client, NoTls, Statement};

use super::{Begin, Claim, Fingerprint, LeaseState, Store, StoreError, StoredResponse, Ttl};

/// The default table of a [`PostgresStore`]: `resend_idempotency`.
pub const DEFAULT_TABLE: &str = "resend_idempotency";

/// Idempotency records in PostgreSQL (feature `postgres`).
///
/// One table, created by [`migrate`](Self::migrate), with a primary key on
/// (scope, key). `INSERT ... ON CONFLICT DO UPDATE ... WHERE expired` decides
/// who runs: of any number of concurrent requests with one key, the database
/// constraint lets exactly one insert (or take over an expired row). A lease
/// and a finished record are the same row; `expires_at` ends either. Expired
/// rows are taken over in place; [`purge_expired`](Self::purge_expired)
/// deletes the rest (run it from a periodic job).
///
/// The connection (tokio-postgres, no TLS) is made on first use and remade
/// when it breaks; while the database cannot be reached, requests with a key
/// get 503.
///
/// ```no_run
/// use resend_server::{IdempotencyLayer, PostgresStore};
///
/// # async fn run() -> Result<(), resend_server::StoreError> {
/// let store = PostgresStore::new("host=127.0.0.1 user=postgres dbname=app", "idempotency")?;
/// store.migrate().await?;
/// let layer = IdempotencyLayer::new(store);
/// # let _ = layer;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PostgresStore {
    config: tokio_postgres::Config,
    table: Arc<str>,
    conns: Arc<[Mutex<Option<Arc<Conn>>>]>,
    next: Arc<std::sync::atomic::AtomicUsize>,
}

/// The default number of connections of a [`PostgresStore`]: 4. Each
/// commit waits for the log to reach disk; several connections let the
/// database commit several requests at once.
pub const DEFAULT_CONNECTIONS: usize = 4;

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("hosts", &self.config.get_hosts())
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

struct Conn {
    client: Client,
    begin: Statement,
    select: Statement,
    renew: Statement,
    complete: Statement,
    release: Statement,
}

fn pg_error(what: &'static str) -> impl FnOnce(tokio_postgres::Error) -> StoreError {
    move |e| StoreError::with_source(what, e)
}

fn valid_table(name: &str) -> bool {
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

impl PostgresStore {
    /// A store using `table`, on the database that `config` names (a
    /// libpq-style string such as `host=127.0.0.1 user=postgres dbname=app`,
    /// or a `postgresql://` URL). Only reads the configuration: the
    /// connection is made on first use. The table name must be an SQL
    /// identifier (letters, digits, `_`; optionally `schema.table`).
    pub fn new(config: &str, table: &str) -> Result<Self, StoreError> {
        let mut config: tokio_postgres::Config = config
            .parse()
            .map_err(pg_error("invalid PostgreSQL configuration"))?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(Duration::from_secs(1));
        }
        if !valid_table(table) {
            return Err(StoreError::new(format!("invalid table name {table:?}")));
        }
        Ok(Self {
            config,
            table: table.into(),
            conns: (0..DEFAULT_CONNECTIONS).map(|_| Mutex::new(None)).collect(),
            next: Arc::default(),
        })
    }

    /// Uses `n` connections (at least 1), made as they are first needed.
    /// Default [`DEFAULT_CONNECTIONS`] (4).
    #[must_use]
    pub fn connections(mut self, n: usize) -> Self {
        self.conns = (0..n.max(1)).map(|_| Mutex::new(None)).collect();
        self
    }

    /// The table's definition (`CREATE TABLE IF NOT EXISTS`).
    pub fn migration_sql(&self) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {t} (
                scope text NOT NULL,
                key text NOT NULL,
                fingerprint bytea NOT NULL,
                token text,
                done boolean NOT NULL DEFAULT false,
                expires_at timestamptz NOT NULL,
                response bytea,
                PRIMARY KEY (scope, key)
            )",
            t = self.table
        )
    }

    /// Creates the table if it does not exist. Safe to run from several
    /// processes at once.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let (client, connection) = self
            .config
            .connect(NoTls)
            .await
            .map_err(pg_error("cannot connect to PostgreSQL"))?;
        let task = tokio::spawn(connection);
        let created = client.batch_execute(&self.migration_sql()).await;
        let result = match created {
            Ok(()) => Ok(()),
            // Two processes creating the table at once: one of them loses
            // the race on the catalog, and the table is there all the same.
            Err(e) => {
                let exists = client
                    .query_one("SELECT to_regclass($1) IS NOT NULL", &[&&*self.table])
                    .await
                    .map(|row| row.get::<_, bool>(0))
                    .unwrap_or(false);
                if exists {
                    Ok(())
                } else {
                    Err(StoreError::with_source("migration failed", e))
                }
            }
        };
        drop(client);
        let _ = task.await;
        result
    }

    /// Deletes expired records and leases; returns how many.
    pub async fn purge_expired(&self) -> Result<u64, StoreError> {
        let conn = self.conn().await?;
        let sql = format!(
            "DELETE FROM {} WHERE expires_at <= clock_timestamp()",
            self.table
        );
        conn.client
            .execute(sql.as_str(), &[])
            .await
            .map_err(pg_error("purge failed"))
    }

    async fn conn(&self) -> Result<Arc<Conn>, StoreError> {
        let i = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % self.conns.len();
        let mut slot = self.conns[i].lock().await;
        if let Some(c) = slot.as_ref() {
            if !c.client.is_closed() {
                return Ok(c.clone());
            }
        }
        *slot = None;
        let (client, connection) = self
            .config
            .connect(NoTls)
            .await
            .map_err(pg_error("cannot connect to PostgreSQL"))?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::warn!(error = %e, "PostgreSQL connection of the idempotency store ended");
            }
        });
        let t = &self.table;
        let prepare = |sql: String| {
            let client = &client;
            async move { client.prepare(&sql).await }
        };
        let begin = prepare(format!(
            "INSERT INTO {t} AS r (scope, key, fingerprint, token, done, expires_at, response)
             VALUES ($1, $2, $3, $4, false, clock_timestamp() + $5::bigint * interval '1 millisecond', NULL)
             ON CONFLICT (scope, key) DO UPDATE
               SET fingerprint = EXCLUDED.fingerprint, token = EXCLUDED.token, done = false,
                   expires_at = EXCLUDED.expires_at, response = NULL
               WHERE r.expires_at <= clock_timestamp()
             RETURNING r.token"
        ))
        .await
        .map_err(pg_error("cannot prepare statements (was the table migrated?)"))?;
        let select = prepare(format!(
            "SELECT fingerprint, done, response FROM {t}
             WHERE scope = $1 AND key = $2 AND expires_at > clock_timestamp()"
        ))
        .await
        .map_err(pg_error("cannot prepare statements"))?;
        // A renewal or completion whose row is gone (purged after it
        // expired unrenewed) writes it anew; one whose row is another
        // holder's writes nothing and returns no row. A finished row keeps
        // its token, so a holder's `complete` again (its first answer was
        // lost) finds its own row.
        let renew = prepare(format!(
            "INSERT INTO {t} AS r (scope, key, fingerprint, token, done, expires_at, response)
             VALUES ($1, $2, $3, $4, false, clock_timestamp() + $5::bigint * interval '1 millisecond', NULL)
             ON CONFLICT (scope, key) DO UPDATE SET expires_at = EXCLUDED.expires_at
               WHERE r.token = EXCLUDED.token AND NOT r.done
             RETURNING 1"
        ))
        .await
        .map_err(pg_error("cannot prepare statements"))?;
        let complete = prepare(format!(
            "INSERT INTO {t} AS r (scope, key, fingerprint, token, done, expires_at, response)
             VALUES ($1, $2, $3, $6, true, clock_timestamp() + $5::bigint * interval '1 millisecond', $4)
             ON CONFLICT (scope, key) DO UPDATE
               SET done = true, response = EXCLUDED.response, expires_at = EXCLUDED.expires_at
               WHERE r.token = $6
             RETURNING 1"
        ))
        .await
        .map_err(pg_error("cannot prepare statements"))?;
        let release = prepare(format!(
            "DELETE FROM {t} WHERE scope = $1 AND key = $2 AND token = $3 AND NOT done"
        ))
        .await
        .map_err(pg_error("cannot prepare statements"))?;
        let conn = Arc::new(Conn {
            client,
            begin,
            select,
            renew,
            complete,
            release,
        });
        *slot = Some(conn.clone());
        Ok(conn)
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX).max(1)
}

fn held(row: Option<tokio_postgres::Row>) -> LeaseState {
    if row.is_some() {
        LeaseState::Held
    } else {
        LeaseState::Lost
    }
}

impl Store for PostgresStore {
    async fn begin(&self, claim: &Claim<'_>, ttl: Ttl) -> Result<Begin, StoreError> {
        let conn = self.conn().await?;
        let key = &claim.key;
        let fp: &[u8] = &claim.fingerprint.0;
        let lease = millis(ttl.lease);
        let token = claim.token.to_string();
        // A row released or expired between the INSERT and the SELECT
        // is gone: try again (a few times at most).
        for _ in 0..3 {
            let inserted = conn
                .client
                .query_opt(&conn.begin, &[&key.scope, &key.key, &fp, &token, &lease])
                .await
                .map_err(pg_error("lease failed"))?;
            if inserted.is_some() {
                return Ok(Begin::Acquired);
            }
            let row = conn
                .client
                .query_opt(&conn.select, &[&key.scope, &key.key])
                .await
                .map_err(pg_error("read failed"))?;
            let Some(row) = row else { continue };
            let bad = || StoreError::new("unreadable record in PostgreSQL");
            let fp: Vec<u8> = row.try_get(0).map_err(|_| bad())?;
            let fingerprint = Fingerprint(fp.try_into().map_err(|_| bad())?);
            let done: bool = row.try_get(1).map_err(|_| bad())?;
            if !done {
                return Ok(Begin::InProgress { fingerprint });
            }
            let bytes: Vec<u8> = row.try_get(2).map_err(|_| bad())?;
            let response = StoredResponse::decode(&bytes).ok_or_else(bad)?;
            return Ok(Begin::Completed {
                fingerprint,
                response,
            });
        }
        Err(StoreError::new("PostgreSQL record kept vanishing"))
    }

    async fn renew(&self, claim: &Claim<'_>, ttl: Ttl) -> Result<LeaseState, StoreError> {
        let conn = self.conn().await?;
        let (key, fp) = (&claim.key, &claim.fingerprint.0[..]);
        let token = claim.token.to_string();
        let row = conn
            .client
            .query_opt(
                &conn.renew,
                &[&key.scope, &key.key, &fp, &token, &millis(ttl.lease)],
            )
            .await
            .map_err(pg_error("lease renewal failed"))?;
        Ok(held(row))
    }

    fn complete(
        &self,
        claim: &Claim<'_>,
        response: &StoredResponse,
        ttl: Ttl,
    ) -> impl Future<Output = Result<LeaseState, StoreError>> + Send {
        let encoded = response.encode();
        let token = claim.token.to_string();
        let fingerprint = claim.fingerprint;
        let key = claim.key;
        async move {
            let conn = self.conn().await?;
            let fp: &[u8] = &fingerprint.0;
            let row = conn
                .client
                .query_opt(
                    &conn.complete,
                    &[
                        &key.scope,
                        &key.key,
                        &fp,
                        &encoded,
                        &millis(ttl.record),
                        &token,
                    ],
                )
                .await
                .map_err(pg_error("storing the response failed"))?;
            Ok(held(row))
        }
    }

    async fn release(&self, claim: &Claim<'_>) -> Result<(), StoreError> {
        let conn = self.conn().await?;
        let token = claim.token.to_string();
        conn.client
            .execute(&conn.release, &[&claim.key.scope, &claim.key.key, &token])
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
        assert!(PostgresStore::new("host=127.0.0.1", "x; --").is_err());
    }
}

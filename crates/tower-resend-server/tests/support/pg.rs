//! The tests' PostgreSQL: its URL, a pool on it, and a store's table made.
#![allow(dead_code, unreachable_pub, clippy::print_stderr)]

use std::time::Duration;

use sqlx::postgres::{PgPool, PgPoolOptions};

/// `RESEND_PG_URL`, or the local server: TLS when it offers it
/// (`sslmode=prefer`; the local server's certificate is self-signed).
pub fn url() -> String {
    std::env::var("RESEND_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test?sslmode=prefer".into())
}

/// True once `store`'s table is there (made within 5 s); false, with a
/// warning that the test is skipped, when PostgreSQL is unusable; a panic
/// then when `CI` is set.
pub async fn migrated(store: &tower_resend_server::PostgresStore) -> bool {
    let url = url();
    match tokio::time::timeout(Duration::from_secs(5), store.migrate()).await {
        Ok(Ok(())) => true,
        other => {
            assert!(
                std::env::var_os("CI").is_none(),
                "PostgreSQL at {url} is unusable ({other:?}), and CI is set"
            );
            eprintln!("WARNING: PostgreSQL at {url} is unusable ({other:?}): test SKIPPED");
            false
        }
    }
}

/// A pool on `url` of at most `size` connections, made as they are needed;
/// waiting for one is bounded.
pub fn pool(url: &str, size: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy(url)
        .expect("a PostgreSQL URL")
}

/// `pool`, its connections named `name` (`application_name`), so that a
/// test can find them in `pg_stat_activity`.
pub fn named_pool(url: &str, size: u32, name: &str) -> PgPool {
    use std::str::FromStr;
    let options = sqlx::postgres::PgConnectOptions::from_str(url)
        .expect("a PostgreSQL URL")
        .application_name(name);
    PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy_with(options)
}

/// How many of the connections named `name` sit idle inside a transaction
/// (an open one, or one a failed statement aborted) once their pool has had
/// a moment (up to a second) to take them back: a connection the pool
/// holds in that state hands its transaction to its next user.
pub async fn idle_in_transaction(pool: &PgPool, name: &str) -> i64 {
    let mut left = 0;
    for _ in 0..50 {
        left = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND state LIKE 'idle in transaction%'",
        )
        .bind(name)
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| {
            panic!("the pool handed out a connection left in a transaction: {e}")
        });
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    left
}

/// `url` with its port replaced by `port` (for a proxy in front).
pub fn with_port(url: &str, port: u16) -> String {
    let (head, rest) = url.split_once("@").expect("postgres://user@host:port/db");
    let (_, db) = rest.split_once('/').expect("postgres://user@host:port/db");
    format!("{head}@127.0.0.1:{port}/{db}")
}

/// How many rows of `table` have `value` in `column` (an effect a test's
/// handler wrote, a key's claim or record).
pub async fn count(pool: &PgPool, table: &str, column: &str, value: &str) -> i64 {
    sqlx::query_scalar(&format!("SELECT count(*) FROM {table} WHERE {column} = $1"))
        .bind(value)
        .fetch_one(pool)
        .await
        .expect("count the rows")
}

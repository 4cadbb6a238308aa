//! Every rule of the idempotency layer on the real PostgreSQL of this
//! machine (`RESEND_PG_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test?sslmode=prefer`), through an
//! sqlx pool that speaks TLS to it. The tests share one table and never meet: each uses its
//! own keys. Without PostgreSQL: skipped with a warning, or failed when `CI`
//! is set.
#![cfg(feature = "postgres")]
#![allow(clippy::print_stderr)]

mod common;
#[path = "support/pg.rs"]
mod pg;

use std::time::Duration;

use tokio::sync::OnceCell;
use tower_resend_server::PostgresStore;

const TABLE: &str = "resend_idempotency_test";

fn url() -> String {
    pg::url()
}

async fn store() -> Option<PostgresStore> {
    static MIGRATED: OnceCell<bool> = OnceCell::const_new();
    let url = url();
    let ok = *MIGRATED
        .get_or_init(|| async {
            let s = PostgresStore::with_table(pg::pool(&url, 4), TABLE).unwrap();
            match tokio::time::timeout(Duration::from_secs(5), s.migrate()).await {
                Ok(Ok(())) => true,
                Ok(Err(e)) if common::in_ci() => panic!("PostgreSQL at {url}: {e}, and CI is set"),
                Err(_) if common::in_ci() => {
                    panic!("PostgreSQL at {url} does not answer, and CI is set")
                }
                other => {
                    eprintln!("WARNING: PostgreSQL at {url} is unusable ({other:?}): test SKIPPED");
                    false
                }
            }
        })
        .await;
    ok.then(|| PostgresStore::with_table(pg::pool(&url, 8), TABLE).unwrap())
}

store_rules!((flavor = "multi_thread", worker_threads = 2), store());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_holder_cannot_touch_the_new_holders_lease() {
    if let Some(s) = store().await {
        common::a_stale_holder_cannot_touch_the_new_holders_lease(s, Duration::from_millis(300))
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_lease_is_taken_over_after_it_expires() {
    if let Some(s) = store().await {
        common::stale_lease_taken_over(s, Duration::from_millis(300)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_expire_after_their_ttl() {
    if let Some(s) = store().await {
        common::records_expire(s, Duration::from_millis(300)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_down_gives_503_and_runs_nothing() {
    let down = PostgresStore::with_table(pg::pool(&pg::with_port(&url(), 1), 2), TABLE).unwrap();
    common::store_down(down).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migration_is_idempotent_and_purge_runs() {
    if let Some(s) = store().await {
        s.migrate().await.unwrap();
        s.migrate().await.unwrap();
        s.purge_expired().await.unwrap();
    }
}

/// Issue 27: `migrate()` at start-up while another instance's handler holds
/// a transaction that wrote to the table must not wait for it (a
/// `CREATE INDEX IF NOT EXISTS` takes a SHARE lock before it looks, and
/// waits for every row writer): the schema is found in the catalog, and
/// keys claimed meanwhile are not held up either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrating_while_a_transaction_holds_a_row_takes_no_lock() {
    let Some(store) = store().await else { return };
    let pool = pg::pool(&url(), 4);
    let mut writer = pool.begin().await.unwrap();
    sqlx::query(&format!(
        "INSERT INTO {TABLE} (scope, key, fingerprint, token, done, expires_at) \
         VALUES ('s', $1, '\\x00', 't', false, clock_timestamp() + interval '1 minute')"
    ))
    .bind(common::unique("held-open"))
    .execute(&mut *writer)
    .await
    .unwrap();
    // With the writer's transaction open: no wait (the old migration waited
    // for the writer).
    let started = tokio::time::Instant::now();
    let migrated = tokio::time::timeout(Duration::from_secs(2), store.migrate()).await;
    assert!(
        matches!(migrated, Ok(Ok(()))),
        "{migrated:?} after {:?}",
        started.elapsed()
    );
    let transactional = PostgresStore::with_table(pg::pool(&url(), 2), TABLE)
        .unwrap()
        .transactional();
    let migrated = tokio::time::timeout(Duration::from_secs(2), transactional.migrate()).await;
    assert!(matches!(migrated, Ok(Ok(()))), "{migrated:?}");
    // A new key is claimed at once meanwhile.
    common::replay(store).await;
    writer.rollback().await.unwrap();
}

/// Issue 27: a store whose table was never made (`migrate()` forgotten)
/// says so, 503 `idempotency_store_not_set_up`, rather than that it cannot
/// be reached; nothing runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_table_says_the_store_is_not_set_up() {
    if store().await.is_none() {
        return;
    }
    let missing = PostgresStore::with_table(pg::pool(&url(), 2), "resend_never_migrated").unwrap();
    let h = common::Handler::default();
    let s = common::svc(&h, common::layer(missing.clone()));
    let r = common::call(&s, common::post(&common::unique("k"), "a"))
        .await
        .unwrap();
    assert_eq!(r.status(), http::StatusCode::SERVICE_UNAVAILABLE);
    let body = common::text(r).await;
    assert!(
        body.contains("\"error\":\"idempotency_store_not_set_up\""),
        "{body}"
    );
    assert!(body.contains("table is missing"), "{body}");
    assert_eq!(h.runs(), 0);
    // Likewise in the transactional mode.
    let s = common::svc(&h, common::layer(missing.transactional()));
    let r = common::call(&s, common::post(&common::unique("k"), "a"))
        .await
        .unwrap();
    assert_eq!(r.status(), http::StatusCode::SERVICE_UNAVAILABLE);
    let body = common::text(r).await;
    assert!(body.contains("idempotency_store_not_set_up"), "{body}");
    assert_eq!(h.runs(), 0);
}

/// A handler slower than its lease (1.6 s against 0.6 s, renewed), whose
/// caller gives up at 200 ms and retries: one run, 409s, then the replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_handler_keeps_its_lease() {
    if let Some(s) = store().await {
        common::a_slow_handler_keeps_its_lease(
            s,
            Duration::from_millis(1600),
            Duration::from_millis(600),
            Duration::from_millis(200),
        )
        .await;
    }
}

/// The store runs on the application's pool, TLS settings and all: with
/// `sslmode=prefer`, the pool's connections to the local server are
/// encrypted, and the store works over them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_with_tls_settings_is_accepted() {
    if store().await.is_none() {
        return;
    }
    let url = url();
    assert!(url.contains("sslmode=prefer"), "{url}");
    let pool = pg::pool(&url, 2);
    let tls: bool = sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(
        tls,
        "the local server offers TLS, and sslmode=prefer takes it"
    );
    let store = PostgresStore::with_table(pool, TABLE).unwrap();
    common::replay(store).await;
}

/// A migration that fails says why, in the database's words; a table name
/// that is not an identifier is refused before any SQL is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_migration_carries_the_database_reason() {
    if store().await.is_none() {
        return;
    }
    let store = PostgresStore::with_table(pg::pool(&url(), 1), "no_such_schema.idem").unwrap();
    let err = store.migrate().await.unwrap_err().to_string();
    assert!(
        err.contains("migration failed") && err.contains("no_such_schema"),
        "{err}"
    );
    let bad = PostgresStore::with_table(pg::pool(&url(), 1), "x; drop table y").unwrap_err();
    assert!(bad.to_string().contains("invalid table name"), "{bad}");
    // The migration's SQL is the table and its purge index.
    let sql = PostgresStore::new(pg::pool(&url(), 1)).migration_sql();
    assert!(sql.contains("CREATE INDEX IF NOT EXISTS resend_idempotency_expires_at"));
}

/// A lease row gone while its handler works (purged after it expired
/// unrenewed: the holder was paused past its lease) is written anew by the
/// holder's next renewal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lease_is_written_anew_by_its_renewal() {
    let Some(store) = store().await else { return };
    let pool = pg::pool(&url(), 2);
    common::a_lost_lease_is_written_anew_by_its_renewal(
        store,
        Duration::from_millis(600),
        async |scope: &str, key: &str| {
            let gone = sqlx::query(&format!(
                "DELETE FROM {TABLE} WHERE scope = $1 AND key = $2"
            ))
            .bind(scope)
            .bind(key)
            .execute(&pool)
            .await
            .unwrap();
            assert_eq!(gone.rows_affected(), 1);
        },
        async |scope: &str, key: &str| {
            let n: i64 = sqlx::query_scalar(&format!(
                "SELECT count(*) FROM {TABLE} WHERE scope = $1 AND key = $2"
            ))
            .bind(scope)
            .bind(key)
            .fetch_one(&pool)
            .await
            .unwrap();
            n == 1
        },
    )
    .await;
}

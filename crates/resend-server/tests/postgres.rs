//! Every rule of the idempotency layer on the real PostgreSQL of this
//! machine (`RESEND_PG_URL`, default `host=127.0.0.1 port=5432 user=postgres
//! dbname=test`). The tests share one table and never meet: each uses its
//! own keys. Without PostgreSQL: skipped with a warning, or failed when `CI`
//! is set.
#![cfg(feature = "postgres")]
#![allow(clippy::print_stderr)]

mod common;

use std::time::Duration;

use resend_server::PostgresStore;
use tokio::sync::OnceCell;

const TABLE: &str = "resend_idempotency_test";

fn url() -> String {
    std::env::var("RESEND_PG_URL")
        .unwrap_or_else(|_| "host=127.0.0.1 port=5432 user=postgres dbname=test".into())
}

async fn store() -> Option<PostgresStore> {
    static MIGRATED: OnceCell<bool> = OnceCell::const_new();
    let url = url();
    let ok = *MIGRATED
        .get_or_init(|| async {
            let s = PostgresStore::new(&url, TABLE).unwrap();
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
    ok.then(|| PostgresStore::new(&url, TABLE).unwrap())
}

store_rules!((flavor = "multi_thread", worker_threads = 2), store());

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
    let down =
        PostgresStore::new("host=127.0.0.1 port=1 user=postgres dbname=test", TABLE).unwrap();
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

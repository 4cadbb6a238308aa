//! Every rule of the idempotency layer on the real Redis of this machine
//! (`RESEND_REDIS_URL`, default `redis://127.0.0.1:6379`), twice: on a store
//! opened from the URL (its own connection manager), and, in
//! `on_the_applications_manager`, on the application's own
//! `ConnectionManager` (`RedisStore::new`). Each test uses its own key
//! prefix. Without Redis: skipped with a warning, or failed when `CI` is
//! set.
#![cfg(feature = "redis")]
#![allow(clippy::print_stderr)]

mod common;
#[path = "support/redis.rs"]
mod redis_server;

use std::time::Duration;

use redis_server::{reachable, url};
use tower_resend_server::RedisStore;

fn prefix() -> String {
    format!("resend-test:{}:", common::unique("redis"))
}

/// A store opened from the URL, on a connection manager of its own.
async fn store() -> Option<RedisStore> {
    let url = url();
    if !reachable(&url).await {
        return None;
    }
    Some(RedisStore::open(&url).unwrap().prefix(prefix()))
}

/// A store on a connection manager the test (the application) made.
async fn store_on_manager() -> Option<RedisStore> {
    let url = url();
    if !reachable(&url).await {
        return None;
    }
    let manager = redis::Client::open(url.as_str())
        .unwrap()
        .get_connection_manager()
        .await
        .unwrap();
    Some(RedisStore::new(manager).prefix(prefix()))
}

store_rules!((flavor = "multi_thread", worker_threads = 2), store());

/// The same rules on the application's own `ConnectionManager`.
mod on_the_applications_manager {
    use std::time::Duration;

    use super::{common, store_on_manager};
    use crate::store_rules;

    store_rules!(
        (flavor = "multi_thread", worker_threads = 2),
        store_on_manager()
    );

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stale_lease_is_taken_over_after_it_expires() {
        if let Some(s) = store_on_manager().await {
            common::stale_lease_taken_over(s, Duration::from_millis(300)).await;
        }
    }
}

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
async fn redis_down_gives_503_and_runs_nothing() {
    let down = RedisStore::open("redis://127.0.0.1:1").unwrap();
    common::store_down(down).await;
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

/// A lease Redis loses while its handler works (a restart without
/// persistence) is written anew by the holder's next renewal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lease_is_written_anew_by_its_renewal() {
    let url = url();
    if !reachable(&url).await {
        return;
    }
    let prefix = prefix();
    let store = RedisStore::open(&url).unwrap().prefix(prefix.clone());
    let client = redis::Client::open(url.as_str()).unwrap();
    let conn = client.get_multiplexed_async_connection().await.unwrap();
    let redis_key = |scope: &str, key: &str| format!("{prefix}{{{}:{scope}:{key}}}", scope.len());
    common::a_lost_lease_is_written_anew_by_its_renewal(
        store,
        Duration::from_millis(600),
        async |scope: &str, key: &str| {
            let deleted: i64 = redis::cmd("DEL")
                .arg(redis_key(scope, key))
                .query_async(&mut conn.clone())
                .await
                .unwrap();
            assert_eq!(deleted, 1);
        },
        async |scope: &str, key: &str| {
            let n: i64 = redis::cmd("EXISTS")
                .arg(redis_key(scope, key))
                .query_async(&mut conn.clone())
                .await
                .unwrap();
            n == 1
        },
    )
    .await;
}

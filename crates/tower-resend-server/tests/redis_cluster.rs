//! The rules of the idempotency layer on a `RedisStore` over Redis Cluster:
//! a three-node cluster this binary starts on loopback (its own free ports,
//! see `support/redis_cluster.rs`), shared by the tests, each with its own
//! key prefix. Without `redis-server`: skipped with a warning, or failed
//! when `CI` is set.
#![cfg(feature = "redis")]
#![allow(clippy::print_stderr)]

mod common;
#[path = "support/redis_cluster.rs"]
mod redis_cluster;

use std::collections::BTreeMap;
use std::time::Duration;

use http::StatusCode;
use tower_resend_server::RedisStore;

/// A store on the cluster, with a prefix of its own.
async fn store() -> Option<RedisStore> {
    store_with_prefix(&prefix()).await
}

fn prefix() -> String {
    format!("resend-test:{}:", common::unique("cluster"))
}

async fn store_with_prefix(prefix: &str) -> Option<RedisStore> {
    let cluster = redis_cluster::cluster()?;
    Some(RedisStore::cluster(cluster.connection().await).prefix(prefix))
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

/// Records of many keys spread over all three nodes, each under
/// `<prefix>{<scope length>:<scope>:<key>}`, in the slot of its hash tag,
/// on the node that owns that slot; and they replay through the cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_land_on_every_node_each_in_the_slot_of_its_hash_tag() {
    const KEYS: usize = 60;
    let Some(cluster) = redis_cluster::cluster() else {
        return;
    };
    let prefix = prefix();
    let store = store_with_prefix(&prefix).await.unwrap();
    let h = common::Handler::default();
    let s = common::svc(&h, common::layer(store).scope_with(|_| "tenant".into()));
    let keys: Vec<String> = (0..KEYS).map(|i| format!("order-{i}")).collect();
    for key in &keys {
        let r = common::call(&s, common::post(key, "x")).await.unwrap();
        assert_eq!(r.status(), StatusCode::CREATED);
    }
    // What each node holds under the prefix.
    let on_node: BTreeMap<u16, Vec<String>> = cluster
        .ports()
        .into_iter()
        .map(|port| (port, cluster.keys_on(port, &prefix)))
        .collect();
    let counts: BTreeMap<u16, usize> = on_node.iter().map(|(p, k)| (*p, k.len())).collect();
    eprintln!("redis cluster: {KEYS} records by node: {counts:?}");
    assert_eq!(counts.len(), 3, "{counts:?}");
    assert!(
        counts.values().all(|&n| n > 0),
        "every node holds records: {counts:?}"
    );
    assert_eq!(counts.values().sum::<usize>(), KEYS, "{counts:?}");
    let mut seen = Vec::new();
    for (&port, found) in &on_node {
        let mut node = cluster.node(port);
        for rkey in found {
            // The key is the prefix and the hash tag, nothing else.
            let tag = rkey
                .strip_prefix(&prefix)
                .and_then(|t| t.strip_prefix("{6:tenant:"))
                .and_then(|t| t.strip_suffix('}'))
                .unwrap_or_else(|| panic!("{rkey} is not {prefix}{{6:tenant:<key>}}"));
            seen.push(tag.to_owned());
            // Its slot is the slot of the tag alone, and this node has it.
            let slot: u16 = redis::cmd("CLUSTER")
                .arg("KEYSLOT")
                .arg(rkey)
                .query(&mut node)
                .unwrap();
            let tag_slot: u16 = redis::cmd("CLUSTER")
                .arg("KEYSLOT")
                .arg(format!("6:tenant:{tag}"))
                .query(&mut node)
                .unwrap();
            assert_eq!(slot, tag_slot, "{rkey}");
            let here: u64 = redis::cmd("CLUSTER")
                .arg("COUNTKEYSINSLOT")
                .arg(slot)
                .query(&mut node)
                .unwrap();
            assert!(here > 0, "{rkey}: slot {slot} is not on 127.0.0.1:{port}");
        }
    }
    seen.sort();
    let mut want = keys.clone();
    want.sort();
    assert_eq!(seen, want);
    // Through the cluster connection, every record replays.
    for key in &keys {
        let r = common::call(&s, common::post(key, "x")).await.unwrap();
        assert_eq!(r.headers()["idempotent-replayed"], "true", "{key}");
    }
    assert_eq!(h.runs(), KEYS);
}

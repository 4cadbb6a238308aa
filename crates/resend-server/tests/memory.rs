//! Every rule of the idempotency layer on the memory store, on tokio's
//! paused clock.

mod common;

use std::time::Duration;

use resend_server::store::{
    Begin, Fingerprint, LeaseToken, RecordKey, StoreError, StoredResponse, Ttl,
};
use resend_server::{MemoryStore, Store};

store_rules!((flavor = "current_thread", start_paused = true), async {
    Some(MemoryStore::new())
});

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn stale_lease_is_taken_over_after_it_expires() {
    common::stale_lease_taken_over(MemoryStore::new(), Duration::from_secs(30)).await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn records_expire_after_their_ttl() {
    common::records_expire(MemoryStore::new(), Duration::from_secs(24 * 3600)).await;
}

/// A store that cannot be reached: it fails at once (`hang: false`) or
/// never answers (`hang: true`).
#[derive(Clone, Copy)]
struct Broken {
    hang: bool,
}

impl Broken {
    async fn answer<T>(self) -> Result<T, StoreError> {
        if self.hang {
            std::future::pending().await
        } else {
            Err(StoreError::new("down"))
        }
    }
}

impl Store for Broken {
    fn begin(
        &self,
        _: &RecordKey<'_>,
        _: Fingerprint,
        _: &LeaseToken,
        _: Ttl,
    ) -> impl std::future::Future<Output = Result<Begin, StoreError>> + Send {
        self.answer()
    }
    fn complete(
        &self,
        _: &RecordKey<'_>,
        _: &LeaseToken,
        _: &StoredResponse,
        _: Ttl,
    ) -> impl std::future::Future<Output = Result<(), StoreError>> + Send {
        self.answer()
    }
    fn release(
        &self,
        _: &RecordKey<'_>,
        _: &LeaseToken,
    ) -> impl std::future::Future<Output = Result<(), StoreError>> + Send {
        self.answer()
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_store_that_fails_or_hangs_gives_503_and_runs_nothing() {
    common::store_down(Broken { hang: false }).await;
    common::store_down(Broken { hang: true }).await;
    // A memory store full of live records refuses new keys the same way.
    let full = MemoryStore::new().max_records(1);
    let rk = RecordKey {
        scope: "x",
        key: "y",
    };
    let ttl = Ttl {
        lease: Duration::from_secs(60),
        record: Duration::from_secs(60),
    };
    full.begin(&rk, Fingerprint([0; 32]), &LeaseToken::random(), ttl)
        .await
        .unwrap();
    common::store_down(full).await;
}

//! What a keyed request boxes: each block within glibc's per-thread cache.

use std::borrow::Cow;
use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use tokio::time::Instant;
use tower_service::Service;

use super::super::backend::sealed::Sealed;
use super::super::backend::{Claimed, KeyClaim};
use super::super::config::{Config, Shared};
use super::super::request;
use super::super::rules::Keep;
use super::super::supervise::Supervision;
use super::{Done, Handled, Work};
use crate::body::{MaybeBuffered, Read};
use crate::problems::Protocol;
use crate::store::{Fingerprint, MemoryStore};

/// The largest block glibc's allocator serves from a per-thread cache; a
/// larger one is taken from its shared lists, under the arena's lock, with
/// a pass over its free chunks first: on a busy two-core server that cost
/// the waiting row of `server_throughput` four to six points (boxes of 2.0
/// and 2.8 KB against ones of 1 KB at most).
pub(in crate::idempotency) const CACHED: usize = 1032;

/// A handler whose future is as large as an axum route's (it holds the
/// request until it answers).
pub(in crate::idempotency) fn handler() -> impl Service<
    Request<MaybeBuffered<Full<Bytes>>>,
    Response = Response<Full<Bytes>>,
    Error = Infallible,
    Future: Send + 'static,
> + Clone
       + Send
       + 'static {
    tower::service_fn(|req: Request<MaybeBuffered<Full<Bytes>>>| async move {
        let room = [0u8; 200];
        tokio::task::yield_now().await;
        std::hint::black_box((&room, &req));
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    })
}

/// The work's box (the handler supervised), its end's and the keeping
/// step's (each boxed when it comes) are within [`CACHED`].
#[tokio::test]
async fn the_works_boxes_stay_within_the_thread_cache() {
    let shared = Arc::new(Shared {
        store: MemoryStore::new(),
        config: Config::new(),
    });
    let (parts, ()) = Request::post("/x")
        .header("idempotency-key", "k")
        .body(())
        .unwrap()
        .into_parts();
    let key = request::key(&parts).unwrap().unwrap();
    let scope = Cow::Borrowed("anonymous");
    let claim = KeyClaim {
        scope: &scope,
        key: &key,
        fingerprint: Fingerprint([0; 32]),
        ttl: shared.config.lease_for(None),
        deadline: None,
    };
    let work = || Work {
        shared: Arc::clone(&shared),
        protocol: Protocol::Http,
        deadline: None,
        ledger: None,
        started_at: Instant::now(),
        key: Some(key.clone()),
    };
    let Claimed { hold, .. } = MemoryStore::claim(&shared, &claim).await;
    let request = Request::post("/x").body(MaybeBuffered::full(Bytes::new()));
    let handling = Box::pin(handler().call(request.unwrap()));
    let run = work().run(hold, handling);
    let room = std::mem::size_of_val(&run);
    assert!(room <= CACHED, "the work's box: {room} bytes");
    drop(run);

    let Claimed { hold, .. } = MemoryStore::claim(&shared, &claim).await;
    let worker = work();
    let supervised = Supervision::<Result<Done<Full<Bytes>>, Infallible>>::Panicked;
    let end = worker.end(hold, supervised);
    let room = std::mem::size_of_val(&end);
    assert!(room <= CACHED, "the end's box: {room} bytes");
    drop(end);

    let Claimed { hold, .. } = MemoryStore::claim(&shared, &claim).await;
    let (head, body) = Response::new(Full::new(Bytes::new())).into_parts();
    let read = Read {
        bytes: Bytes::new(),
        whole: true,
        trailers: None,
    };
    let handled = Handled { head, body, read };
    let worker = work();
    let keep = worker.keep(hold, Keep::<_, Infallible, _>::Response(handled));
    let room = std::mem::size_of_val(&keep);
    assert!(room <= CACHED, "the keeping step's box: {room} bytes");
}

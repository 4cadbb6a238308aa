use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, StatusCode};

use super::super::{Fingerprint, LeaseToken};
use super::*;

mod bounds;

fn key(k: &str) -> RecordKey<'_> {
    RecordKey { scope: "s", key: k }
}

/// The fingerprint the tests' requests have, unless they say otherwise.
const FP: Fingerprint = Fingerprint([0; 32]);

fn claim<'a>(key: RecordKey<'a>, fingerprint: Fingerprint, token: LeaseToken) -> Claim<'a> {
    Claim {
        key,
        fingerprint,
        token,
    }
}

/// What a finished record of `response` for `claim` counts for.
fn cost(claim: &Claim<'_>, response: &StoredResponse) -> usize {
    Record::finished(claim, 0, response, true).cost()
}

const TTL: Ttl = Ttl {
    lease: Duration::from_secs(10),
    record: Duration::from_secs(100),
};

fn resp(body: &'static str) -> StoredResponse {
    StoredResponse {
        status: StatusCode::OK,
        headers: HeaderMap::new(),
        body: Bytes::from_static(body.as_bytes()),
        body_omitted: false,
        trailers: None,
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn leases_and_records_expire_on_tokio_time() {
    let s = MemoryStore::new();
    let fp = Fingerprint([1; 32]);
    let (a, b) = (LeaseToken::random(), LeaseToken::random());
    assert_eq!(
        s.begin(&claim(key("k"), fp, a), TTL).await.unwrap(),
        Begin::Acquired
    );
    assert!(matches!(
        s.begin(&claim(key("k"), fp, b), TTL).await.unwrap(),
        Begin::InProgress { .. }
    ));
    tokio::time::advance(Duration::from_secs(10)).await;
    // a's lease expired: b takes over, and a can no longer complete.
    assert_eq!(
        s.begin(&claim(key("k"), fp, b), TTL).await.unwrap(),
        Begin::Acquired
    );
    assert_eq!(
        s.complete(&claim(key("k"), fp, a), &resp("a"), TTL)
            .await
            .unwrap(),
        LeaseState::Lost
    );
    assert_eq!(
        s.renew(&claim(key("k"), fp, a), TTL).await.unwrap(),
        LeaseState::Lost
    );
    s.release(&claim(key("k"), fp, a)).await.unwrap();
    assert!(matches!(
        s.begin(&claim(key("k"), fp, a), TTL).await.unwrap(),
        Begin::InProgress { .. }
    ));
    assert_eq!(
        s.complete(&claim(key("k"), fp, b), &resp("b"), TTL)
            .await
            .unwrap(),
        LeaseState::Held
    );
    match s.begin(&claim(key("k"), fp, a), TTL).await.unwrap() {
        Begin::Completed { response, .. } => assert_eq!(response.body, "b"),
        other => panic!("{other:?}"),
    }
    tokio::time::advance(Duration::from_secs(100)).await;
    assert_eq!(
        s.begin(&claim(key("k"), fp, a), TTL).await.unwrap(),
        Begin::Acquired
    );
}

/// Scopes and keys of any length are found again, and the same bytes
/// split another way between scope and key are another record.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn keys_of_any_length_and_split_work_alike() {
    let s = MemoryStore::new();
    let fp = Fingerprint([2; 32]);
    let t = LeaseToken::random();
    let keys: Vec<String> = [1, 77, 78, 254].iter().map(|&n| "k".repeat(n)).collect();
    for k in &keys {
        assert_eq!(
            s.begin(&claim(key(k), fp, t), TTL).await.unwrap(),
            Begin::Acquired
        );
        let moved = RecordKey {
            scope: "sk",
            key: &k[1..],
        };
        assert_eq!(
            s.begin(&claim(moved, fp, t), TTL).await.unwrap(),
            Begin::Acquired
        );
    }
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(
            s.complete(&claim(key(k), FP, t), &resp(["a", "b", "c", "d"][i]), TTL)
                .await
                .unwrap(),
            LeaseState::Held
        );
    }
    for (i, k) in keys.iter().enumerate() {
        match s.begin(&claim(key(k), fp, t), TTL).await.unwrap() {
            Begin::Completed { response, .. } => {
                assert_eq!(response.body, ["a", "b", "c", "d"][i]);
            }
            other => panic!("{other:?}"),
        }
    }
}

/// A finished record keeps its lease's fingerprint; one taken over
/// after it expired gives its bytes back and takes the new one.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn finished_records_keep_their_fingerprint_and_give_back_their_bytes() {
    let s = MemoryStore::new();
    let (a, b) = (Fingerprint([0xa; 32]), Fingerprint([0xb; 32]));
    let t = LeaseToken::random();
    assert_eq!(
        s.begin(&claim(key("k"), a, t), TTL).await.unwrap(),
        Begin::Acquired
    );
    assert_eq!(
        s.complete(&claim(key("k"), a, t), &resp("done"), TTL)
            .await
            .unwrap(),
        LeaseState::Held
    );
    let stored = cost(&claim(key("k"), a, t), &resp("done"));
    assert_eq!(s.bytes(), stored);
    match s.begin(&claim(key("k"), b, t), TTL).await.unwrap() {
        Begin::Completed { fingerprint, .. } => assert_eq!(fingerprint, a),
        other => panic!("{other:?}"),
    }
    tokio::time::advance(TTL.record).await;
    assert_eq!(
        s.begin(&claim(key("k"), b, t), TTL).await.unwrap(),
        Begin::Acquired
    );
    assert_eq!(s.bytes(), 0);
    assert_eq!(s.len(), 1);
    match s.begin(&claim(key("k"), a, t), TTL).await.unwrap() {
        Begin::InProgress { fingerprint } => assert_eq!(fingerprint, b),
        other => panic!("{other:?}"),
    }
}

/// A record gives back what it was written with: its key (told apart
/// from the same bytes split another way), token, fingerprint, expiry, and
/// its response whole (headers, repeated ones, trailers, a body, a flag),
/// or without its body when told so; a lease has none.
#[test]
fn records_give_back_what_they_were_written_with() {
    let mut headers = HeaderMap::new();
    headers.insert("content-type", "text/plain".parse().unwrap());
    headers.append("set-cookie", "a=1".parse().unwrap());
    headers.append("set-cookie", "b=2".parse().unwrap());
    let long = "v".repeat(300);
    headers.insert("x-long", long.parse().unwrap());
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", "0".parse().unwrap());
    let response = StoredResponse {
        status: StatusCode::CREATED,
        headers,
        body: Bytes::from(vec![b'x'; 200]),
        body_omitted: false,
        trailers: Some(trailers),
    };
    let (t, fp) = (LeaseToken::random(), Fingerprint([5; 32]));
    let c = claim(key("k1"), fp, t);
    let mut r = Record::finished(&c, 42, &response, true);
    assert!(r.is_done() && r.is(&key("k1")));
    assert!(!r.is(&RecordKey {
        scope: "sk",
        key: "1"
    }));
    assert_eq!((r.token(), r.fingerprint(), r.expires()), (t, fp, 42));
    let read = |r: &Record| record::read_response(r.response().unwrap()).unwrap();
    assert_eq!(read(&r), response);
    r.set_expires(7);
    assert_eq!(r.expires(), 7);
    let bare = Record::finished(&c, 1, &response, false);
    let got = read(&bare);
    assert!(got.body_omitted && got.body.is_empty());
    assert_eq!(
        (got.headers, got.trailers),
        (response.headers.clone(), response.trailers.clone())
    );
    assert_eq!(bare.cost() + 200, r.cost());
    let lease = Record::lease(&c, 3);
    assert!(!lease.is_done() && lease.response().is_none());
    assert_eq!(lease.key(), r.key());
    // Bytes that are no such response are refused, not misread.
    for bad in [
        &b""[..],
        b"\xc8",
        b"\xc8\x00\x00\x05",
        b"\x00\x00\x00\x00",
        b"\xc8\x00\x00\x01\x01\xff\x00",
    ] {
        assert!(record::read_response(bad).is_none(), "{bad:?}");
    }
    let other = Record::lease(
        &claim(
            RecordKey {
                scope: "sk",
                key: "1",
            },
            fp,
            t,
        ),
        3,
    );
    assert_ne!(other.key(), r.key());
    let (scope, k) = ("s".repeat(300), "k".repeat(200));
    let long = claim(
        RecordKey {
            scope: &scope,
            key: &k,
        },
        fp,
        t,
    );
    let long = Record::finished(&long, 9, &response, true);
    assert!(
        long.is(&RecordKey {
            scope: &scope,
            key: &k
        }) && long.expires() == 9
    );
    assert_eq!(read(&long), response);
    let hasher = RandomState::default();
    assert_eq!(lease.hash(&hasher), record::hash(&hasher, b"s", b"k1"));
    assert_ne!(other.hash(&hasher), lease.hash(&hasher));
}

#[test]
fn lease_tokens_are_32_hex_digits() {
    let t = LeaseToken::random();
    let hex = t.to_string();
    assert_eq!(hex.len(), 32);
    assert!(hex
        .bytes()
        .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
    assert_eq!(hex.as_bytes(), t.to_hex());
    assert_eq!(u128::from_str_radix(&hex, 16).ok(), Some(t.as_u128()));
    assert_ne!(t, LeaseToken::random());
}

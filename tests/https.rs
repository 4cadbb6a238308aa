//! `https://` through `tower_resend::stack()` over `tower_resend::hyper_client`, written
//! from the README's "HTTPS" section alone: a local TLS server with a
//! certificate made for the test, a GET and a keyed POST with the caller's
//! own body types (no resend wrapper named anywhere), HTTP/2 by ALPN, and a
//! handshake that fails being reported as not sent.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode, Version};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tower::ServiceExt;
use tower_resend::connect::rustls;
use tower_resend::{retry::Attempts, ErrorKind, IdempotencyKey};

/// A TLS server on 127.0.0.1 for `localhost`, speaking HTTP/1.1 and HTTP/2.
/// `GET /` answers `hello`; `POST /orders` fails the first time with a 503
/// and then echoes the body and the Idempotency-Key it got.
struct Server {
    url: String,
    cert: CertificateDer<'static>,
    posts: Arc<AtomicUsize>,
    _tasks: JoinSet<()>,
}

async fn server() -> Server {
    let rcgen::CertifiedKey { cert, signing_key } =
        rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let cert = cert.der().clone();
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(signing_key.serialize_der()));
    let mut tls = tokio_rustls::rustls::ServerConfig::builder_with_provider(Arc::new(
        tokio_rustls::rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(vec![cert.clone()], key)
    .unwrap();
    tls.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));

    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let posts = Arc::new(AtomicUsize::new(0));
    let mut tasks = JoinSet::new();
    let counter = posts.clone();
    tasks.spawn(async move {
        let mut conns = JoinSet::new();
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            let counter = counter.clone();
            conns.spawn(async move {
                // A client that refuses our certificate ends here.
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let svc = hyper::service::service_fn(move |req| answer(req, counter.clone()));
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), svc)
                    .await;
            });
        }
    });
    Server {
        url: format!("https://localhost:{port}"),
        cert,
        posts,
        _tasks: tasks,
    }
}

async fn answer(
    req: Request<Incoming>,
    posts: Arc<AtomicUsize>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let version = format!("{:?}", req.version());
    if req.method() == http::Method::GET {
        return Ok(Response::builder()
            .header("x-version", version)
            .body(Full::new(Bytes::from_static(b"hello")))
            .unwrap());
    }
    let key = req
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let body = req.into_body().collect().await.map(|b| b.to_bytes());
    if posts.fetch_add(1, Ordering::SeqCst) == 0 {
        return Ok(Response::builder()
            .status(StatusCode::SERVICE_UNAVAILABLE)
            .body(Full::default())
            .unwrap());
    }
    let body = body.unwrap_or_default();
    Ok(Response::builder()
        .header("x-key", key)
        .body(Full::new(body))
        .unwrap())
}

/// The README's way to trust a private CA: its roots in a rustls config.
fn client_trusting(cert: &CertificateDer<'static>) -> tower_resend::connect::HyperClient {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.clone()).unwrap();
    tower_resend::connect::hyper_client_with_tls(
        &Client::builder(TokioExecutor::new()),
        tower_resend::connect::tls_config(roots),
        Duration::from_secs(2),
    )
}

#[tokio::test(flavor = "current_thread")]
async fn get_and_a_keyed_post_over_https_with_the_callers_own_bodies() {
    let server = server().await;
    let api = tower_resend::stack()
        .name("orders")
        .total(Duration::from_secs(10))
        .max_attempts(3)
        .idempotency_keys()
        .service(client_trusting(&server.cert));

    // GET with an `Empty` body: TLS, HTTP/2 chosen by ALPN.
    let req = Request::get(format!("{}/", server.url))
        .body(Empty::<Bytes>::new())
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), api.clone().oneshot(req))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.version(), Version::HTTP_2);
    assert_eq!(resp.headers()["x-version"], "HTTP/2.0");
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "hello");

    // POST with a `String` body and a key: the 503 is resent with the same
    // body and the same key, over the same TLS.
    let mut req = Request::post(format!("{}/orders", server.url))
        .body(String::from("{\"sku\":42}"))
        .unwrap();
    req.extensions_mut()
        .insert(IdempotencyKey::new("order-7").unwrap());
    let resp = tokio::time::timeout(Duration::from_secs(10), api.clone().oneshot(req))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()["x-key"], "order-7");
    let attempts = resp.extensions().get::<Attempts>().unwrap().len();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "{\"sku\":42}");
    assert_eq!(attempts, 2);
    assert_eq!(server.posts.load(Ordering::SeqCst), 2);

    // A `Full<Bytes>` body through the same stack: no other type to name.
    let req = Request::get(format!("{}/", server.url))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = api.oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
}

#[tokio::test(flavor = "current_thread")]
async fn nested_stacks_take_the_body_as_it_is() {
    let server = server().await;
    let inner = tower_resend::stack()
        .max_attempts(3)
        .service(client_trusting(&server.cert));
    // The inner stack's type erased: rustc proves a stack's bounds again for
    // each layer above it that names its response body, so a stack directly
    // over a stack type-checks slowly (see `Stack`'s docs).
    let inner = tower::util::BoxCloneSyncService::new(inner);
    let outer = tower_resend::stack()
        .total(Duration::from_secs(10))
        .service(inner);
    let req = Request::get(format!("{}/", server.url))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), outer.oneshot(req))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
}

#[tokio::test(flavor = "current_thread")]
async fn a_certificate_the_client_does_not_trust_is_not_sent_and_says_why() {
    let server = server().await;
    // The default client trusts the webpki roots, not our test certificate.
    let api = tower_resend::stack()
        .total(Duration::from_secs(10))
        .max_attempts(2)
        .service(tower_resend::hyper_client(Duration::from_secs(2)));
    // A POST without a key: nothing may be resent that may have run, yet a
    // refused handshake sent nothing.
    let req = Request::post(format!("{}/orders", server.url))
        .body(Full::new(Bytes::from_static(b"x")))
        .unwrap();
    let err = tokio::time::timeout(Duration::from_secs(10), api.oneshot(req))
        .await
        .unwrap()
        .unwrap_err();
    // Sent twice (a refused handshake is safe to try again), never reached
    // the handler, and says so.
    assert_eq!(err.kind(), ErrorKind::RetriesExhausted, "{err:?}");
    assert_eq!(err.attempts(), 2, "{err:?}");
    assert!(err.nothing_processed(), "{err:?}");
    assert!(!err.is_outcome_unknown(), "{err:?}");
    let chain = std::iter::successors(Some(&err as &(dyn std::error::Error + 'static)), |e| {
        e.source()
    })
    .map(|e| e.to_string())
    .collect::<Vec<_>>()
    .join(": ");
    assert!(chain.contains("certificate"), "{chain}");
    assert_eq!(server.posts.load(Ordering::SeqCst), 0);
}

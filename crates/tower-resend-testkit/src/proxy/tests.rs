use std::future::Future;
use std::io::{self, ErrorKind};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::{Fault, FaultProxy};
use crate::{Reply, Script, TestServer};

/// Fails the test instead of hanging (instant on the paused clock).
async fn within<F: Future>(fut: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(30), fut)
        .await
        .expect("still pending after 30 seconds")
}

/// What the upstream saw on a connection.
#[derive(Debug, PartialEq, Eq)]
enum Seen {
    Bytes(Vec<u8>),
    /// Its read ended: `Ok` for an end of stream, else the error's kind.
    Closed(Result<(), ErrorKind>),
}

/// A TCP server behind the proxy that reports what it reads.
struct Upstream {
    addr: SocketAddr,
    accepted: Arc<AtomicUsize>,
    seen: mpsc::UnboundedReceiver<Seen>,
}

impl Upstream {
    /// `echo`: write back what arrives; otherwise never answer.
    async fn start(echo: bool) -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let (tx, seen) = mpsc::unbounded_channel();
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                stream.set_nodelay(true).unwrap();
                count.fetch_add(1, Ordering::SeqCst);
                let tx = tx.clone();
                tokio::spawn(async move {
                    let mut buffer = [0; 4096];
                    loop {
                        match stream.read(&mut buffer).await {
                            Ok(0) => {
                                let _ = tx.send(Seen::Closed(Ok(())));
                                return;
                            }
                            Ok(n) => {
                                let _ = tx.send(Seen::Bytes(buffer[..n].to_vec()));
                                if echo {
                                    // A failure shows up as the next read's.
                                    let _ = stream.write_all(&buffer[..n]).await;
                                }
                            }
                            Err(error) => {
                                let _ = tx.send(Seen::Closed(Err(error.kind())));
                                return;
                            }
                        }
                    }
                });
            }
        });
        Upstream {
            addr,
            accepted,
            seen,
        }
    }

    fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    /// Reads the upstream's reports until `len` bytes have arrived.
    async fn received(&mut self, len: usize) -> Vec<u8> {
        let mut bytes = Vec::new();
        while bytes.len() < len {
            match within(self.seen.recv()).await.unwrap() {
                Seen::Bytes(chunk) => bytes.extend_from_slice(&chunk),
                closed => panic!("upstream closed after {bytes:?}: {closed:?}"),
            }
        }
        bytes
    }

    /// The next report, which must be the connection's end.
    async fn closed(&mut self) -> Result<(), ErrorKind> {
        match within(self.seen.recv()).await.unwrap() {
            Seen::Closed(result) => result,
            bytes => panic!("expected the upstream's side to close, got {bytes:?}"),
        }
    }
}

async fn connect(proxy: &FaultProxy) -> TcpStream {
    let stream = within(TcpStream::connect(proxy.addr())).await.unwrap();
    stream.set_nodelay(true).unwrap();
    stream
}

/// Connects to a proxy that resets connections as soon as it accepts them:
/// the kind of error the client gets. On a multi-thread runtime the reset can
/// come before tokio has seen the connection complete, so `connect` itself
/// may fail with it; otherwise the first read does.
async fn connect_reset(proxy: &FaultProxy) -> ErrorKind {
    match within(TcpStream::connect(proxy.addr())).await {
        Ok(mut stream) => read_error(&mut stream).await.kind(),
        Err(error) => error.kind(),
    }
}

/// Sends `message` and reads back as many bytes.
async fn exchange(stream: &mut TcpStream, message: &[u8]) -> Vec<u8> {
    stream.write_all(message).await.unwrap();
    let mut answer = vec![0; message.len()];
    within(stream.read_exact(&mut answer)).await.unwrap();
    answer
}

/// Reads once, expecting the connection to fail.
async fn read_error(stream: &mut TcpStream) -> io::Error {
    let mut buffer = [0; 64];
    match within(stream.read(&mut buffer)).await {
        Ok(n) => panic!("expected a read error, read {n} bytes"),
        Err(error) => error,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pass_relays_both_ways_and_ends_of_stream() {
    let mut upstream = Upstream::start(true).await;
    let proxy = FaultProxy::pass(upstream.addr).await.unwrap();
    assert_eq!(proxy.target(), upstream.addr);
    let mut client = connect(&proxy).await;

    // Larger than the proxy's buffers, with a pattern that shows reordering.
    let large: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    let messages: [&[u8]; 3] = [b"one", b"two, a little longer", &large];
    let mut sent = Vec::new();
    for message in messages {
        assert_eq!(exchange(&mut client, message).await, message);
        sent.extend_from_slice(message);
    }
    assert_eq!(upstream.received(sent.len()).await, sent);

    // The client's FIN reaches the upstream, which closes; its FIN comes back.
    client.shutdown().await.unwrap();
    assert_eq!(upstream.closed().await, Ok(()));
    let mut rest = Vec::new();
    within(client.read_to_end(&mut rest)).await.unwrap();
    assert!(rest.is_empty());

    assert_eq!(proxy.connections(), 1);
    assert_eq!(upstream.accepted(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_response_fin_gives_the_client_an_end_of_stream() {
    let mut upstream = Upstream::start(true).await;
    let proxy = FaultProxy::start(upstream.addr, |_| Fault::DropResponseFin)
        .await
        .unwrap();
    let mut client = connect(&proxy).await;

    client.write_all(b"charge 100").await.unwrap();
    let mut answer = Vec::new();
    within(client.read_to_end(&mut answer)).await.unwrap();
    assert!(answer.is_empty(), "the answer got through: {answer:?}");

    // The request did arrive; the upstream's side is then reset.
    assert_eq!(upstream.received(10).await, b"charge 100");
    assert_eq!(upstream.closed().await, Err(ErrorKind::ConnectionReset));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_response_rst_resets_the_client() {
    let mut upstream = Upstream::start(true).await;
    let proxy = FaultProxy::start(upstream.addr, |_| Fault::DropResponseRst)
        .await
        .unwrap();
    let mut client = connect(&proxy).await;

    client.write_all(b"charge 100").await.unwrap();
    assert_eq!(
        read_error(&mut client).await.kind(),
        ErrorKind::ConnectionReset
    );

    assert_eq!(upstream.received(10).await, b"charge 100");
    assert_eq!(upstream.closed().await, Err(ErrorKind::ConnectionReset));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn delay_holds_the_first_answer() {
    let delay = Duration::from_secs(5);
    let mut upstream = Upstream::start(true).await;
    let proxy = FaultProxy::start(upstream.addr, move |_| Fault::Delay(delay))
        .await
        .unwrap();
    let mut client = connect(&proxy).await;

    let start = Instant::now();
    client.write_all(b"ping").await.unwrap();
    // The request passes at once ...
    assert_eq!(upstream.received(4).await, b"ping");
    assert!(start.elapsed() < delay);
    // ... the answer does not.
    let mut answer = [0; 4];
    let early = tokio::time::timeout(delay / 2, client.read_exact(&mut answer)).await;
    assert!(early.is_err(), "the answer came early");
    within(client.read_exact(&mut answer)).await.unwrap();
    assert_eq!(&answer, b"ping");
    let answered = Instant::now();
    assert!(answered - start >= delay);

    // What follows is not held again.
    assert_eq!(exchange(&mut client, b"pong").await, b"pong");
    assert!(answered.elapsed() < delay);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn cut_after_resets_both_sides_of_a_silent_upstream() {
    let after = Duration::from_secs(5);
    let mut upstream = Upstream::start(false).await;
    let proxy = FaultProxy::start(upstream.addr, move |_| Fault::CutAfter(after))
        .await
        .unwrap();
    let mut client = connect(&proxy).await;

    // The clock starts with the client's first bytes, not with the connection.
    tokio::time::sleep(after * 2).await;
    let start = Instant::now();
    client.write_all(b"work").await.unwrap();
    assert_eq!(upstream.received(4).await, b"work");

    assert_eq!(
        read_error(&mut client).await.kind(),
        ErrorKind::ConnectionReset
    );
    assert!(start.elapsed() >= after);
    assert_eq!(upstream.closed().await, Err(ErrorKind::ConnectionReset));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn cut_after_relays_until_the_cut() {
    let after = Duration::from_secs(5);
    let mut upstream = Upstream::start(true).await;
    let proxy = FaultProxy::start(upstream.addr, move |_| Fault::CutAfter(after))
        .await
        .unwrap();
    let mut client = connect(&proxy).await;

    let start = Instant::now();
    assert_eq!(exchange(&mut client, b"one").await, b"one");
    assert_eq!(exchange(&mut client, b"two").await, b"two");
    assert!(start.elapsed() < after);
    assert_eq!(upstream.received(6).await, b"onetwo");

    assert_eq!(
        read_error(&mut client).await.kind(),
        ErrorKind::ConnectionReset
    );
    assert!(start.elapsed() >= after);
    assert_eq!(upstream.closed().await, Err(ErrorKind::ConnectionReset));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn down_resets_open_connections_and_refuses_new_ones_until_up() {
    let mut upstream = Upstream::start(true).await;
    let proxy = FaultProxy::pass(upstream.addr).await.unwrap();
    assert!(!proxy.is_down());

    let mut open = connect(&proxy).await;
    assert_eq!(exchange(&mut open, b"before").await, b"before");
    assert_eq!(upstream.received(6).await, b"before");

    proxy.down();
    assert!(proxy.is_down());
    // Nothing sent after down() reaches the upstream: its next report is
    // the end of the connection.
    // Linux reports a reset once, to the first call that comes after it
    // (a later read sees an end of stream): the write or the read.
    let reset = match open.write_all(b"after").await {
        Err(error) => error.kind(),
        Ok(()) => read_error(&mut open).await.kind(),
    };
    assert_eq!(reset, ErrorKind::ConnectionReset);
    assert_eq!(upstream.closed().await, Err(ErrorKind::ConnectionReset));

    // A new connection is accepted, then reset; the upstream never sees it.
    assert_eq!(connect_reset(&proxy).await, ErrorKind::ConnectionReset);
    proxy.down(); // already down: no change
    assert_eq!(proxy.connections(), 2);
    assert_eq!(proxy.refused(), 1);
    assert_eq!(upstream.accepted(), 1);

    proxy.up();
    assert!(!proxy.is_down());
    let mut again = connect(&proxy).await;
    assert_eq!(exchange(&mut again, b"back").await, b"back");
    assert_eq!(upstream.received(4).await, b"back");
    assert_eq!(proxy.connections(), 3);
    assert_eq!(proxy.refused(), 1);
    assert_eq!(upstream.accepted(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plan_sees_connection_indices_in_order() {
    let upstream = Upstream::start(true).await;
    let asked = Arc::new(Mutex::new(Vec::new()));
    let plan = {
        let asked = asked.clone();
        move |index| {
            asked.lock().unwrap().push(index);
            Fault::Pass
        }
    };
    let proxy = FaultProxy::start(upstream.addr, plan).await.unwrap();

    for _ in 0..3 {
        let mut client = connect(&proxy).await;
        assert_eq!(exchange(&mut client, b"hi").await, b"hi");
    }
    assert_eq!(*asked.lock().unwrap(), [0, 1, 2]);
    assert_eq!(proxy.connections(), 3);

    // A connection refused while down takes an index but is not planned.
    proxy.down();
    assert_eq!(connect_reset(&proxy).await, ErrorKind::ConnectionReset);
    proxy.up();
    let mut client = connect(&proxy).await;
    assert_eq!(exchange(&mut client, b"hi").await, b"hi");
    assert_eq!(*asked.lock().unwrap(), [0, 1, 2, 4]);
    assert_eq!(proxy.connections(), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_target_resets_the_client() {
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let target = closed.local_addr().unwrap();
    drop(closed);
    let proxy = FaultProxy::pass(target).await.unwrap();

    assert_eq!(connect_reset(&proxy).await, ErrorKind::ConnectionReset);
    assert_eq!(proxy.connections(), 1);
    assert_eq!(proxy.refused(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_proxy_resets_its_connections() {
    let mut upstream = Upstream::start(true).await;
    let proxy = FaultProxy::pass(upstream.addr).await.unwrap();
    let addr = proxy.addr();
    let mut client = connect(&proxy).await;
    assert_eq!(exchange(&mut client, b"hi").await, b"hi");
    assert_eq!(upstream.received(2).await, b"hi");
    assert!(format!("{proxy:?}").contains("connections: 1"));

    drop(proxy);
    assert_eq!(
        read_error(&mut client).await.kind(),
        ErrorKind::ConnectionReset
    );
    assert_eq!(upstream.closed().await, Err(ErrorKind::ConnectionReset));

    // The listener goes with the accept task, which ends at its next poll;
    // until then a connection may still be accepted (and reset).
    within(async {
        loop {
            match TcpStream::connect(addr).await {
                Err(error) if error.kind() == ErrorKind::ConnectionRefused => break,
                _ => tokio::task::yield_now().await,
            }
        }
    })
    .await;
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn http_answer_lost_after_the_server_acted() {
    let server = TestServer::start(Script::new().otherwise(Reply::status(201).effect()))
        .await
        .unwrap();
    let proxy = FaultProxy::start(server.addr(), |index| match index {
        0 => Fault::DropResponseFin,
        _ => Fault::Pass,
    })
    .await
    .unwrap();
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client = Client::builder(TokioExecutor::new()).build::<_, Full<Bytes>>(connector);
    let charge = || {
        http::Request::post(format!("http://{}/charges", proxy.addr()))
            .header("idempotency-key", "order-7")
            .body(Full::new(Bytes::from_static(b"amount=100")))
            .unwrap()
    };

    // The server charged, the client heard nothing.
    let lost = within(client.request(charge())).await;
    assert!(lost.is_err(), "{lost:?}");
    assert_eq!(server.effects(Some("order-7")), 1);

    // The retry goes over a new connection, which passes.
    let response = within(client.request(charge())).await.unwrap();
    assert_eq!(response.status(), 201);
    assert_eq!(server.effects(Some("order-7")), 2);
    assert_eq!(proxy.connections(), 2);
    assert_eq!(server.connections(), 2);
}

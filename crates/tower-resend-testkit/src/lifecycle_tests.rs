//! The server's life and its robustness: shutdown on drop, concurrent
//! callers on a multi-thread runtime, bad input and bad clients.

use std::time::Duration;

use http::Request;
use http_body_util::Full;

use crate::tests::{get, http1, http2, post, send, status_of, within};
use crate::{Reply, Script, TestServer};

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn drop_shuts_everything_down() {
    let server = TestServer::start(
        Script::new()
            .then(Reply::never())
            .then(Reply::work_then_hang()),
    )
    .await
    .unwrap();
    let addr = server.addr();
    let metrics = tokio::runtime::Handle::current().metrics();

    // Leave a request hanging on each protocol.
    let hanging = [("HTTP/1", http1()), ("HTTP/2", http2())].map(|(name, client)| {
        let request = tokio::spawn(async move {
            let req = Request::get(format!("http://{addr}/"))
                .body(Full::default())
                .unwrap();
            let _ = send(&client, req).await;
        });
        (name, request)
    });
    for _ in 0..1000 {
        if server.arrival_count() == 2 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(server.arrival_count(), 2);
    assert!(metrics.num_alive_tasks() > 2);

    drop(server);

    // The listener closes...
    let mut refused = false;
    for _ in 0..1000 {
        if tokio::net::TcpStream::connect(addr).await.is_err() {
            refused = true;
            break;
        }
        tokio::task::yield_now().await;
    }
    assert!(refused, "connections are still accepted after drop");

    // ...and the hanging requests fail on the client side.
    let hung_up = Duration::from_secs(60);
    for (name, request) in hanging {
        tokio::time::timeout(hung_up, request)
            .await
            .unwrap_or_else(|_| panic!("{name} request still hanging"))
            .unwrap();
    }

    // ...and no task is left behind.
    for _ in 0..1000 {
        if metrics.num_alive_tasks() == 0 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(metrics.num_alive_tasks(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_on_a_multi_thread_runtime() {
    let server = TestServer::start(
        Script::new()
            .then_n(10, Reply::status(503))
            .otherwise(Reply::ok().effect()),
    )
    .await
    .unwrap();
    let mut tasks = tokio::task::JoinSet::new();
    for client in [http1(), http2()] {
        for _ in 0..50 {
            let client = client.clone();
            let request = post(&server, "/", None, "");
            tasks.spawn(async move { status_of(&client, request).await });
        }
    }
    let mut statuses = Vec::new();
    while let Some(status) = tasks.join_next().await {
        statuses.push(status.unwrap());
    }
    assert_eq!(statuses.iter().filter(|s| **s == 503).count(), 10);
    assert_eq!(statuses.iter().filter(|s| **s == 200).count(), 90);
    assert_eq!(server.arrival_count(), 100);
    assert_eq!(server.effects(None), 90);
    let arrivals = server.arrivals();
    let mut attempts: Vec<_> = arrivals.iter().map(|a| a.attempt).collect();
    attempts.sort_unstable();
    assert_eq!(attempts, (1..=100).collect::<Vec<_>>());
    assert!(arrivals.windows(2).all(|w| w[0].attempt < w[1].attempt));
}

#[test]
fn replies_reject_bad_input_clearly() {
    let bad_status = std::panic::catch_unwind(|| Reply::status(1000)).unwrap_err();
    assert!(bad_status
        .downcast_ref::<String>()
        .unwrap()
        .contains("1000"));
    let bad_header = std::panic::catch_unwind(|| Reply::ok().header("bad name", "v")).unwrap_err();
    assert!(bad_header
        .downcast_ref::<String>()
        .unwrap()
        .contains("bad name"));
}

#[test]
fn types_are_send_and_sync() {
    fn send_sync<T: Send + Sync + 'static>() {}
    fn send<T: Send>(_: &T) {}
    send_sync::<TestServer>();
    send_sync::<crate::Builder>();
    send_sync::<Script>();
    send_sync::<Reply>();
    send_sync::<crate::Arrival>();
    // Servers can be started from spawned tasks on a multi-thread runtime.
    send(&TestServer::start(Script::new()));
    send(&TestServer::builder().start());
}

/// Writes all of `bytes` to a raw socket.
async fn write_all(stream: &tokio::net::TcpStream, mut bytes: &[u8]) {
    while !bytes.is_empty() {
        within(stream.writable()).await.unwrap();
        match stream.try_write(bytes) {
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => panic!("write failed: {e}"),
        }
    }
}

/// Reads from a raw socket until the server closes it (or it errors).
async fn read_to_close(stream: &tokio::net::TcpStream) -> Vec<u8> {
    let mut received = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        within(stream.readable()).await.unwrap();
        match stream.try_read(&mut buf) {
            Ok(0) => return received,
            Ok(n) => received.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => return received,
        }
    }
}

async fn wait_for_arrivals(server: &TestServer, count: usize) {
    for _ in 0..1000 {
        if server.arrival_count() >= count {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(server.arrival_count(), count);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn survives_bad_clients() {
    let server = TestServer::start(Script::new().then(Reply::status(503)))
        .await
        .unwrap();

    // Not HTTP at all.
    let junk = tokio::net::TcpStream::connect(server.addr()).await.unwrap();
    write_all(&junk, b"\x00\x01 GARBAGE \xff\r\n\r\n").await;
    let answer = read_to_close(&junk).await;
    assert!(
        answer.is_empty() || answer.starts_with(b"HTTP/1.1 400"),
        "{answer:?}"
    );

    // A body cut short: recorded with what came, the script is not consulted.
    let cut = tokio::net::TcpStream::connect(server.addr()).await.unwrap();
    write_all(
        &cut,
        b"POST /cut HTTP/1.1\r\nhost: x\r\nidempotency-key: k\r\ncontent-length: 100\r\n\r\nhello",
    )
    .await;
    // Let the server read it: the request stays incomplete.
    for _ in 0..10 {
        tokio::task::yield_now().await;
        assert_eq!(server.arrival_count(), 0, "the body is not complete yet");
    }
    drop(cut);
    wait_for_arrivals(&server, 1).await;
    let arrival = &server.arrivals()[0];
    assert_eq!(arrival.uri.path(), "/cut");
    assert_eq!(arrival.body, "hello");
    assert_eq!(arrival.idempotency_key.as_deref(), Some("k"));
    assert_eq!(server.total_effects(), 0);

    // Still serving, and the queued reply is still first in line.
    assert_eq!(status_of(&http1(), get(&server, "/")).await, 503);
    assert_eq!(server.arrivals()[1].attempt, 2);
}

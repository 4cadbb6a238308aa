#![cfg_attr(not(test), warn(clippy::unwrap_used))]
//! A scripted, fault-injecting HTTP server on loopback, for testing `tower-resend`.
//!
//! [`TestServer`] listens on `127.0.0.1` (port chosen by the OS) and speaks
//! HTTP/1.1 and HTTP/2 with prior knowledge (h2c) on the same port. Each
//! request follows a [`Script`]: a queue of [`Reply`]s and a fallback, with
//! optional per-path routes. Replies can answer, wait, hang, close the
//! connection, or break the response body halfway.
//!
//! The server records every request as an [`Arrival`] and counts *effects*
//! (the work a request caused, e.g. "charged a card") per `Idempotency-Key`, so
//! tests can assert "charged exactly once".
//!
//! All waiting uses `tokio::time`, so the server works on tokio's paused
//! clock (`#[tokio::test(start_paused = true)]`) as well as on a multi-thread
//! runtime. Dropping the server shuts it down, including hung requests.
//!
//! ```
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use hyper_util::client::legacy::Client;
//! use hyper_util::rt::TokioExecutor;
//! use tower_resend_testkit::{Reply, Script, TestServer};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // The first attempt fails, the second one does the work.
//! let server = TestServer::start(
//!     Script::new()
//!         .then(Reply::status(503))
//!         .otherwise(Reply::status(201).effect()),
//! )
//! .await?;
//!
//! let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
//! for expected in [503, 201] {
//!     let request = http::Request::post(server.uri("/charges"))
//!         .header("idempotency-key", "order-7")
//!         .body(Full::new(Bytes::from_static(b"amount=100")))?;
//!     let response = client.request(request).await?;
//!     assert_eq!(response.status(), expected);
//! }
//!
//! assert_eq!(server.arrival_count(), 2);
//! assert_eq!(server.effects(Some("order-7")), 1);
//! assert_eq!(server.arrivals()[1].body, "amount=100");
//! # Ok(())
//! # }
//! ```
//!
//! # Faults below HTTP
//!
//! Put a [`FaultProxy`] between a client and any TCP server (a
//! [`TestServer`], an axum app, Redis, PostgreSQL): it loses answers, delays
//! them, cuts connections, or plays a server that goes down and comes back.
//! See the [`proxy`] module.
//!
//! # On tokio's paused clock
//!
//! A paused clock jumps to the next timer whenever the runtime has nothing
//! ready to run, even while a socket is still waiting for data. Loopback
//! traffic is delivered during the writing system call, so that is harmless,
//! except when Nagle's algorithm holds a small write back until the peer's
//! delayed ACK (about 40 ms of real time). Then timeouts fire early. The server
//! sets `TCP_NODELAY` on its sockets; set it on the client too
//! (`HttpConnector::set_nodelay(true)`), especially for HTTP/2, whose clients
//! write frames separately.

mod arrival;
mod body;
pub mod proxy;
mod reply;
mod script;
mod server;

pub use arrival::Arrival;
pub use proxy::{Fault, FaultProxy};
pub use reply::Reply;
pub use script::Script;
pub use server::{Builder, TestServer, DEFAULT_BODY_LIMIT};

#[cfg(test)]
mod lifecycle_tests;
#[cfg(test)]
mod tests;

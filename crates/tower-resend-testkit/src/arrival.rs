//! [`Arrival`]: one request as the server received it, what a
//! [`Script`](crate::Script) function is shown and what a test reads back.

use bytes::Bytes;
use http::{HeaderMap, Method, Uri, Version};
use tokio::time::Instant;

/// One request as the server received it.
#[derive(Clone, Debug)]
pub struct Arrival {
    /// When the request had been received in full (head and body), on tokio's
    /// clock.
    pub at: Instant,
    /// The request method.
    pub method: Method,
    /// The request target in origin form (path and query), as received. An
    /// absolute target (as HTTP/2 sends) is reduced to its path and query.
    pub uri: Uri,
    /// `HTTP/1.1` or `HTTP/2.0` (or `HTTP/1.0`).
    pub version: Version,
    /// The request headers, as received.
    pub headers: HeaderMap,
    /// The `Idempotency-Key` header, else the `X-Idempotency-Key` header;
    /// `None` if absent or not visible ASCII.
    pub idempotency_key: Option<String>,
    /// The request body. For a request over the body limit (answered `413`),
    /// the bytes read before the limit was hit (none if the declared
    /// `Content-Length` was already over it); for a request whose body the
    /// client did not finish sending, the bytes that came.
    pub body: Bytes,
    /// 1-based index of this arrival among all arrivals at this server.
    pub attempt: usize,
}

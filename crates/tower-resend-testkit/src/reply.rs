//! [`Reply`]: what the server does with one request.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

/// What the server does with one request.
///
/// A reply is built from a status ([`Reply::ok`], [`Reply::status`]) or a fault
/// ([`Reply::never`], [`Reply::close`], [`Reply::work_then_hang`]) and refined
/// with the chained methods ([`header`](Reply::header), [`body`](Reply::body),
/// [`delay`](Reply::delay), [`effect`](Reply::effect),
/// [`reset_mid_body`](Reply::reset_mid_body)).
///
/// The server always reads the request body in full first. Then, in this order:
///
/// 1. it waits for the [`delay`](Reply::delay), if any (on tokio's clock);
/// 2. it records the [`effect`](Reply::effect), if any;
/// 3. it acts: answers, hangs, closes the connection, or answers and then
///    breaks the response body.
///
/// ```
/// use std::time::Duration;
/// use tower_resend_testkit::Reply;
///
/// let slow_created = Reply::status(201)
///     .header("content-type", "application/json")
///     .body(r#"{"id":1}"#)
///     .delay(Duration::from_millis(300))
///     .effect();
/// # let _ = slow_created;
/// ```
#[derive(Clone, Debug)]
pub struct Reply {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
    pub(crate) delay: Option<Duration>,
    pub(crate) effect: bool,
    pub(crate) action: Action,
}

/// The final act of a [`Reply`].
#[derive(Clone, Debug)]
pub(crate) enum Action {
    /// Answer with status, headers and body.
    Respond,
    /// Never answer.
    Never,
    /// Drop the connection (HTTP/1) or reset the stream (HTTP/2) without answering.
    Close,
    /// Answer the head and these bytes, then break the body.
    ResetMidBody(Bytes),
    /// The same, declaring no length (chunked over HTTP/1.1).
    ResetMidStream(Bytes),
    /// Answer the head and these bytes, then send nothing more, ever.
    StallMidBody(Bytes),
}

impl Reply {
    /// Answer with this status code and an empty body.
    ///
    /// # Panics
    ///
    /// If `code` is not a valid HTTP status code (100..=999).
    #[track_caller]
    pub fn status(code: u16) -> Reply {
        let status = match StatusCode::from_u16(code) {
            Ok(status) => status,
            Err(_) => panic!("Reply::status: {code} is not a valid HTTP status code"),
        };
        Reply {
            status,
            headers: HeaderMap::new(),
            body: Bytes::new(),
            delay: None,
            effect: false,
            action: Action::Respond,
        }
    }

    /// Answer `200 OK` with an empty body.
    pub fn ok() -> Reply {
        Reply::status(200)
    }

    /// Never answer: the request hangs until the client gives up or the server
    /// is dropped.
    ///
    /// A [`delay`](Reply::delay) or [`effect`](Reply::effect) added to it still
    /// happens before the hang.
    pub fn never() -> Reply {
        Reply {
            action: Action::Never,
            ..Reply::ok()
        }
    }

    /// Close without answering.
    ///
    /// Over HTTP/1 the connection is dropped without a byte of response; over
    /// HTTP/2 the stream is reset (`RST_STREAM` with `INTERNAL_ERROR`) and the
    /// connection stays up. Either way the client sees an error, not a
    /// response. A [`delay`](Reply::delay) or [`effect`](Reply::effect) added
    /// to it still happens before the close.
    pub fn close() -> Reply {
        Reply {
            action: Action::Close,
            ..Reply::ok()
        }
    }

    /// Record the effect, then never answer: the work was done, the client
    /// never hears back.
    ///
    /// Same as `Reply::never().effect()`.
    pub fn work_then_hang() -> Reply {
        Reply::never().effect()
    }

    /// Add a response header (appended, so a name may be given several times).
    ///
    /// # Panics
    ///
    /// If `name` is not a valid header name or `value` not a valid header value.
    #[track_caller]
    pub fn header(mut self, name: &str, value: &str) -> Reply {
        let name = match HeaderName::from_bytes(name.as_bytes()) {
            Ok(name) => name,
            Err(_) => panic!("Reply::header: {name:?} is not a valid header name"),
        };
        let value = match HeaderValue::from_str(value) {
            Ok(value) => value,
            Err(_) => panic!("Reply::header: {value:?} is not a valid value for header {name}"),
        };
        self.headers.append(name, value);
        self
    }

    /// Set the response body (empty by default).
    ///
    /// The `Content-Length` is set from it unless a header says otherwise.
    /// Ignored by [`never`](Reply::never), [`close`](Reply::close) and
    /// [`reset_mid_body`](Reply::reset_mid_body), which decide the body
    /// themselves.
    pub fn body(mut self, body: impl Into<Bytes>) -> Reply {
        self.body = body.into();
        self
    }

    /// Wait `d` (a `tokio::time::sleep`, so it follows a paused clock) after the
    /// request body has been read, then act.
    pub fn delay(mut self, d: Duration) -> Reply {
        self.delay = Some(d);
        self
    }

    /// Record one effect for the request's idempotency key when this reply is
    /// acted on, that is after the [`delay`](Reply::delay) and before answering
    /// (or hanging, or closing).
    ///
    /// Once the request has been read, the effect happens even if the client
    /// gives up during the delay: the server finishes its work regardless,
    /// like a real one would. It does not happen if the server is dropped
    /// first. Count effects with
    /// [`TestServer::effects`](crate::TestServer::effects).
    pub fn effect(mut self) -> Reply {
        self.effect = true;
        self
    }

    /// Send the status, headers and the `sent` bytes, then break the body: the
    /// client gets the response head and then an error while reading the body.
    ///
    /// The response declares a `Content-Length` larger than `sent` (unless a
    /// `content-length` was set with [`header`](Reply::header)). Over HTTP/1
    /// the connection is then dropped; over HTTP/2 the stream ends short of the
    /// declared length, which an HTTP/2 client must treat as a stream error.
    ///
    /// Keep `sent` small (a few KiB): it is meant to fit in the socket buffers.
    pub fn reset_mid_body(mut self, sent: impl Into<Bytes>) -> Reply {
        self.action = Action::ResetMidBody(sent.into());
        self
    }

    /// Sends the head and `sent` with no declared length (a chunked body
    /// over HTTP/1.1, a stream without `content-length` over HTTP/2), then
    /// breaks it: over HTTP/1 the connection is dropped before the last
    /// chunk, over HTTP/2 the stream is reset. The client gets the head and
    /// then an error while reading the body, and cannot know from the head
    /// how long the body was meant to be.
    ///
    /// Keep `sent` small (a few KiB): it is meant to fit in the socket buffers.
    pub fn reset_mid_stream(mut self, sent: impl Into<Bytes>) -> Reply {
        self.action = Action::ResetMidStream(sent.into());
        self
    }

    /// Sends the head and `sent` (no declared length), then nothing more:
    /// the body neither ends nor fails, and the connection stays open until
    /// the client gives up on it.
    pub fn stall_mid_body(mut self, sent: impl Into<Bytes>) -> Reply {
        self.action = Action::StallMidBody(sent.into());
        self
    }
}

impl Default for Reply {
    /// `200 OK`, empty body.
    fn default() -> Reply {
        Reply::ok()
    }
}

//! Request bodies that can be sent more than once.
//!
//! A retry or a hedged copy sends the request again, body included. The
//! stack hands its transport the body the caller gave when that body is in
//! memory (`Full`, `Empty`, `String`): a copy of it is kept for the next
//! attempt (copying a [`Bytes`](bytes::Bytes) shares its data), so a
//! `hyper_util` client of your own, `Client<_, Full<Bytes>>`, is the
//! transport as it is. A body that is a stream (`BoxBody`, `StreamBody`,
//! hyper's `Incoming`, tonic's and reqwest's bodies) goes to the transport as
//! a [`ReplayBody`], which keeps up to a cap (64 KiB by default) of what the
//! first attempt read, to send it again.
//!
//! [`Replay`] says which is which. A body of your own type implements it in
//! two lines (see its docs); any stream can also be wrapped in a
//! [`ReplayBody`] before it is sent.
//!
//! ```
//! use std::time::Duration;
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use hyper_util::client::legacy::{connect::HttpConnector, Client};
//! use hyper_util::rt::TokioExecutor;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! // Your own client, as it is: it takes the body you send.
//! let client: Client<HttpConnector, Full<Bytes>> =
//!     Client::builder(TokioExecutor::new()).build_http();
//! let shipping = tower_resend::stack().name("shipping").service(client);
//! # let _ = shipping;
//! # }
//! ```

mod error;
mod replay;
mod shared;

use bytes::Buf;
use http_body::Body;

use crate::error::BoxError;

pub use error::ReplayError;
pub use replay::{ReplayBody, DEFAULT_REPLAY_CAP};

/// A request body the stack can send more than once.
///
/// [`Sent`](Self::Sent) is what each attempt gives the transport: the body
/// itself for a body in memory, copied with [`try_copy`](Self::try_copy);
/// a [`ReplayBody`] for a stream. Implemented for `Full`, `Empty` and
/// `String` (sent as they are), for `BoxBody`, `UnsyncBoxBody`,
/// `StreamBody` and `Limited` of http-body-util, hyper's `Incoming` (feature
/// `hyper-client`), tonic's body (feature `tonic`) and reqwest's (feature
/// `reqwest`) (sent as a `ReplayBody`), and for `ReplayBody` itself, which a
/// stack nested in another passes through.
///
/// A stream type of your own:
///
/// ```
/// use std::pin::Pin;
/// use std::task::{Context, Poll};
/// use bytes::Bytes;
/// use http_body::{Body, Frame};
/// use tower_resend::body::{Replay, ReplayBody};
///
/// struct Upload;
/// impl Body for Upload {
///     type Data = Bytes;
///     type Error = std::io::Error;
///     fn poll_frame(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
///         Poll::Ready(None)
///     }
/// }
///
/// impl Replay for Upload {
///     type Sent = ReplayBody<Self>;
///     fn keep(self, cap: usize) -> ReplayBody<Self> { ReplayBody::new(self, cap) }
///     fn send_once(self) -> ReplayBody<Self> { ReplayBody::once(self) }
///     fn try_copy(&self) -> Option<Self> { None }
/// }
/// ```
#[diagnostic::on_unimplemented(
    message = "tower-resend does not know how to send `{Self}` again",
    label = "not a body the stack can replay",
    note = "wrap it in `tower_resend::body::ReplayBody::new(body, DEFAULT_REPLAY_CAP)` (the transport then takes `ReplayBody<{Self}>`), or implement `tower_resend::body::Replay` for it"
)]
pub trait Replay: Body + Sized {
    /// What each attempt sends.
    type Sent: Replay<Sent = Self::Sent>;

    /// The body of a call that may be sent again: keeps up to `cap` bytes of
    /// a stream for later attempts (a body in memory is kept whole).
    fn keep(self, cap: usize) -> Self::Sent;

    /// The body of a call sent once (another layer retries it, or retries
    /// are off): nothing is kept.
    fn send_once(self) -> Self::Sent;

    /// A copy to send, from the start; `None` when there is none to make (a
    /// stream past its cap, or a stream not yet kept).
    fn try_copy(&self) -> Option<Self>;
}

/// Bodies in memory: sent as they are, copied for each later attempt.
macro_rules! in_memory {
    ($([$($g:tt)*] $ty:ty),* $(,)?) => {$(
        impl<$($g)*> Replay for $ty {
            type Sent = Self;

            #[inline]
            fn keep(self, _cap: usize) -> Self {
                self
            }

            #[inline]
            fn send_once(self) -> Self {
                self
            }

            #[inline]
            fn try_copy(&self) -> Option<Self> {
                Some(self.clone())
            }
        }
    )*};
}

in_memory! {
    [D: Buf + Clone] http_body_util::Full<D>,
    [D: Buf] http_body_util::Empty<D>,
    [] String,
}

/// Streams: sent as a [`ReplayBody`] that keeps what the first attempt read.
macro_rules! stream {
    ($([$($g:tt)*] $ty:ty),* $(,)?) => {$(
        impl<$($g)*> Replay for $ty
        where
            Self: Body,
            <Self as Body>::Error: Into<BoxError>,
        {
            type Sent = ReplayBody<Self>;

            #[inline]
            fn keep(self, cap: usize) -> ReplayBody<Self> {
                ReplayBody::new(self, cap)
            }

            #[inline]
            fn send_once(self) -> ReplayBody<Self> {
                ReplayBody::once(self)
            }

            #[inline]
            fn try_copy(&self) -> Option<Self> {
                None
            }
        }
    )*};
}

stream! {
    [D, E] http_body_util::combinators::BoxBody<D, E>,
    [D, E] http_body_util::combinators::UnsyncBoxBody<D, E>,
    [S] http_body_util::StreamBody<S>,
    [B] http_body_util::Limited<B>,
}
#[cfg(feature = "hyper-client")]
stream! { [] hyper::body::Incoming }
#[cfg(feature = "tonic")]
stream! { [] tonic::body::Body }
#[cfg(feature = "reqwest")]
stream! { [] reqwest::Body }

/// A body already kept for replays (by a stack this one is nested in, or by
/// the caller): sent as it is.
impl<B> Replay for ReplayBody<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Sent = Self;

    #[inline]
    fn keep(self, _cap: usize) -> Self {
        self
    }

    #[inline]
    fn send_once(self) -> Self {
        self
    }

    #[inline]
    fn try_copy(&self) -> Option<Self> {
        self.try_clone()
    }
}

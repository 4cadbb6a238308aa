use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use pin_project_lite::pin_project;

use crate::error::{BoxError, Error};
use crate::retry::policy::unknown_under_key;

pin_project! {
    /// Response future of [`Stack`].
    #[derive(Debug)]
    pub struct ResponseFuture<F> {
        #[pin]
        inner: F,
        // The Idempotency-Key the stack chose, if it did. Boxed: most calls
        // have none, and every call's future is moved by value.
        key: Option<Box<http::HeaderValue>>,
    }
}

impl<F, T> Future for ResponseFuture<F>
where
    F: Future<Output = Result<T, BoxError>>,
{
    type Output = Result<T, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        this.inner.poll(cx).map_err(|e| {
            let e = Error::from_box(e);
            // An error the retry layer did not end (the call's deadline cut
            // it from outside) is judged by the same rule.
            match this.key.take() {
                Some(key) if unknown_under_key(&e) => e.outcome_unknown_over(*key),
                Some(key) => e.with_key(*key),
                None => e,
            }
        })
    }
}

impl<F> ResponseFuture<F> {
    pub(super) fn new(inner: F, key: Option<Box<http::HeaderValue>>) -> Self {
        Self { inner, key }
    }
}

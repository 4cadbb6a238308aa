//! The answers the layer gives on its own account: problem documents (see
//! [`problems`](crate::problems)).

use http::{Response, StatusCode};

use crate::body::MaybeBuffered;
use crate::problems::Problem;

/// A problem document of type `code`, its `detail` being `message`.
pub(crate) fn json_error<B>(
    status: StatusCode,
    code: &'static str,
    message: &str,
) -> Response<MaybeBuffered<B>> {
    Problem::new(status, code, message).response()
}

/// `json_error` with a `Retry-After` in whole seconds (at least 1).
pub(crate) fn retry_later<B>(
    status: StatusCode,
    code: &'static str,
    message: &str,
    after: std::time::Duration,
) -> Response<MaybeBuffered<B>> {
    Problem::new(status, code, message)
        .retry_after(after)
        .response()
}

//! How many attempts came before this one, on the attempt itself: gRPC's
//! `grpc-previous-rpc-attempts`, or the configured HTTP header
//! ([`RESEND_PREVIOUS_ATTEMPTS`](super::RESEND_PREVIOUS_ATTEMPTS) by
//! default). The retry layer writes it on its later attempts, the hedge
//! layer on its backup copies; a server that sheds load sheds those first.

use http::{HeaderMap, HeaderName, HeaderValue, Request};

use super::layer::GRPC_PREVIOUS_RPC_ATTEMPTS;
use crate::vocab::parse_digits;

/// gRPC's header, in a place a reference can point to.
static GRPC: HeaderName = GRPC_PREVIOUS_RPC_ATTEMPTS;

/// The header that carries the count on this request: gRPC's on gRPC
/// requests, `http` on others (none if not configured).
fn header<'a>(headers: &HeaderMap, http: Option<&'a HeaderName>) -> Option<&'a HeaderName> {
    if crate::classify::is_grpc(headers) {
        Some(&GRPC)
    } else {
        http
    }
}

/// Tells the upstream that `previous` attempts came before this one.
pub(crate) fn announce<B>(req: &mut Request<B>, previous: u32, http: Option<&HeaderName>) {
    if let Some(name) = header(req.headers(), http) {
        req.headers_mut()
            .insert(name.clone(), HeaderValue::from(previous));
    }
}

/// How many attempts came before this one, as a layer above announced it
/// (0 for a first attempt, which carries none).
pub(crate) fn announced(headers: &HeaderMap, http: Option<&HeaderName>) -> u32 {
    header(headers, http)
        .and_then(|name| headers.get(name))
        .and_then(|v| parse_digits(v.as_bytes()))
        .and_then(|n| u32::try_from(n).ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::retry::RESEND_PREVIOUS_ATTEMPTS;

    #[test]
    fn what_is_announced_reads_back() {
        let http = Some(&RESEND_PREVIOUS_ATTEMPTS);
        let mut req = Request::new(());
        assert_eq!(announced(req.headers(), http), 0);
        announce(&mut req, 2, http);
        assert_eq!(req.headers()["resend-previous-attempts"], "2");
        assert_eq!(announced(req.headers(), http), 2);

        // A gRPC request: gRPC's header, whatever is configured.
        let mut req = Request::new(());
        req.headers_mut()
            .insert("content-type", HeaderValue::from_static("application/grpc"));
        announce(&mut req, 1, None);
        assert_eq!(req.headers()["grpc-previous-rpc-attempts"], "1");
        assert_eq!(announced(req.headers(), None), 1);

        // No header configured: nothing written, and nothing read.
        let mut req = Request::new(());
        announce(&mut req, 1, None);
        assert!(req.headers().is_empty());
        req.headers_mut()
            .insert("resend-previous-attempts", HeaderValue::from_static("x"));
        assert_eq!(announced(req.headers(), http), 0, "not a count");
    }
}

//! What a retry needs to send the request again, kept without cloning the
//! extension map on the success path when it holds only tower-resend's own entries.

use http::{Extensions, HeaderMap, Method, Request, Uri, Version};

use crate::classify::RequestFacts;
use crate::deadline::Deadline;
use crate::vocab::RetryInCharge;

/// The head of the request, for the attempts after the first.
#[derive(Debug)]
pub(crate) struct Head {
    method: Method,
    uri: Uri,
    version: Version,
    headers: HeaderMap,
    extensions: Own,
}

/// The request's extensions, for later attempts.
#[derive(Debug)]
enum Own {
    /// Only tower-resend's own entries were there (the marker, the deadline,
    /// the key resend chose): rebuilt for a retry, so the success path
    /// clones no map.
    Rebuild(RetryInCharge, Option<Deadline>, Option<http::HeaderValue>),
    /// The caller's extensions too: a clone of them all.
    Cloned(Extensions),
}

impl Head {
    /// Keeps what later attempts need from `req` (which already carries
    /// `marker`, and `deadline`, the `Deadline` among their
    /// extensions, if any); the first attempt takes `parts` itself.
    /// `key` is the key resend chose, if the caller's extensions hold one
    /// (looked up only when they hold more than tower-resend's deadline).
    pub(super) fn keep<B>(
        req: &Request<B>,
        marker: RetryInCharge,
        deadline: Option<Deadline>,
        key: Option<http::HeaderValue>,
    ) -> Self {
        let ours = 1 + usize::from(deadline.is_some()) + usize::from(key.is_some());
        let extensions = if req.extensions().len() == ours {
            Own::Rebuild(marker, deadline, key)
        } else {
            Own::Cloned(req.extensions().clone())
        };
        Self {
            method: req.method().clone(),
            uri: req.uri().clone(),
            version: req.version(),
            // An empty map is made, not cloned: cheaper, and the usual case.
            headers: if req.headers().is_empty() {
                HeaderMap::new()
            } else {
                req.headers().clone()
            },
            extensions,
        }
    }

    /// A request with this head and `body`.
    pub(super) fn request<B>(&self, body: B) -> Request<B> {
        let mut req = Request::new(body);
        *req.method_mut() = self.method.clone();
        *req.uri_mut() = self.uri.clone();
        *req.version_mut() = self.version;
        *req.headers_mut() = self.headers.clone();
        match &self.extensions {
            Own::Rebuild(marker, deadline, key) => {
                let ext = req.extensions_mut();
                marker.mark(ext);
                if let Some(d) = deadline {
                    ext.insert(*d);
                }
                if let Some(k) = key {
                    ext.insert(crate::idempotency::GeneratedKey(k.clone()));
                }
            }
            Own::Cloned(ext) => *req.extensions_mut() = ext.clone(),
        }
        req
    }

    /// The Idempotency-Key resend chose for the request, if it did.
    pub(super) fn generated_key(&self) -> Option<http::HeaderValue> {
        match &self.extensions {
            Own::Rebuild(_, _, key) => key.clone(),
            Own::Cloned(ext) => ext
                .get::<crate::idempotency::GeneratedKey>()
                .map(|k| k.0.clone()),
        }
    }

    /// The Idempotency-Key the request was sent under: the one resend
    /// chose, or the caller's.
    pub(super) fn key(&self) -> Option<http::HeaderValue> {
        self.generated_key().or_else(|| {
            crate::classify::KEY_HEADERS
                .iter()
                .find_map(|h| self.headers.get(h))
                .cloned()
        })
    }

    /// The instances this call has used, when a fleet layer picks them.
    pub(super) fn tried(&self) -> Option<&crate::vocab::Tried> {
        match &self.extensions {
            Own::Rebuild(..) => None,
            Own::Cloned(ext) => ext.get(),
        }
    }

    pub(super) fn facts(&self) -> RequestFacts<'_> {
        RequestFacts::new(&self.method, &self.uri, &self.headers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::request::Parts;
    use std::time::Duration;

    #[derive(Clone, Debug, PartialEq)]
    struct Mine(u8);

    const MARK: RetryInCharge = RetryInCharge {
        attempt_timeout: None,
        read_ahead: true,
    };

    fn parts(ext: impl FnOnce(&mut Extensions)) -> Parts {
        let mut req = Request::put("http://up/x?q=1")
            .header("a", "b")
            .body(())
            .unwrap();
        ext(req.extensions_mut());
        MARK.mark(req.extensions_mut());
        req.into_parts().0
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn later_attempts_get_the_same_head_and_extensions() {
        let d = Deadline::after(Duration::from_secs(1));
        for p in [
            parts(|_| {}),
            parts(|e| {
                e.insert(d);
            }),
            parts(|e| {
                e.insert(d);
                e.insert(Mine(7));
            }),
        ] {
            let deadline = p.extensions.get::<Deadline>().copied();
            let p = Request::from_parts(p, ());
            let head = Head::keep(&p, MARK, deadline, None);
            let p = p.into_parts().0;
            let again = head.request(());
            assert_eq!(again.method(), p.method);
            assert_eq!(again.uri(), &p.uri);
            assert_eq!(again.headers(), &p.headers);
            assert_eq!(RetryInCharge::of(again.extensions()), Some(MARK));
            assert_eq!(
                again.extensions().get::<Deadline>(),
                p.extensions.get::<Deadline>()
            );
            assert_eq!(again.extensions().get::<Mine>(), p.extensions.get::<Mine>());
            assert_eq!(again.extensions().len(), p.extensions.len());
        }
    }
}

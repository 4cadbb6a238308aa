//! Errors whose type alone says what the server did.

/// A request to an `https://` URL through a [`HyperClient`](crate::connect::HyperClient) built without
/// the `https` feature: it fails at once, is never retried, and says what
/// to turn on.
#[derive(Debug)]
pub struct HttpsNotEnabled {
    pub(crate) _private: (),
}

impl std::fmt::Display for HttpsNotEnabled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(
            "https:// needs tower-resend's `https` feature (hyper-rustls); this client speaks http:// only",
        )
    }
}

impl std::error::Error for HttpsNotEnabled {}

//! The 504 body: where the time of a request went.

use std::time::Duration;

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use resend::deadline::{Snapshot, Source};
use serde_json::{Map, Value};

use crate::body::MaybeBuffered;
use crate::store::StoredResponse;

/// Where a request's time ran out, as the 504 body says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorSource {
    /// Inside an outbound call through a resend stack.
    Upstream,
    /// Inside the handler's own work.
    Internal,
    /// The caller's budget was spent before the handler ran.
    Deadline,
}

impl ErrorSource {
    /// `"upstream"`, `"internal"` or `"deadline"`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Upstream => "upstream",
            Self::Internal => "internal",
            Self::Deadline => "deadline",
        }
    }
}

/// What a 504 says: the source, the work that was running, and the time
/// spent in each part.
#[derive(Clone, Debug)]
pub(crate) struct Attribution {
    pub(crate) source: ErrorSource,
    /// The upstream's name, or the handler's name for its work.
    pub(crate) name: Option<String>,
    pub(crate) budget: Option<Duration>,
    pub(crate) elapsed: Duration,
    pub(crate) snapshot: Snapshot,
}

impl Attribution {
    /// From a ledger snapshot taken when the deadline ran out.
    pub(crate) fn from_snapshot(snapshot: Snapshot, budget: Duration, elapsed: Duration) -> Self {
        let (source, name) = match snapshot.running() {
            Some(e) if e.source == Source::Upstream => {
                (ErrorSource::Upstream, Some(e.name.to_string()))
            }
            Some(e) => (ErrorSource::Internal, Some(e.name.to_string())),
            None => (ErrorSource::Internal, None),
        };
        Self {
            source,
            name,
            budget: Some(budget),
            elapsed,
            snapshot,
        }
    }

    /// The JSON body.
    pub(crate) fn to_json(&self) -> Value {
        let ms = |d: Duration| Value::from(u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let mut upstream = Map::new();
        let mut internal = Map::new();
        let mut attributed = Duration::ZERO;
        for e in self.snapshot.totals() {
            attributed += e.spent;
            let map = if e.source == Source::Upstream {
                &mut upstream
            } else {
                &mut internal
            };
            map.insert(e.name.to_string(), ms(e.spent));
        }
        let mut spent = Map::new();
        spent.insert("total".into(), ms(self.elapsed));
        spent.insert("upstream".into(), Value::Object(upstream));
        spent.insert("internal".into(), Value::Object(internal));
        spent.insert(
            "unattributed".into(),
            ms(self.elapsed.saturating_sub(attributed)),
        );
        let name = |s| {
            if self.source == s {
                self.name.clone().map_or(Value::Null, Value::from)
            } else {
                Value::Null
            }
        };
        let mut body = Map::new();
        body.insert("error".into(), "deadline_exceeded".into());
        body.insert("error_source".into(), self.source.as_str().into());
        body.insert("upstream".into(), name(ErrorSource::Upstream));
        body.insert("internal".into(), name(ErrorSource::Internal));
        if let Some(b) = self.budget {
            body.insert("budget_ms".into(), ms(b));
        }
        body.insert("spent_ms".into(), Value::Object(spent));
        Value::Object(body)
    }

    /// A one-line summary for logs and `grpc-message`.
    pub(crate) fn summary(&self) -> String {
        match &self.name {
            Some(n) => format!("deadline exceeded in {} {n}", self.source.as_str()),
            None => format!("deadline exceeded ({})", self.source.as_str()),
        }
    }

    /// 504 with the JSON body; for a gRPC request, the gRPC way:
    /// `grpc-status: 4` (DEADLINE_EXCEEDED) in a trailers-only response.
    pub(crate) fn response<B>(&self, grpc: bool) -> Response<MaybeBuffered<B>> {
        let stored = self.stored(grpc);
        let mut resp = Response::new(MaybeBuffered::full(stored.body));
        *resp.status_mut() = stored.status;
        *resp.headers_mut() = stored.headers;
        resp
    }

    /// [`response`](Self::response), as a record keeps it.
    pub(crate) fn stored(&self, grpc: bool) -> StoredResponse {
        let mut headers = HeaderMap::new();
        if grpc {
            headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
            headers.insert("grpc-status", HeaderValue::from_static("4"));
            if let Ok(v) = HeaderValue::from_str(&self.summary().replace('%', "%25")) {
                headers.insert("grpc-message", v);
            }
            return StoredResponse {
                status: StatusCode::OK,
                headers,
                body: Bytes::new(),
                body_omitted: false,
            };
        }
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        StoredResponse {
            status: StatusCode::GATEWAY_TIMEOUT,
            headers,
            body: Bytes::from(self.to_json().to_string()),
            body_omitted: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use resend::deadline::{Entry, Snapshot};

    #[test]
    fn body_names_the_running_upstream_and_sums_the_parts() {
        let snapshot = Snapshot {
            active: vec![Entry {
                source: Source::Upstream,
                name: "shipping".into(),
                spent: Duration::from_millis(1500),
            }],
            finished: vec![Entry {
                source: Source::Internal,
                name: "db".into(),
                spent: Duration::from_millis(300),
            }],
        };
        let a =
            Attribution::from_snapshot(snapshot, Duration::from_secs(2), Duration::from_secs(2));
        assert_eq!(
            a.to_json(),
            serde_json::json!({
                "error": "deadline_exceeded",
                "error_source": "upstream",
                "upstream": "shipping",
                "internal": null,
                "budget_ms": 2000,
                "spent_ms": {"total": 2000, "upstream": {"shipping": 1500}, "internal": {"db": 300}, "unattributed": 200}
            })
        );
        assert_eq!(a.summary(), "deadline exceeded in upstream shipping");
    }
}

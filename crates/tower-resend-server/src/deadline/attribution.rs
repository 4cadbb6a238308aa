//! The 504's problem document: where the time of a request went.

use std::time::Duration;

use http::Response;
use serde_json::{Map, Value};
use tower_resend::deadline::{server::Snapshot, server::Source};

use crate::body::MaybeBuffered;
use crate::problems::{ms, Problem, ProblemType, Protocol};
use crate::store::StoredResponse;

/// Where a request's time ran out, as the 504 body says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorSource {
    /// Inside an outbound call through a tower-resend stack.
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

    /// The problem document: `deadline_exceeded`, with where the time
    /// went.
    pub(crate) fn problem(&self) -> Problem {
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
        let mut p = Problem::new(ProblemType::DeadlineExceeded, self.detail())
            .with("error_source", self.source.as_str())
            .grpc_message(self.summary());
        match (self.source, &self.name) {
            (ErrorSource::Upstream, Some(name)) => p = p.with("upstream", name.as_str()),
            (ErrorSource::Internal, Some(name)) => p = p.with("internal", name.as_str()),
            _ => {}
        }
        if let Some(b) = self.budget {
            p = p.with("budget_ms", ms(b));
        }
        if self.source == ErrorSource::Deadline {
            // Spent before the handler ran: nothing was done.
            p = p.nothing_done();
        }
        p.with("spent_ms", Value::Object(spent))
    }

    /// The problem's `detail`: where the time ran out, in a sentence.
    fn detail(&self) -> String {
        match (self.source, &self.name) {
            (ErrorSource::Upstream, Some(n)) => {
                format!("the request's deadline ran out during a call to the upstream {n}")
            }
            (ErrorSource::Upstream, None) => {
                "the request's deadline ran out during a call to an upstream".to_owned()
            }
            (ErrorSource::Internal, Some(n)) => {
                format!("the request's deadline ran out in the handler's own work ({n})")
            }
            (ErrorSource::Internal, None) => {
                "the request's deadline ran out in the handler's own work".to_owned()
            }
            (ErrorSource::Deadline, _) => {
                "the caller's budget was spent before the request was handled; nothing was done"
                    .to_owned()
            }
        }
    }

    /// A one-line summary for logs and `grpc-message`.
    pub(crate) fn summary(&self) -> String {
        match &self.name {
            Some(n) => format!("deadline exceeded in {} {n}", self.source.as_str()),
            None => format!("deadline exceeded ({})", self.source.as_str()),
        }
    }

    /// 504 with the problem document; for a gRPC request, the gRPC way:
    /// `grpc-status: 4` (DEADLINE_EXCEEDED) in a trailers-only response,
    /// the summary in `grpc-message`.
    pub(crate) fn response<B>(&self, protocol: Protocol) -> Response<MaybeBuffered<B>> {
        self.problem().response(protocol)
    }

    /// [`response`](Self::response), as a record keeps it.
    pub(crate) fn stored(&self, protocol: Protocol) -> StoredResponse {
        self.problem().stored(protocol)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower_resend::deadline::{server::Entry, server::Snapshot};

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
            a.problem().to_json(),
            serde_json::json!({
                "type": "https://docs.rs/tower-resend-server/latest/tower_resend_server/problems/index.html#deadline_exceeded",
                "title": "Deadline exceeded",
                "status": 504,
                "detail": "the request's deadline ran out during a call to the upstream shipping",
                "error": "deadline_exceeded",
                "error_source": "upstream",
                "upstream": "shipping",
                "budget_ms": 2000,
                "spent_ms": {"total": 2000, "upstream": {"shipping": 1500}, "internal": {"db": 300}, "unattributed": 200}
            })
        );
        let stored = a.stored(Protocol::Http);
        assert_eq!(stored.status, http::StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(stored.headers["content-type"], "application/problem+json");
        assert_eq!(a.summary(), "deadline exceeded in upstream shipping");
        let grpc = a.stored(Protocol::Grpc);
        assert_eq!(grpc.status, http::StatusCode::OK);
        assert_eq!(grpc.headers["grpc-status"], "4");
        assert_eq!(
            grpc.headers["grpc-message"],
            "deadline exceeded in upstream shipping"
        );
    }
}

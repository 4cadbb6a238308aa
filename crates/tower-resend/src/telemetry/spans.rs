//! The call and attempt spans, and the wait event: what they are named,
//! and what is recorded on them. Every function returns at once when its
//! span is disabled, before computing anything.

use std::time::Duration;

use http::Uri;
use tracing::field::{Empty, Value};
use tracing::Span;

use super::{answer_error, kind_str, stop_str, Outcome, WaitReason};
use crate::classify::{Class, Classification, RequestFacts};
use crate::error::{BoxError, Error, ErrorKind};
use crate::vocab::Stop;

/// The spans of a call and of its first attempt; with no subscriber that
/// could want them (tracing's `INFO` off everywhere), two disabled spans
/// for the price of one load.
#[inline]
pub(crate) fn spans(
    upstream: Option<&str>,
    facts: &RequestFacts<'_>,
    replay_safe: bool,
    fleet: bool,
) -> (Span, Span) {
    if tracing::level_filters::LevelFilter::current() < tracing::Level::INFO {
        return (Span::none(), Span::none());
    }
    let call = call_span(upstream, facts, replay_safe);
    let attempt = attempt_span(&call, facts, 0, fleet);
    (call, attempt)
}

/// The span of a logical call.
fn call_span(upstream: Option<&str>, facts: &RequestFacts<'_>, replay_safe: bool) -> Span {
    tracing::info_span!(
        target: "tower_resend",
        "resend.call",
        resend.upstream = upstream,
        http.request.method = facts.method().as_str(),
        resend.replay_safe = replay_safe,
        resend.attempts = Empty,
        resend.outcome = Empty,
        resend.stop = Empty,
        resend.elapsed_ms = Empty,
        "error.type" = Empty,
        otel.status_code = Empty,
    )
}

/// The span of one physical attempt, a child of `call`, before it is sent;
/// `previous` attempts came before it. Its fields are given at once (each
/// later `record` is a call into the subscriber); nothing is computed
/// unless the span is enabled. Over a `fleet`, the server's address and
/// port are left for the fleet layer, which knows the instance.
#[inline]
pub(crate) fn attempt_span(
    call: &Span,
    facts: &RequestFacts<'_>,
    previous: u32,
    fleet: bool,
) -> Span {
    let uri = facts.uri();
    tracing::info_span!(
        target: "tower_resend",
        parent: call,
        "resend.attempt",
        otel.name = attempt_name(facts),
        otel.kind = "client",
        otel.status_code = Empty,
        http.request.method = facts.method().as_str(),
        server.address = uri.host().filter(|_| !fleet).map(address),
        server.port = port(uri).filter(|_| !fleet).map(i64::from),
        url.full = url_full(facts).as_deref(),
        http.request.resend_count = (previous > 0).then_some(i64::from(previous)),
        http.response.status_code = Empty,
        resend.class = Empty,
        "error.type" = Empty,
        rpc.system = facts.is_grpc().then_some("grpc"),
        rpc.service = grpc_method(facts).map(|(service, _)| service),
        rpc.method = grpc_method(facts).map(|(_, method)| method),
        rpc.grpc.status_code = Empty,
        resend.hedge.sent = Empty,
        resend.hedge.won = Empty,
    )
}

/// An attempt's span name: the method, or `package.Service/Method` for gRPC.
fn attempt_name<'a>(facts: &RequestFacts<'a>) -> &'a str {
    if facts.is_grpc() {
        let path = facts.uri().path();
        path.strip_prefix('/').unwrap_or(path)
    } else {
        facts.method().as_str()
    }
}

/// A gRPC call's service and method, from its path.
fn grpc_method<'a>(facts: &RequestFacts<'a>) -> Option<(&'a str, &'a str)> {
    if !facts.is_grpc() {
        return None;
    }
    let path = facts.uri().path();
    path.strip_prefix('/').unwrap_or(path).rsplit_once('/')
}

/// A host as `server.address` says it: an IPv6 literal without its brackets.
pub(super) fn address(host: &str) -> &str {
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

/// Records how an attempt ended on its span, in one call to the subscriber.
pub(crate) fn attempt_ended<R>(
    span: &Span,
    result: &Result<http::Response<R>, BoxError>,
    c: &Classification,
) {
    let Some(meta) = span.metadata().filter(|_| !span.is_disabled()) else {
        return;
    };
    let (status, grpc, error) = match result {
        Ok(resp) => {
            let status = resp.status();
            let grpc = c.grpc_code().map(|code| i64::from(code.as_i32()));
            (
                Some(i64::from(status.as_u16())),
                grpc,
                answer_error(status, c.grpc_code()),
            )
        }
        Err(e) => (None, None, Some(error_type(&**e, c.class()))),
    };
    let fields = meta.fields();
    let (Some(f_class), Some(f_status), Some(f_grpc), Some(f_error), Some(f_otel)) = (
        fields.field("resend.class"),
        fields.field("http.response.status_code"),
        fields.field("rpc.grpc.status_code"),
        fields.field("error.type"),
        fields.field("otel.status_code"),
    ) else {
        return;
    };
    let class = c.class().as_str();
    let failed = error.map(|_| "ERROR");
    span.record_all(&fields.value_set(&[
        (&f_class, Some(&class as &dyn Value)),
        (&f_status, status.as_ref().map(|v| v as &dyn Value)),
        (&f_grpc, grpc.as_ref().map(|v| v as &dyn Value)),
        (&f_error, error.as_ref().map(|v| v as &dyn Value)),
        (&f_otel, failed.as_ref().map(|v| v as &dyn Value)),
    ]));
}

/// Records on the span of an attempt still in flight that the call was
/// dropped (or its deadline passed) before it ended.
pub(crate) fn attempt_cut(span: &Span, outcome: Outcome) {
    if span.is_disabled() {
        return;
    }
    if let Some(error) = outcome.error_type() {
        span.record("error.type", error);
        span.record("otel.status_code", "ERROR");
    }
}

/// The wait before the attempt numbered `next` (1 for the second), as an
/// event in the call's span: `wait` as the policy planned it, and for a
/// wait for a budget token the `longest` it may last.
pub(crate) fn wait_event(
    call: &Span,
    reason: WaitReason,
    wait: Duration,
    longest: Option<Duration>,
    next: u32,
) {
    if call.is_disabled() {
        return;
    }
    tracing::info!(
        target: "tower_resend",
        parent: call,
        {
            "resend.wait.reason" = reason.as_str(),
            "resend.wait_ms" = ms(wait),
            "resend.wait.longest_ms" = longest.map(ms),
            "http.request.resend_count" = i64::from(next),
        },
        "waiting to retry"
    );
}

/// Milliseconds, to the microsecond.
fn ms(d: Duration) -> f64 {
    d.as_micros() as f64 / 1000.0
}

/// Records how the call ended on its span, in one call to the subscriber.
pub(crate) fn call_ended(
    span: &Span,
    outcome: Outcome,
    stop: Option<Stop>,
    attempts: u32,
    elapsed: Duration,
) {
    let Some(meta) = span.metadata().filter(|_| !span.is_disabled()) else {
        return;
    };
    let fields = meta.fields();
    let (
        Some(f_attempts),
        Some(f_outcome),
        Some(f_stop),
        Some(f_elapsed),
        Some(f_error),
        Some(f_otel),
    ) = (
        fields.field("resend.attempts"),
        fields.field("resend.outcome"),
        fields.field("resend.stop"),
        fields.field("resend.elapsed_ms"),
        fields.field("error.type"),
        fields.field("otel.status_code"),
    )
    else {
        return;
    };
    let attempts = i64::from(attempts);
    let name = outcome.as_str();
    let stop = stop.map(stop_str);
    let elapsed = ms(elapsed);
    let error = outcome.error_type();
    let failed = error.map(|_| "ERROR");
    span.record_all(&fields.value_set(&[
        (&f_attempts, Some(&attempts as &dyn Value)),
        (&f_outcome, Some(&name as &dyn Value)),
        (&f_stop, stop.as_ref().map(|v| v as &dyn Value)),
        (&f_elapsed, Some(&elapsed as &dyn Value)),
        (&f_error, error.as_ref().map(|v| v as &dyn Value)),
        (&f_otel, failed.as_ref().map(|v| v as &dyn Value)),
    ]));
}

/// `error.type` of an attempt's error: tower-resend's kind for its own errors
/// (a timeout, an open circuit), anywhere in the chain; else, and for a
/// transport error, what the error says the server did (`not_sent`,
/// `unknown`).
pub(super) fn error_type(e: &(dyn std::error::Error + 'static), class: Class) -> &'static str {
    std::iter::successors(Some(e), |e| e.source())
        .find_map(|e| e.downcast_ref::<Error>())
        .map(Error::kind)
        .filter(|kind| *kind != ErrorKind::Transport)
        .map_or(class.as_str(), kind_str)
}

/// The port the request goes to: its own, or its scheme's.
pub(super) fn port(uri: &Uri) -> Option<u16> {
    uri.port_u16().or(match uri.scheme_str() {
        Some("http") => Some(80),
        Some("https") => Some(443),
        _ => None,
    })
}

/// `url.full` as the conventions want it by default: scheme, host, port and
/// path, without the query (it may carry tokens or ids), the userinfo or a
/// fragment. `None` for gRPC (its span says `rpc.*`), and for a URI without
/// a scheme and host.
fn url_full(facts: &RequestFacts<'_>) -> Option<String> {
    if facts.is_grpc() {
        return None;
    }
    url_of(facts.uri())
}

fn url_of(uri: &Uri) -> Option<String> {
    let scheme = uri.scheme_str()?;
    let host = uri.host()?;
    let path = uri.path();
    let mut url = String::with_capacity(scheme.len() + host.len() + path.len() + 9);
    url.push_str(scheme);
    url.push_str("://");
    url.push_str(host);
    if let Some(port) = uri.port() {
        url.push(':');
        url.push_str(port.as_str());
    }
    url.push_str(path);
    Some(url)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_full_leaves_out_the_query_and_the_userinfo() {
        let url = |s: &str| url_of(&s.parse().unwrap());
        assert_eq!(
            url("http://user:secret@api.test:8080/orders/42?token=abc#frag").as_deref(),
            Some("http://api.test:8080/orders/42")
        );
        assert_eq!(
            url("https://api.test").as_deref(),
            Some("https://api.test/")
        );
        assert_eq!(
            url("http://[::1]:9/x?y").as_deref(),
            Some("http://[::1]:9/x")
        );
        assert_eq!(url("/relative?q=1"), None);
        assert_eq!(port(&"https://api.test/".parse().unwrap()), Some(443));
        assert_eq!(port(&"http://api.test:81/".parse().unwrap()), Some(81));
        assert_eq!(port(&"/x".parse().unwrap()), None);
    }
}

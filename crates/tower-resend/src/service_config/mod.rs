//! gRPC's service config (feature `service-config`): the `methodConfig`
//! timeouts, retry and hedging policies and the channel's
//! `retryThrottling`, as grpc-go, grpc-java and C-core read them, applied
//! per method to a stack of tower-resend.
//!
//! [`ServiceConfig::from_json`] reads the JSON and validates it as gRPC's
//! retry design (gRFC A6) says, every invalid field an [`InvalidConfig`]
//! that names it; [`ServiceConfig::service`] builds one
//! [stack](mod@crate::stack) per methodConfig over one transport and a
//! [`PerRoute`](crate::routes::PerRoute) that sends each call through its
//! method's (see [`routes`](crate::routes) for why a router and not
//! per-request overrides: a stack without a config pays nothing).
//!
//! ```
//! use std::time::Duration;
//! use http::Request;
//! use tower_resend::service_config::ServiceConfig;
//! use tower::{service_fn, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() -> Result<(), tower_resend::BoxError> {
//! let config = ServiceConfig::from_json(r#"{
//!   "methodConfig": [{
//!     "name": [{"service": "shop.Catalog", "method": "GetItem"}],
//!     "timeout": "2s",
//!     "retryPolicy": {
//!       "maxAttempts": 4,
//!       "initialBackoff": "0.1s",
//!       "maxBackoff": "1s",
//!       "backoffMultiplier": 2,
//!       "retryableStatusCodes": ["UNAVAILABLE"]
//!     }
//!   }],
//!   "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1}
//! }"#)?;
//!
//! // Stands in for `TonicTransport::new(channel)`: always UNAVAILABLE.
//! let channel = service_fn(|_req: Request<String>| async {
//!     let resp = http::Response::builder().header("grpc-status", "14").body(String::new())?;
//!     Ok::<_, tower_resend::BoxError>(resp)
//! });
//! let catalog = config.service(tower_resend::stack().name("catalog"), channel);
//!
//! let call = |path: &str| Request::post(path).header("content-type", "application/grpc").body(String::new()).unwrap();
//! let attempts = |resp: http::Response<_>| resp.extensions().get::<tower_resend::retry::Attempts>().unwrap().len();
//! // GetItem is retried on UNAVAILABLE; other methods are not.
//! assert_eq!(attempts(catalog.clone().oneshot(call("/shop.Catalog/GetItem")).await?), 4);
//! assert_eq!(attempts(catalog.clone().oneshot(call("/shop.Catalog/ListItems")).await?), 1);
//! # Ok(()) }
//! ```
//!
//! # Spellings
//!
//! The JSON is read as the big implementations read it, so that a config
//! pasted from grpc-go's, grpc-java's or gRPC's own documents works as
//! published:
//!
//! - **Keys** in any case, as grpc-go matches them (Go's `encoding/json`:
//!   `"MaxAttempts"`, as grpc-go's retry example writes it), or as proto
//!   field names (`method_config`, `retry_policy`, `max_attempts`), which
//!   proto3's JSON mapping has parsers accept beside the JSON names
//!   (`maxAttempts`). One rule for every field; two keys of one object
//!   that name the same field are an error naming both.
//! - **Durations** as grpc-go reads them: seconds, up to 9 decimals, then
//!   `s`, either part optional (`"1s"`, `"0.5s"`, `".01s"`, `"1.s"`,
//!   `"1.000000001s"`); a negative one is refused.
//! - **Status codes** by name, in any case as gRFC A6 says
//!   (`"UNAVAILABLE"`, `"unavailable"`), or by number (`14`).
//! - **Unknown fields** are ignored, as gRPC ignores them, and listed with
//!   the gRPC settings a stack does not apply (`waitForReady`,
//!   `loadBalancingConfig`, ...) in one `tracing` event at debug level.
//! - **An invalid value** is an [`InvalidConfig`] that quotes it, with its
//!   path as the document spells it.
//!
//! ```
//! use std::time::Duration;
//! use tower_resend::service_config::{MethodPolicy, ServiceConfig};
//!
//! // grpc-go's retry example, as grpc-go writes it.
//! let go = ServiceConfig::from_json(r#"{
//!   "methodConfig": [{
//!     "name": [{"service": "grpc.examples.echo.Echo"}],
//!     "retryPolicy": {
//!       "MaxAttempts": 4,
//!       "InitialBackoff": ".01s",
//!       "MaxBackoff": ".01s",
//!       "BackoffMultiplier": 1.0,
//!       "RetryableStatusCodes": [ "UNAVAILABLE" ]
//!     }
//!   }]
//! }"#)?;
//! // The same with proto field names, and the code by number.
//! let proto = ServiceConfig::from_json(r#"{
//!   "method_config": [{
//!     "name": [{"service": "grpc.examples.echo.Echo"}],
//!     "retry_policy": {"max_attempts": 4, "initial_backoff": "0.01s", "max_backoff": "0.01s",
//!                      "backoff_multiplier": 1, "retryable_status_codes": [14]}
//!   }]
//! }"#)?;
//! assert_eq!(go, proto);
//! match &go.methods[0].policy {
//!     Some(MethodPolicy::Retry(r)) => {
//!         assert_eq!(r.max_attempts, 4);
//!         assert_eq!(r.initial_backoff, Duration::from_millis(10));
//!     }
//!     other => panic!("not a retry policy: {other:?}"),
//! }
//!
//! let err = ServiceConfig::from_json(r#"{"methodConfig": [{
//!   "name": [{"service": "grpc.examples.echo.Echo"}],
//!   "retryPolicy": {"maxAttempts": 4, "initialBackoff": "0.01s", "maxBackoff": "0.01s",
//!                   "backoffMultiplier": 1, "retryableStatusCodes": ["UNAVAILABLE", "UNAVAILBLE"]}
//! }]}"#).unwrap_err();
//! assert_eq!(err.path(), "methodConfig[0].retryPolicy.retryableStatusCodes[1]");
//! assert!(err.to_string().starts_with(
//!     r#"methodConfig[0].retryPolicy.retryableStatusCodes[1]: "UNAVAILBLE" is not a gRPC status code"#
//! ));
//! # Ok::<(), tower_resend::service_config::InvalidConfig>(())
//! ```
//!
//! How gRPC's fields map onto the stack is on [`ServiceConfig::service`].
//! Where it differs from gRPC's own clients: a `backoffMultiplier` below 1
//! counts as 1 (waits never shrink); the throttle counts what the stack
//! sees of each attempt, its headers (a status in the trailers is a
//! success, and an attempt cut by the attempt timeout is not counted); a
//! method with neither `timeout` nor `perAttemptRecvTimeout` keeps the
//! base's attempt timeout (5 s unless set), where gRPC has none.

mod apply;
mod classify;
mod count;
mod duration;
mod error;
mod keys;
mod parse;
#[cfg(test)]
mod peers_tests;
mod routes;
#[cfg(test)]
mod tests;

use std::time::Duration;

pub use self::apply::ConfiguredStack;
pub use self::classify::MethodClassifier;
pub use self::count::{CountAttempts, CountFuture};
pub use self::error::InvalidConfig;
use crate::classify::GrpcCode;

/// A gRPC service config: its `methodConfig` list and its
/// `retryThrottling`; the rest of the document (load balancing, health
/// checks) is not applied (see [the spellings](self#spellings)).
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct ServiceConfig {
    /// `methodConfig`, in order.
    pub methods: Vec<MethodConfig>,
    /// `retryThrottling`.
    pub retry_throttling: Option<RetryThrottling>,
}

impl ServiceConfig {
    /// Reads and validates a service config (JSON), spelt as grpc-go,
    /// grpc-java or proto JSON spell it ([spellings](self#spellings)): the
    /// first invalid field is the error, named by its path.
    ///
    /// ```
    /// use tower_resend::service_config::ServiceConfig;
    ///
    /// let err = ServiceConfig::from_json(r#"{"methodConfig": [{
    ///     "name": [{"service": "a.B"}],
    ///     "retryPolicy": {"maxAttempts": 1, "initialBackoff": "1s", "maxBackoff": "1s",
    ///                     "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}
    /// }]}"#).unwrap_err();
    /// assert_eq!(err.to_string(), "methodConfig[0].retryPolicy.maxAttempts: 1 is not an integer greater than 1");
    /// ```
    pub fn from_json(json: &str) -> Result<Self, InvalidConfig> {
        let v: serde_json::Value = serde_json::from_str(json)
            .map_err(|e| InvalidConfig::new("", format!("not JSON: {e}")))?;
        Self::from_value(&v)
    }

    /// Reads and validates a service config already parsed.
    pub fn from_value(value: &serde_json::Value) -> Result<Self, InvalidConfig> {
        let mut reader = keys::Reader::default();
        let config = parse::service_config(&mut reader, value);
        reader.log("service config");
        config
    }
}

/// One `methodConfig`: the methods it names and what they get.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct MethodConfig {
    /// `name`: the methods (or services, or the default) it applies to.
    pub names: Vec<MethodName>,
    /// `timeout`: the deadline of a call.
    pub timeout: Option<Duration>,
    /// `retryPolicy` or `hedgingPolicy` (a method has one or neither).
    pub policy: Option<MethodPolicy>,
}

/// A `name` of a methodConfig: a method of a service, every method of a
/// service (`method` empty), or every method (both empty: the default).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct MethodName {
    /// `service`: `package.Service`; `None` when empty or absent.
    pub service: Option<String>,
    /// `method`; `None` when empty or absent.
    pub method: Option<String>,
}

/// A method's policy.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum MethodPolicy {
    /// `retryPolicy`.
    Retry(RetryPolicy),
    /// `hedgingPolicy`.
    Hedging(HedgingPolicy),
}

/// `retryPolicy`.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct RetryPolicy {
    /// `maxAttempts`, the first included, at most 5.
    pub max_attempts: u32,
    /// `initialBackoff`.
    pub initial_backoff: Duration,
    /// `maxBackoff`.
    pub max_backoff: Duration,
    /// `backoffMultiplier`.
    pub backoff_multiplier: f64,
    /// `retryableStatusCodes`, each once.
    pub retryable_status_codes: Vec<GrpcCode>,
    /// `perAttemptRecvTimeout`.
    pub per_attempt_recv_timeout: Option<Duration>,
}

/// `hedgingPolicy`.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct HedgingPolicy {
    /// `maxAttempts`, the first included, at most 5.
    pub max_attempts: u32,
    /// `hedgingDelay` (zero: every copy at once).
    pub hedging_delay: Duration,
    /// `nonFatalStatusCodes`, each once.
    pub non_fatal_status_codes: Vec<GrpcCode>,
}

/// `retryThrottling`.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct RetryThrottling {
    /// `maxTokens`, 1 to 1000.
    pub max_tokens: u32,
    /// `tokenRatio` (three decimals are used).
    pub token_ratio: f64,
}

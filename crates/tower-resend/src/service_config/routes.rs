//! A route table ([`Routes`]) read from JSON (or any serde format), with
//! the service config's durations and errors: here, beside the reader it
//! shares them with, so that the routes do not import the service config
//! that builds on them.

use http::Method;
use serde_json::Value;

use super::parse::{
    attempts, duration_at, field, join, list, object, positive_duration, positive_number, required,
    string,
};
use super::InvalidConfig;
use crate::retry::Backoff;
use crate::routes::{RoutePolicy, Routes};

type Result<T> = std::result::Result<T, InvalidConfig>;

impl Routes {
    /// Reads a route table (feature `service-config`):
    ///
    /// ```json
    /// {"routes": [
    ///   {"method": "POST", "path": "/orders", "timeout": "2s", "maxAttempts": 1},
    ///   {"path": "/reports", "attemptTimeout": "30s",
    ///    "backoff": {"initial": "0.5s", "max": "5s", "multiplier": 2}},
    ///   {"method": "GET", "path": "/search", "hedge": {"delay": "0.05s", "copies": 2}}
    /// ]}
    /// ```
    ///
    /// `path` (a prefix) is required, `method` absent means every method;
    /// durations are written as gRPC's service config writes them
    /// (`"1.5s"`); `maxAttempts` is at least 1 (1: no retries); every
    /// invalid field is an [`InvalidConfig`] naming it
    /// (`routes[1].backoff.multiplier: …`).
    ///
    /// ```
    /// use tower_resend::routes::Routes;
    ///
    /// let routes = Routes::from_json(r#"{"routes": [{"method": "POST", "path": "/orders", "maxAttempts": 1}]}"#)?;
    /// assert_eq!(routes.len(), 1);
    /// let err = Routes::from_json(r#"{"routes": [{"path": "/a", "timeout": "1m"}]}"#).unwrap_err();
    /// assert_eq!(err.path(), "routes[0].timeout");
    /// # Ok::<(), tower_resend::service_config::InvalidConfig>(())
    /// ```
    #[cfg_attr(docsrs, doc(cfg(feature = "service-config")))]
    pub fn from_json(json: &str) -> Result<Self> {
        let v: Value = serde_json::from_str(json)
            .map_err(|e| InvalidConfig::new("", format!("not JSON: {e}")))?;
        Self::from_value(&v)
    }

    /// Reads a route table already parsed; see [`from_json`](Self::from_json).
    #[cfg_attr(docsrs, doc(cfg(feature = "service-config")))]
    pub fn from_value(v: &Value) -> Result<Self> {
        let top = object(v, "")?;
        let mut routes = Routes::new();
        let Some(list_v) = field(top, "routes") else {
            return Ok(routes);
        };
        for (i, r) in list(list_v, "routes")?.iter().enumerate() {
            let path = format!("routes[{i}]");
            let o = object(r, &path)?;
            let method = field(o, "method")
                .map(|m| {
                    let at = join(&path, "method");
                    Method::from_bytes(string(m, &at)?.as_bytes())
                        .map_err(|_| InvalidConfig::value(at, m, "is not an HTTP method"))
                })
                .transpose()?;
            let prefix = string(required(o, &path, "path")?, &join(&path, "path"))?;
            let policy = policy(o, &path)?;
            routes = match method {
                Some(m) => routes.route(m, prefix, policy),
                None => routes.any_method(prefix, policy),
            };
        }
        Ok(routes)
    }
}

fn policy(o: &serde_json::Map<String, Value>, path: &str) -> Result<RoutePolicy> {
    let at = |key: &str| join(path, key);
    let mut p = RoutePolicy::new();
    if let Some(t) = field(o, "timeout") {
        p = p.total(positive_duration(t, &at("timeout"))?);
    }
    if let Some(t) = field(o, "attemptTimeout") {
        p = p.attempt_timeout(positive_duration(t, &at("attemptTimeout"))?);
    }
    if let Some(v) = field(o, "maxAttempts") {
        let n = v
            .as_u64()
            .filter(|&n| n >= 1)
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| {
                InvalidConfig::value(at("maxAttempts"), v, "is not an integer, 1 or more")
            })?;
        p = p.max_attempts(n);
    }
    if let Some(b) = field(o, "backoff") {
        let bp = at("backoff");
        let bo = object(b, &bp)?;
        let initial = positive_duration(required(bo, &bp, "initial")?, &join(&bp, "initial"))?;
        let max = positive_duration(required(bo, &bp, "max")?, &join(&bp, "max"))?;
        let multiplier =
            positive_number(required(bo, &bp, "multiplier")?, &join(&bp, "multiplier"))?;
        let backoff = Backoff::new(initial, multiplier, max).map_err(|e| {
            let key = match e.reason() {
                r if r.contains("multiplier") => "multiplier",
                _ => "max",
            };
            // Both were read above: never null here.
            let value = field(bo, key).unwrap_or(&Value::Null);
            InvalidConfig::value(
                join(&bp, key),
                value,
                &format!("is refused: {}", e.reason()),
            )
        })?;
        p = p.backoff(backoff);
    }
    if let Some(h) = field(o, "hedge") {
        let hp = at("hedge");
        let ho = object(h, &hp)?;
        let delay = duration_at(required(ho, &hp, "delay")?, &join(&hp, "delay"))?;
        let copies = match field(ho, "copies") {
            Some(c) => attempts(c, &join(&hp, "copies"))?,
            None => 2,
        };
        p = p.hedge(delay, copies);
    }
    Ok(p)
}

/// A route table from any serde format (feature `service-config`), as
/// [`Routes::from_json`] reads it.
#[cfg_attr(docsrs, doc(cfg(feature = "service-config")))]
impl<'de> serde::Deserialize<'de> for Routes {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let v = Value::deserialize(d)?;
        Routes::from_value(&v).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_table_reads_with_its_policies_and_errors_name_the_field() {
        let routes = Routes::from_json(
            r#"{"routes": [
                {"method": "POST", "path": "/orders", "timeout": "2s", "maxAttempts": 1},
                {"path": "reports", "attemptTimeout": "30s",
                 "backoff": {"initial": "0.5s", "max": "5s", "multiplier": 2}},
                {"method": "GET", "path": "/search", "hedge": {"delay": "0.05s", "copies": 3}}
            ]}"#,
        )
        .unwrap();
        let want = Routes::new()
            .route(
                Method::POST,
                "/orders",
                RoutePolicy::new()
                    .total(Duration::from_secs(2))
                    .max_attempts(1),
            )
            .any_method(
                "/reports",
                RoutePolicy::new()
                    .attempt_timeout(Duration::from_secs(30))
                    .backoff(
                        Backoff::new(Duration::from_millis(500), 2.0, Duration::from_secs(5))
                            .unwrap(),
                    ),
            )
            .route(
                Method::GET,
                "/search",
                RoutePolicy::new().hedge(Duration::from_millis(50), 3),
            );
        assert_eq!(routes, want);
        // The same through serde.
        let v: Value = serde_json::from_str(r#"{"routes": [{"path": "/a"}]}"#).unwrap();
        let via_serde: Routes = serde::Deserialize::deserialize(v).unwrap();
        assert_eq!(via_serde.len(), 1);

        for (json, path) in [
            ("[]", ""),
            (r#"{"routes": {}}"#, "routes"),
            (r#"{"routes": [{}]}"#, "routes[0].path"),
            (r#"{"routes": [{"path": 7}]}"#, "routes[0].path"),
            (
                r#"{"routes": [{"path": "/", "method": "G ET"}]}"#,
                "routes[0].method",
            ),
            (
                r#"{"routes": [{"path": "/", "timeout": "0s"}]}"#,
                "routes[0].timeout",
            ),
            (
                r#"{"routes": [{"path": "/", "maxAttempts": 0}]}"#,
                "routes[0].maxAttempts",
            ),
            (
                r#"{"routes": [{"path": "/", "backoff": {"initial": "1s", "max": "1s", "multiplier": 0.5}}]}"#,
                "routes[0].backoff.multiplier",
            ),
            (
                r#"{"routes": [{"path": "/", "backoff": {"initial": "2s", "max": "1s", "multiplier": 2}}]}"#,
                "routes[0].backoff.max",
            ),
            (
                r#"{"routes": [{"path": "/", "hedge": {}}]}"#,
                "routes[0].hedge.delay",
            ),
            (
                r#"{"routes": [{"path": "/", "hedge": {"delay": "1s", "copies": 1}}]}"#,
                "routes[0].hedge.copies",
            ),
        ] {
            let err = Routes::from_json(json).unwrap_err();
            assert_eq!(err.path(), path, "{json}: {err}");
        }
        // The value is quoted in the message.
        let err = Routes::from_json(r#"{"routes": [{"path": "/", "maxAttempts": 0}]}"#);
        assert_eq!(
            err.unwrap_err().to_string(),
            "routes[0].maxAttempts: 0 is not an integer, 1 or more"
        );
        let err = Routes::from_json(
            r#"{"routes": [{"path": "/", "backoff": {"initial": "2s", "max": "1s", "multiplier": 2}}]}"#,
        );
        assert_eq!(
            err.unwrap_err().to_string(),
            "routes[0].backoff.max: \"1s\" is refused: cap must not be less than base"
        );
    }
}

//! A route table ([`Routes`]) read from JSON (or any serde format), with
//! the service config's durations and errors: here, beside the reader it
//! shares them with, so that the routes do not import the service config
//! that builds on them.

use http::Method;
use serde_json::Value;

use super::keys::Reader;
use super::parse::{attempts, duration_at, list, positive_duration, positive_number, string};
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
    /// invalid field is an [`InvalidConfig`] naming it and quoting its
    /// value (`routes[1].backoff.multiplier: …`). Keys are matched as a
    /// [service config](crate::service_config)'s are (`maxAttempts`,
    /// `MaxAttempts`, `max_attempts`); a key that names nothing is ignored
    /// and logged at debug level.
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
        let mut reader = Reader::default();
        let routes = table(&mut reader, v);
        reader.log("route table");
        routes
    }
}

fn table(reader: &mut Reader, v: &Value) -> Result<Routes> {
    let [routes_f] = reader.object(v, "", ["routes"], &[])?;
    let mut routes = Routes::new();
    let Some(list_v) = routes_f.value() else {
        return Ok(routes);
    };
    for (i, r) in list(list_v, routes_f.path())?.iter().enumerate() {
        let path = format!("{}[{i}]", routes_f.path());
        let [method, prefix, timeout, attempt_timeout, max_attempts, backoff, hedge] = reader
            .object(
                r,
                &path,
                [
                    "method",
                    "path",
                    "timeout",
                    "attemptTimeout",
                    "maxAttempts",
                    "backoff",
                    "hedge",
                ],
                &[],
            )?;
        let method = method.read(|m, at| {
            Method::from_bytes(string(m, at)?.as_bytes())
                .map_err(|_| InvalidConfig::value(at, m, "is not an HTTP method"))
        })?;
        let prefix = prefix.require(string)?;
        let mut p = RoutePolicy::new();
        if let Some(t) = timeout.read(positive_duration)? {
            p = p.total(t);
        }
        if let Some(t) = attempt_timeout.read(positive_duration)? {
            p = p.attempt_timeout(t);
        }
        if let Some(n) = max_attempts.read(|v, at| {
            v.as_u64()
                .filter(|&n| n >= 1)
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| InvalidConfig::value(at, v, "is not an integer, 1 or more"))
        })? {
            p = p.max_attempts(n);
        }
        if let Some(b) = backoff.read(|b, at| read_backoff(reader, b, at))? {
            p = p.backoff(b);
        }
        if let Some((delay, copies)) = hedge.read(|h, at| {
            let [delay, copies] = reader.object(h, at, ["delay", "copies"], &[])?;
            Ok((
                delay.require(duration_at)?,
                copies.read(attempts)?.unwrap_or(2),
            ))
        })? {
            p = p.hedge(delay, copies);
        }
        routes = match method {
            Some(m) => routes.route(m, prefix, p),
            None => routes.any_method(prefix, p),
        };
    }
    Ok(routes)
}

fn read_backoff(reader: &mut Reader, v: &Value, path: &str) -> Result<Backoff> {
    let [initial, max, multiplier] =
        reader.object(v, path, ["initial", "max", "multiplier"], &[])?;
    let base = initial.require(positive_duration)?;
    let cap = max.require(positive_duration)?;
    let factor = multiplier.require(positive_number)?;
    Backoff::new(base, factor, cap).map_err(|e| {
        let field = if e.reason().contains("multiplier") {
            &multiplier
        } else {
            &max
        };
        // Both were read above: never absent here.
        let value = field.value().unwrap_or(&Value::Null);
        InvalidConfig::value(field.path(), value, &format!("is refused: {}", e.reason()))
    })
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
        // Keys as a service config's: any case, proto names; others ignored.
        let spelt = Routes::from_json(
            r#"{"Routes": [{"PATH": "/a", "attempt_timeout": "2s", "MaxAttempts": 2, "typo": 1}]}"#,
        );
        let want = Routes::new().any_method(
            "/a",
            RoutePolicy::new()
                .attempt_timeout(Duration::from_secs(2))
                .max_attempts(2),
        );
        assert_eq!(spelt, Ok(want));
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

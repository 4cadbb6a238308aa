//! The service config JSON read into [`ServiceConfig`], validated as gRPC's
//! retry design (gRFC A6) and the service config document say: every
//! invalid field is an [`InvalidConfig`] naming it.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::{Map, Value};

use super::{
    duration, HedgingPolicy, InvalidConfig, MethodConfig, MethodName, MethodPolicy, RetryPolicy,
    RetryThrottling, ServiceConfig,
};
use crate::classify::GrpcCode;

/// gRPC sends no more attempts than this, whatever a policy says.
pub(crate) const MAX_ATTEMPTS_CAP: u32 = 5;

type Result<T> = std::result::Result<T, InvalidConfig>;

/// `path.key`, or `key` at the top.
pub(crate) fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_owned()
    } else {
        format!("{path}.{key}")
    }
}

/// The object at `path`.
pub(crate) fn object<'a>(v: &'a Value, path: &str) -> Result<&'a Map<String, Value>> {
    v.as_object()
        .ok_or_else(|| InvalidConfig::value(path, v, "is not an object"))
}

/// The field `key` of `map`; `null` is as absent (proto JSON's default).
pub(crate) fn field<'a>(map: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    map.get(key).filter(|v| !v.is_null())
}

/// The field `key`, which must be there.
pub(crate) fn required<'a>(
    map: &'a Map<String, Value>,
    path: &str,
    key: &str,
) -> Result<&'a Value> {
    field(map, key).ok_or_else(|| InvalidConfig::new(join(path, key), "is required"))
}

/// A string.
pub(crate) fn string<'a>(v: &'a Value, path: &str) -> Result<&'a str> {
    v.as_str()
        .ok_or_else(|| InvalidConfig::value(path, v, "is not a string"))
}

/// A list.
pub(crate) fn list<'a>(v: &'a Value, path: &str) -> Result<&'a [Value]> {
    v.as_array()
        .map(Vec::as_slice)
        .ok_or_else(|| InvalidConfig::value(path, v, "is not a list"))
}

/// A proto JSON duration (`"1.5s"`).
pub(crate) fn duration_at(v: &Value, path: &str) -> Result<Duration> {
    let s = v
        .as_str()
        .ok_or_else(|| InvalidConfig::value(path, v, duration::NOT_A_DURATION))?;
    duration::parse(s).map_err(|why| InvalidConfig::value(path, v, why))
}

/// A duration greater than zero.
pub(crate) fn positive_duration(v: &Value, path: &str) -> Result<Duration> {
    let d = duration_at(v, path)?;
    if d.is_zero() {
        return Err(InvalidConfig::value(path, v, "is not greater than 0s"));
    }
    Ok(d)
}

/// A finite number greater than zero.
pub(crate) fn positive_number(v: &Value, path: &str) -> Result<f64> {
    v.as_f64()
        .filter(|n| n.is_finite() && *n > 0.0)
        .ok_or_else(|| InvalidConfig::value(path, v, "is not a number greater than 0"))
}

/// An attempt count: an integer greater than 1, clamped to 5.
pub(crate) fn attempts(v: &Value, path: &str) -> Result<u32> {
    let n = v
        .as_u64()
        .filter(|&n| n > 1)
        .ok_or_else(|| InvalidConfig::value(path, v, "is not an integer greater than 1"))?;
    Ok(u32::try_from(n).unwrap_or(u32::MAX).min(MAX_ATTEMPTS_CAP))
}

/// A status code, by name (`"UNAVAILABLE"`) or number (`14`).
fn code(v: &Value, path: &str) -> Result<GrpcCode> {
    const WHAT: &str =
        "is not a gRPC status code (a name such as \"UNAVAILABLE\", or a number from 0 to 16)";
    let bad = || InvalidConfig::value(path, v, WHAT);
    if let Some(n) = v.as_u64() {
        let n = i32::try_from(n).ok().filter(|n| *n <= 16).ok_or_else(bad)?;
        return Ok(GrpcCode::from_i32(n));
    }
    let name = v.as_str().ok_or_else(bad)?;
    (0..=16)
        .map(GrpcCode::from_i32)
        .find(|c| c.as_str() == name)
        .ok_or_else(bad)
}

/// A list of status codes (at `path`), each once.
fn codes(v: &Value, path: &str) -> Result<Vec<GrpcCode>> {
    let mut out = Vec::new();
    for (i, c) in list(v, path)?.iter().enumerate() {
        let c = code(c, &format!("{path}[{i}]"))?;
        if !out.contains(&c) {
            out.push(c);
        }
    }
    Ok(out)
}

/// Reads a whole service config.
pub(crate) fn service_config(v: &Value) -> Result<ServiceConfig> {
    let top = object(v, "")?;
    let mut methods = Vec::new();
    // Each name seen, and where, to say where a duplicate was first.
    let mut seen: HashMap<MethodName, String> = HashMap::new();
    if let Some(list_v) = field(top, "methodConfig") {
        for (i, m) in list(list_v, "methodConfig")?.iter().enumerate() {
            let path = format!("methodConfig[{i}]");
            let config = method_config(m, &path)?;
            for (j, name) in config.names.iter().enumerate() {
                let here = format!("{path}.name[{j}]");
                if let Some(first) = seen.get(name) {
                    let what = if name.service.is_none() {
                        format!("a second default (empty name); the first is {first}")
                    } else {
                        format!("names the same method as {first}")
                    };
                    return Err(InvalidConfig::new(here, what));
                }
                seen.insert(name.clone(), here);
            }
            methods.push(config);
        }
    }
    let retry_throttling = field(top, "retryThrottling")
        .map(|t| throttling(t, "retryThrottling"))
        .transpose()?;
    Ok(ServiceConfig {
        methods,
        retry_throttling,
    })
}

fn method_config(v: &Value, path: &str) -> Result<MethodConfig> {
    let m = object(v, path)?;
    let names_path = join(path, "name");
    let names_v = required(m, path, "name")?;
    let mut names = Vec::new();
    for (j, n) in list(names_v, &names_path)?.iter().enumerate() {
        names.push(name(n, &format!("{names_path}[{j}]"))?);
    }
    if names.is_empty() {
        return Err(InvalidConfig::value(
            names_path,
            names_v,
            "is empty: it must list at least one name",
        ));
    }
    let timeout = field(m, "timeout")
        .map(|t| duration_at(t, &join(path, "timeout")))
        .transpose()?;
    let retry = field(m, "retryPolicy")
        .map(|r| retry_policy(r, &join(path, "retryPolicy")))
        .transpose()?;
    let hedging = field(m, "hedgingPolicy")
        .map(|h| hedging_policy(h, &join(path, "hedgingPolicy")))
        .transpose()?;
    let policy = match (retry, hedging) {
        (Some(_), Some(_)) => {
            return Err(InvalidConfig::new(
                path,
                "has both retryPolicy and hedgingPolicy: a method may have one or the other",
            ))
        }
        (Some(r), None) => Some(MethodPolicy::Retry(r)),
        (None, Some(h)) => Some(MethodPolicy::Hedging(h)),
        (None, None) => None,
    };
    Ok(MethodConfig {
        names,
        timeout,
        policy,
    })
}

fn name(v: &Value, path: &str) -> Result<MethodName> {
    let n = object(v, path)?;
    let part = |key: &str| -> Result<Option<String>> {
        field(n, key)
            .map(|s| string(s, &join(path, key)))
            .transpose()
            .map(|s| s.filter(|s| !s.is_empty()).map(str::to_owned))
    };
    let service = part("service")?;
    let method = part("method")?;
    if let (None, Some(method)) = (&service, &method) {
        return Err(InvalidConfig::value(
            join(path, "method"),
            &Value::from(method.as_str()),
            "must be empty when service is empty (an empty service names the default for every method)",
        ));
    }
    Ok(MethodName { service, method })
}

fn retry_policy(v: &Value, path: &str) -> Result<RetryPolicy> {
    let r = object(v, path)?;
    let at = |key: &str| join(path, key);
    let max_attempts = attempts(required(r, path, "maxAttempts")?, &at("maxAttempts"))?;
    let initial_backoff =
        positive_duration(required(r, path, "initialBackoff")?, &at("initialBackoff"))?;
    let max_backoff = positive_duration(required(r, path, "maxBackoff")?, &at("maxBackoff"))?;
    let backoff_multiplier = positive_number(
        required(r, path, "backoffMultiplier")?,
        &at("backoffMultiplier"),
    )?;
    let codes_v = required(r, path, "retryableStatusCodes")?;
    let retryable_status_codes = codes(codes_v, &at("retryableStatusCodes"))?;
    if retryable_status_codes.is_empty() {
        return Err(InvalidConfig::value(
            at("retryableStatusCodes"),
            codes_v,
            "is empty: it must list at least one status code",
        ));
    }
    let per_attempt_recv_timeout = field(r, "perAttemptRecvTimeout")
        .map(|t| positive_duration(t, &at("perAttemptRecvTimeout")))
        .transpose()?;
    Ok(RetryPolicy {
        max_attempts,
        initial_backoff,
        max_backoff,
        backoff_multiplier,
        retryable_status_codes,
        per_attempt_recv_timeout,
    })
}

fn hedging_policy(v: &Value, path: &str) -> Result<HedgingPolicy> {
    let h = object(v, path)?;
    let at = |key: &str| join(path, key);
    let max_attempts = attempts(required(h, path, "maxAttempts")?, &at("maxAttempts"))?;
    let hedging_delay = field(h, "hedgingDelay")
        .map(|d| duration_at(d, &at("hedgingDelay")))
        .transpose()?
        .unwrap_or_default();
    let non_fatal_status_codes = field(h, "nonFatalStatusCodes")
        .map(|c| codes(c, &at("nonFatalStatusCodes")))
        .transpose()?
        .unwrap_or_default();
    Ok(HedgingPolicy {
        max_attempts,
        hedging_delay,
        non_fatal_status_codes,
    })
}

fn throttling(v: &Value, path: &str) -> Result<RetryThrottling> {
    let t = object(v, path)?;
    let at = |key: &str| join(path, key);
    let tokens_v = required(t, path, "maxTokens")?;
    let max_tokens = tokens_v
        .as_u64()
        .filter(|n| (1..=1000).contains(n))
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(|| {
            InvalidConfig::value(
                at("maxTokens"),
                tokens_v,
                "is not an integer from 1 to 1000",
            )
        })?;
    let token_ratio = positive_number(required(t, path, "tokenRatio")?, &at("tokenRatio"))?;
    Ok(RetryThrottling {
        max_tokens,
        token_ratio,
    })
}

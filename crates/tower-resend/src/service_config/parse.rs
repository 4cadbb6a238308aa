//! The service config JSON read into [`ServiceConfig`], validated as gRPC's
//! retry design (gRFC A6) and the service config document say: every
//! invalid field is an [`InvalidConfig`] naming it. Keys are matched to
//! fields by [`keys`](super::keys).

use std::collections::HashMap;
use std::time::Duration;

use serde_json::Value;

use super::keys::{Field, Reader};
use super::{
    duration, HedgingPolicy, InvalidConfig, MethodConfig, MethodName, MethodPolicy, RetryPolicy,
    RetryThrottling, ServiceConfig,
};
use crate::classify::GrpcCode;

/// gRPC sends no more attempts than this, whatever a policy says.
pub(crate) const MAX_ATTEMPTS_CAP: u32 = 5;

type Result<T> = std::result::Result<T, InvalidConfig>;

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

/// A status code, by name or number (`"UNAVAILABLE"`, `14`), as grpc-go's
/// `codes.Code.UnmarshalJSON` reads it, but a name in any case
/// (`"unavailable"`), as gRFC A6 says (grpc-go takes upper case only).
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
        .find(|c| c.as_str().eq_ignore_ascii_case(name))
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

/// The fields of a service config that gRPC defines and a stack does not
/// apply, by JSON name: read by nothing here, and not unknown either.
const NOT_APPLIED: [&str; 4] = [
    "loadBalancingPolicy",
    "loadBalancingConfig",
    "healthCheckConfig",
    "connectionScaling",
];
/// The same, in a methodConfig.
const METHOD_NOT_APPLIED: [&str; 3] = [
    "waitForReady",
    "maxRequestMessageBytes",
    "maxResponseMessageBytes",
];

/// Reads a whole service config.
pub(crate) fn service_config(r: &mut Reader, v: &Value) -> Result<ServiceConfig> {
    let [method_config, retry_throttling] =
        r.object(v, "", ["methodConfig", "retryThrottling"], &NOT_APPLIED)?;
    let mut methods = Vec::new();
    // Each name seen, and where, to say where a duplicate was first.
    let mut seen: HashMap<MethodName, String> = HashMap::new();
    if let Some(list_v) = method_config.value() {
        let list_path = method_config.path();
        for (i, m) in list(list_v, list_path)?.iter().enumerate() {
            let Method { config, name_paths } = method(r, m, &format!("{list_path}[{i}]"))?;
            for (name, here) in config.names.iter().zip(name_paths) {
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
    let retry_throttling = retry_throttling.read(|t, path| throttling(r, t, path))?;
    Ok(ServiceConfig {
        methods,
        retry_throttling,
    })
}

/// A methodConfig, and the path of each of its names.
struct Method {
    config: MethodConfig,
    name_paths: Vec<String>,
}

fn method(r: &mut Reader, v: &Value, path: &str) -> Result<Method> {
    let [name_f, timeout, retry, hedging] = r.object(
        v,
        path,
        ["name", "timeout", "retryPolicy", "hedgingPolicy"],
        &METHOD_NOT_APPLIED,
    )?;
    let names_v = name_f.require(|v, _| Ok(v))?;
    let names_path = name_f.path();
    let mut names = Vec::new();
    let mut name_paths = Vec::new();
    for (j, n) in list(names_v, names_path)?.iter().enumerate() {
        let here = format!("{names_path}[{j}]");
        names.push(name(r, n, &here)?);
        name_paths.push(here);
    }
    if names.is_empty() {
        return Err(InvalidConfig::value(
            names_path,
            names_v,
            "is empty: it must list at least one name",
        ));
    }
    let timeout = timeout.read(duration_at)?;
    let retry = retry.read(|v, path| retry_policy(r, v, path))?;
    let hedging = hedging.read(|v, path| hedging_policy(r, v, path))?;
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
    Ok(Method {
        config: MethodConfig {
            names,
            timeout,
            policy,
        },
        name_paths,
    })
}

fn name(r: &mut Reader, v: &Value, path: &str) -> Result<MethodName> {
    let [service, method] = r.object(v, path, ["service", "method"], &[])?;
    let part = |f: &Field<'_>| -> Result<Option<String>> {
        let s = f.read(string)?;
        Ok(s.filter(|s| !s.is_empty()).map(str::to_owned))
    };
    let service_name = part(&service)?;
    let method_name = part(&method)?;
    if let (None, Some(m)) = (&service_name, &method_name) {
        return Err(InvalidConfig::value(
            method.path(),
            &Value::from(m.as_str()),
            "must be empty when service is empty (an empty service names the default for every method)",
        ));
    }
    Ok(MethodName {
        service: service_name,
        method: method_name,
    })
}

fn retry_policy(r: &mut Reader, v: &Value, path: &str) -> Result<RetryPolicy> {
    let [max_attempts, initial_backoff, max_backoff, multiplier, codes_f, per_attempt] = r.object(
        v,
        path,
        [
            "maxAttempts",
            "initialBackoff",
            "maxBackoff",
            "backoffMultiplier",
            "retryableStatusCodes",
            "perAttemptRecvTimeout",
        ],
        &[],
    )?;
    let max_attempts = max_attempts.require(attempts)?;
    let initial_backoff = initial_backoff.require(positive_duration)?;
    let max_backoff = max_backoff.require(positive_duration)?;
    let backoff_multiplier = multiplier.require(positive_number)?;
    let retryable_status_codes = codes_f.require(|v, path| {
        let codes = codes(v, path)?;
        if codes.is_empty() {
            return Err(InvalidConfig::value(
                path,
                v,
                "is empty: it must list at least one status code",
            ));
        }
        Ok(codes)
    })?;
    let per_attempt_recv_timeout = per_attempt.read(positive_duration)?;
    Ok(RetryPolicy {
        max_attempts,
        initial_backoff,
        max_backoff,
        backoff_multiplier,
        retryable_status_codes,
        per_attempt_recv_timeout,
    })
}

fn hedging_policy(r: &mut Reader, v: &Value, path: &str) -> Result<HedgingPolicy> {
    let [max_attempts, delay, codes_f] = r.object(
        v,
        path,
        ["maxAttempts", "hedgingDelay", "nonFatalStatusCodes"],
        &[],
    )?;
    Ok(HedgingPolicy {
        max_attempts: max_attempts.require(attempts)?,
        hedging_delay: delay.read(duration_at)?.unwrap_or_default(),
        non_fatal_status_codes: codes_f.read(codes)?.unwrap_or_default(),
    })
}

fn throttling(r: &mut Reader, v: &Value, path: &str) -> Result<RetryThrottling> {
    let [max_tokens, token_ratio] = r.object(v, path, ["maxTokens", "tokenRatio"], &[])?;
    let max_tokens = max_tokens.require(|v, path| {
        v.as_u64()
            .filter(|n| (1..=1000).contains(n))
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| InvalidConfig::value(path, v, "is not an integer from 1 to 1000"))
    })?;
    Ok(RetryThrottling {
        max_tokens,
        token_ratio: token_ratio.require(positive_number)?,
    })
}

//! What is wrong with a configuration, and where.

use std::fmt;

use serde_json::Value;

/// A service config (or a route table) that cannot be used: the field's
/// path (`methodConfig[1].retryPolicy.maxAttempts`) and what is wrong with
/// it, quoting the value when there is one (`1 is not an integer greater
/// than 1`).
///
/// ```
/// use tower_resend::service_config::ServiceConfig;
///
/// let err = ServiceConfig::from_json(r#"{"retryThrottling": {"maxTokens": 0, "tokenRatio": 0.1}}"#)
///     .unwrap_err();
/// assert_eq!(err.path(), "retryThrottling.maxTokens");
/// assert_eq!(err.to_string(), "retryThrottling.maxTokens: 0 is not an integer from 1 to 1000");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidConfig {
    path: String,
    message: String,
}

impl InvalidConfig {
    pub(crate) fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            message: message.into(),
        }
    }

    /// `value`, at `path`, is what is wrong: the message quotes it as JSON
    /// and says why (`"UNAVAILBLE" is not a gRPC status code`).
    pub(crate) fn value(path: impl Into<String>, value: &Value, why: &str) -> Self {
        Self::new(path, format!("{} {why}", quote(value)))
    }

    /// Where: the field's path, as `methodConfig[1].retryPolicy.maxAttempts`
    /// (empty for the whole document).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// What is wrong with it.
    pub fn message(&self) -> &str {
        &self.message
    }
}

/// `value` as JSON, cut after 60 characters: enough to find it, short
/// enough that a whole object does not bury the message.
fn quote(value: &Value) -> String {
    const MAX: usize = 60;
    let json = value.to_string();
    match json.char_indices().nth(MAX) {
        Some((at, _)) => format!("{}…", &json[..at]),
        None => json,
    }
}

impl fmt::Display for InvalidConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

impl std::error::Error for InvalidConfig {}

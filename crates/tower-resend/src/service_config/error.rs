//! What is wrong with a configuration, and where.

use std::fmt;

/// A service config (or a route table) that cannot be used: the field's
/// path (`methodConfig[1].retryPolicy.maxAttempts`) and what is wrong with
/// it (`must be an integer greater than 1`).
///
/// ```
/// use tower_resend::service_config::ServiceConfig;
///
/// let err = ServiceConfig::from_json(r#"{"retryThrottling": {"maxTokens": 0, "tokenRatio": 0.1}}"#)
///     .unwrap_err();
/// assert_eq!(err.path(), "retryThrottling.maxTokens");
/// assert_eq!(err.to_string(), "retryThrottling.maxTokens: must be an integer from 1 to 1000");
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

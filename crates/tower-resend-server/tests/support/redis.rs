//! The tests' Redis: its URL, and whether it answers.
#![allow(dead_code, unreachable_pub, clippy::print_stderr)]

use std::time::Duration;

/// `RESEND_REDIS_URL`, or the local server.
pub fn url() -> String {
    std::env::var("RESEND_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// True if the Redis at `url` answers `PING` within `within`.
pub async fn pings(url: &str, within: Duration) -> bool {
    let ping = async {
        let client = redis::Client::open(url).ok()?;
        let mut conn = client.get_multiplexed_async_connection().await.ok()?;
        redis::cmd("PING")
            .query_async::<String>(&mut conn)
            .await
            .ok()
    };
    matches!(tokio::time::timeout(within, ping).await, Ok(Some(_)))
}

/// True if the Redis at `url` answers; false, with a warning that the
/// test is skipped, when it does not; a panic then when `CI` is set.
pub async fn reachable(url: &str) -> bool {
    if pings(url, Duration::from_secs(3)).await {
        return true;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "Redis at {url} is unreachable, and CI is set"
    );
    eprintln!("WARNING: Redis at {url} is unreachable: test SKIPPED");
    false
}

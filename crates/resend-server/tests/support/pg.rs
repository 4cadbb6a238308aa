//! The tests' PostgreSQL: its URL and a pool on it.
#![allow(dead_code, unreachable_pub)]

use std::time::Duration;

use sqlx::postgres::{PgPool, PgPoolOptions};

/// `RESEND_PG_URL`, or the local server: TLS when it offers it
/// (`sslmode=prefer`; the local server's certificate is self-signed).
pub fn url() -> String {
    std::env::var("RESEND_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test?sslmode=prefer".into())
}

/// A pool on `url` of at most `size` connections, made as they are needed;
/// waiting for one is bounded.
pub fn pool(url: &str, size: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy(url)
        .expect("a PostgreSQL URL")
}

/// `url` with its port replaced by `port` (for a proxy in front).
pub fn with_port(url: &str, port: u16) -> String {
    let (head, rest) = url.split_once("@").expect("postgres://user@host:port/db");
    let (_, db) = rest.split_once('/').expect("postgres://user@host:port/db");
    format!("{head}@127.0.0.1:{port}/{db}")
}

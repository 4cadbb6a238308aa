//! A fleet kept to what a resolver says: resolved once before the first
//! call, then again on an interval in a task of its own.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::uri::Scheme;

use super::base::Base;
use super::Roster;

/// The shortest interval between two refreshes.
const MIN_EVERY: Duration = Duration::from_millis(100);

/// Sets `roster` to what `resolve` answers now (an error if it fails or
/// answers nothing), and spawns the task that refreshes it every `every`;
/// the task ends once the roster is dropped. A refresh that fails or
/// answers nothing keeps the last answer.
pub(super) async fn start<R, F>(
    roster: &Arc<Roster>,
    scheme: Scheme,
    resolve: R,
    every: Duration,
) -> io::Result<()>
where
    R: Fn() -> F + Send + 'static,
    F: Future<Output = io::Result<Vec<SocketAddr>>> + Send,
{
    let runtime = tokio::runtime::Handle::try_current()
        .map_err(|e| io::Error::other(format!("a DNS fleet needs a tokio runtime: {e}")))?;
    let first = resolve().await?;
    if first.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            "the name resolved to no address",
        ));
    }
    roster.set(&bases(&scheme, &first));
    let weak = Arc::downgrade(roster);
    let every = every.max(MIN_EVERY);
    runtime.spawn(async move {
        loop {
            tokio::time::sleep(every).await;
            let answer = resolve().await;
            let Some(roster) = weak.upgrade() else {
                return;
            };
            match answer {
                Ok(addrs) if !addrs.is_empty() => roster.set(&bases(&scheme, &addrs)),
                Ok(_) => tracing::debug!("DNS refresh answered no address; keeping the last"),
                Err(e) => {
                    tracing::debug!(error = %e, "DNS refresh failed; keeping the last answer")
                }
            }
        }
    });
    Ok(())
}

fn bases(scheme: &Scheme, addrs: &[SocketAddr]) -> Vec<Base> {
    let mut out: Vec<Base> = Vec::with_capacity(addrs.len());
    for base in addrs.iter().filter_map(|a| Base::of_socket(scheme, *a)) {
        if !out.contains(&base) {
            out.push(base);
        }
    }
    out
}

/// Every address `host` resolves to, on `port`.
pub(super) async fn lookup(host: String, port: u16) -> io::Result<Vec<SocketAddr>> {
    Ok(tokio::net::lookup_host((host.as_str(), port))
        .await?
        .collect())
}

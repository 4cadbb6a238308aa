//! A fleet kept to what a `tower::discover::Discover` stream says: each
//! `Insert` of an instance's base URI adds it, each `Remove` takes it out.

use std::future::poll_fn;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::Poll;

use http::Uri;
use tower::discover::{Change, Discover};

use super::base::Base;
use super::Roster;
use crate::error::BoxError;

/// The instances a stream has inserted and not removed, by its keys.
struct Known<K> {
    instances: Vec<(K, Base)>,
}

impl<K: Eq> Known<K> {
    /// Applies `change`; an address that is not a base URI (or has a
    /// query) is an error.
    fn apply(&mut self, change: Change<K, Uri>) -> Result<(), BoxError> {
        match change {
            Change::Insert(key, uri) => {
                let b = Base::from_uri(uri.clone()).map_err(|e| e.at(&uri.to_string()))?;
                self.instances.retain(|(k, _)| *k != key);
                self.instances.push((key, b));
            }
            Change::Remove(key) => self.instances.retain(|(k, _)| *k != key),
        }
        Ok(())
    }

    fn bases(&self) -> Vec<Base> {
        self.instances.iter().map(|(_, b)| b.clone()).collect()
    }
}

/// Waits for the stream's first instances (every change ready with the
/// first), sets `roster` to them, then follows the stream in a task of its
/// own, which ends with the stream or once the roster is dropped.
pub(super) async fn start<D>(roster: &Arc<Roster>, discover: D) -> Result<(), BoxError>
where
    D: Discover<Service = Uri> + Send + 'static,
    D::Key: Eq + Send,
    D::Error: Into<BoxError>,
{
    let runtime = tokio::runtime::Handle::try_current()
        .map_err(|e| format!("a discovered fleet needs a tokio runtime: {e}"))?;
    let mut discover = Box::pin(discover);
    let mut known = Known {
        instances: Vec::new(),
    };
    // The first change, waited for; then those ready with it.
    match poll_fn(|cx| discover.as_mut().poll_discover(cx)).await {
        Some(change) => known.apply(change.map_err(Into::into)?)?,
        None => return Err("the discovery stream ended before naming an instance".into()),
    }
    while let Some(change) = ready_now(discover.as_mut()).await {
        known.apply(change?)?;
    }
    roster.set(&known.bases());
    let weak = Arc::downgrade(roster);
    runtime.spawn(follow(discover, known, weak));
    Ok(())
}

/// The next change if one is ready now; `None` if none is (or the stream
/// ended).
async fn ready_now<D>(mut discover: Pin<&mut D>) -> Option<Result<Change<D::Key, Uri>, BoxError>>
where
    D: Discover<Service = Uri>,
    D::Error: Into<BoxError>,
{
    poll_fn(|cx| match discover.as_mut().poll_discover(cx) {
        Poll::Ready(Some(change)) => Poll::Ready(Some(change.map_err(Into::into))),
        Poll::Ready(None) | Poll::Pending => Poll::Ready(None),
    })
    .await
}

async fn follow<D>(mut discover: Pin<Box<D>>, mut known: Known<D::Key>, roster: Weak<Roster>)
where
    D: Discover<Service = Uri>,
    D::Key: Eq,
    D::Error: Into<BoxError>,
{
    while let Some(change) = poll_fn(|cx| discover.as_mut().poll_discover(cx)).await {
        let Some(roster) = roster.upgrade() else {
            return;
        };
        match change.map_err(Into::into).and_then(|c| known.apply(c)) {
            Ok(()) => roster.set(&known.bases()),
            Err(e) => {
                tracing::debug!(error = %e, "discovery: a change was refused; keeping the fleet")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use super::*;
    use crate::fleet::FleetLayer;

    type Sent = Result<Change<u32, Uri>, Infallible>;

    fn uri(s: &str) -> Uri {
        s.parse().unwrap()
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_discovered_fleet_follows_inserts_and_removes() {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Sent>();
        tx.send(Ok(Change::Insert(1, uri("http://10.0.0.1:80"))))
            .unwrap();
        tx.send(Ok(Change::Insert(2, uri("http://10.0.0.2:80"))))
            .unwrap();
        let stream =
            futures_util::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|c| (c, rx)) },
            );
        let fleet = FleetLayer::discover(stream).await.unwrap();
        let svc = tower_layer::Layer::layer(&fleet, ());
        let addrs = |svc: &crate::fleet::Fleet<(), _>| -> Vec<String> {
            svc.addresses().iter().map(ToString::to_string).collect()
        };
        assert_eq!(addrs(&svc), ["10.0.0.1:80", "10.0.0.2:80"]);

        tx.send(Ok(Change::Remove(1))).unwrap();
        tx.send(Ok(Change::Insert(3, uri("http://10.0.0.3:80"))))
            .unwrap();
        tokio::task::yield_now().await;
        assert_eq!(addrs(&svc), ["10.0.0.2:80", "10.0.0.3:80"]);

        // A change that is not an instance is refused, and the fleet kept;
        // so is a base with a query.
        tx.send(Ok(Change::Insert(4, uri("/relative")))).unwrap();
        tx.send(Ok(Change::Insert(5, uri("http://10.0.0.5:80/api?v=2"))))
            .unwrap();
        tokio::task::yield_now().await;
        assert_eq!(addrs(&svc), ["10.0.0.2:80", "10.0.0.3:80"]);
        let e = Known::<u32> {
            instances: Vec::new(),
        }
        .apply(Change::Insert(5, uri("http://10.0.0.5:80/api?v=2")))
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("\"http://10.0.0.5:80/api?v=2\": a base URI cannot have a query"),
            "{e}"
        );
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_stream_that_ends_empty_is_an_error() {
        let empty = futures_util::stream::iter(Vec::<Sent>::new());
        assert!(FleetLayer::discover(empty).await.is_err());
    }
}

//! What the idempotency layer counts: the events an operator watches,
//! ready to export as metrics.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use super::telemetry::ServerMetrics;

/// Counts kept by an [`IdempotencyLayer`](crate::IdempotencyLayer) and every
/// service it makes; cheap to clone (the clones share the counts). Each is a
/// running total since the layer was made, ready for a metrics exporter.
///
/// ```
/// use tower_resend_server::{IdempotencyLayer, MemoryStore};
///
/// let layer = IdempotencyLayer::new(MemoryStore::new());
/// let stats = layer.stats();
/// assert_eq!((stats.stored_late(), stats.unstored(), stats.leases_lost()), (0, 0, 0));
/// ```
#[derive(Clone, Default)]
pub struct IdempotencyStats(Arc<Counts>);

#[derive(Default)]
struct Counts {
    stored_late: AtomicU64,
    unstored: AtomicU64,
    leases_lost: AtomicU64,
    held: AtomicU64,
    /// The same events as metrics, if the layer was given a meter.
    metrics: ServerMetrics,
}

impl IdempotencyStats {
    /// Final responses the store did not take when the work ended (it was
    /// down or slow), held and stored later in the background.
    pub fn stored_late(&self) -> u64 {
        self.0.stored_late.load(Relaxed)
    }

    /// Final responses given up: the store did not take them within
    /// [`store_retry_for`](crate::IdempotencyLayer::store_retry_for), or too
    /// many were held at once. A retry of such a key (on another process, or
    /// after the record would have expired) may run the work again. Each is
    /// also an error event.
    pub fn unstored(&self) -> u64 {
        self.0.unstored.load(Relaxed)
    }

    /// Leases found taken over while their holder still worked (a renewal
    /// or the final store found another request holding the key): the store
    /// was unreachable for longer than a lease. Another run of the key may
    /// have happened. Each is also an error event.
    pub fn leases_lost(&self) -> u64 {
        self.0.leases_lost.load(Relaxed)
    }

    /// Final responses held in memory right now, waiting for the store.
    pub fn held(&self) -> u64 {
        self.0.held.load(Relaxed)
    }

    pub(crate) fn count_stored_late(&self) {
        self.0.stored_late.fetch_add(1, Relaxed);
        self.0.metrics.stored_late();
    }

    pub(crate) fn count_unstored(&self) {
        self.0.unstored.fetch_add(1, Relaxed);
        self.0.metrics.unstored();
    }

    pub(crate) fn count_lease_lost(&self) {
        self.0.leases_lost.fetch_add(1, Relaxed);
        self.0.metrics.lease_taken_over();
    }

    /// The metrics the layer records (none without a meter).
    pub(crate) fn metrics(&self) -> &ServerMetrics {
        &self.0.metrics
    }

    /// These counts, from now on also recorded on instruments made from
    /// `meter` (and the responses held observed): a new set of counts,
    /// starting from these.
    #[cfg(feature = "otel")]
    pub(crate) fn with_meter(&self, meter: &opentelemetry::metrics::Meter) -> Self {
        let was = &self.0;
        Self(Arc::new_cyclic(|counts: &std::sync::Weak<Counts>| {
            let counts = counts.clone();
            let held = move || counts.upgrade().map(|c| c.held.load(Relaxed));
            Counts {
                stored_late: AtomicU64::new(was.stored_late.load(Relaxed)),
                unstored: AtomicU64::new(was.unstored.load(Relaxed)),
                leases_lost: AtomicU64::new(was.leases_lost.load(Relaxed)),
                held: AtomicU64::new(was.held.load(Relaxed)),
                metrics: ServerMetrics::new(meter, held),
            }
        }))
    }

    pub(crate) fn set_held(&self, n: usize) {
        self.0
            .held
            .store(u64::try_from(n).unwrap_or(u64::MAX), Relaxed);
    }
}

impl fmt::Debug for IdempotencyStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyStats")
            .field("stored_late", &self.stored_late())
            .field("unstored", &self.unstored())
            .field("leases_lost", &self.leases_lost())
            .field("held", &self.held())
            .finish()
    }
}

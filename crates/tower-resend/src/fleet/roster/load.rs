//! What is in flight somewhere, and the limit on it: at one instance, or,
//! under a [total limit](super::super::FleetLayer::limit_total), at the
//! whole fleet.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use super::super::gauge::Gauge;
use super::super::limit::{admits, Signal};
use super::InstanceLimit;

/// Attempts in flight, and the limit found from their answers (in flight
/// first, `repr(C)`: every pick reads it, only a limited fleet the gauge).
#[derive(Debug, Default)]
#[repr(C)]
pub(crate) struct Load {
    in_flight: AtomicU32,
    gauge: Gauge,
}

impl Load {
    pub(crate) fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// The limit now: `None` while none binds.
    pub(crate) fn limit(&self) -> Option<u32> {
        self.gauge.limit()
    }

    /// Room for another attempt under the limit.
    pub(crate) fn room(&self) -> bool {
        admits(self.gauge.limit(), self.in_flight())
    }

    /// An attempt found no room: the limit binds (it grows only then).
    pub(crate) fn passed_over(&self) {
        self.gauge.passed_over();
    }

    /// One more attempt in flight, if the limit (`limited`: there is one)
    /// lets it in: checked and counted in one step, so that attempts at
    /// once cannot both take the last place.
    pub(crate) fn take_place(&self, limited: bool) -> bool {
        if !limited {
            self.in_flight.fetch_add(1, Ordering::Relaxed);
            return true;
        }
        let Some(limit) = self.gauge.limit() else {
            // None binds: counted as without one (the most at once kept,
            // for a cut to start from).
            let before = self.in_flight.fetch_add(1, Ordering::Relaxed);
            self.gauge.admitted(before.saturating_add(1));
            return true;
        };
        let limit = Some(limit);
        let taken = self
            .in_flight
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                admits(limit, n).then(|| n.saturating_add(1))
            });
        match taken {
            Ok(before) => {
                self.gauge.admitted(before.saturating_add(1));
                true
            }
            Err(_) => {
                self.gauge.passed_over();
                false
            }
        }
    }

    /// An attempt's place given back.
    pub(crate) fn give_back(&self) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
    }

    /// An attempt sent at `sent` under `cfg` ended at `now` (nanoseconds
    /// on the fleet's clock), saying `says`.
    pub(crate) fn ended(&self, cfg: &InstanceLimit, sent: u64, now: u64, says: Signal) {
        self.gauge.ended(cfg, sent, now, says, self.in_flight());
    }
}

/// A place taken under a shared limit (the fleet's total), given back when
/// the attempt ends.
#[derive(Debug)]
pub(crate) struct Place {
    pub(crate) load: Arc<Load>,
    pub(crate) cfg: InstanceLimit,
}

impl Place {
    /// A place in `load` under `cfg`, if it has room.
    pub(crate) fn take(load: &Arc<Load>, cfg: InstanceLimit) -> Option<Self> {
        load.take_place(true).then(|| Self {
            load: Arc::clone(load),
            cfg,
        })
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.load.give_back();
    }
}

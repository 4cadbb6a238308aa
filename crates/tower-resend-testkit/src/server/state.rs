//! What the server's handle and its tasks share: the compiled script, the
//! record of arrivals and effect counts, the connection count, the body
//! limit and the shutdown signal.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::AtomicUsize;
use std::sync::{Mutex, MutexGuard, PoisonError};

use tokio::sync::watch;

use crate::arrival::Arrival;
use crate::script::Plan;

/// What the server has seen and done.
#[derive(Debug, Default)]
pub(super) struct Record {
    pub(super) arrivals: Vec<Arrival>,
    pub(super) arrival_count: usize,
    pub(super) keyless_effects: usize,
    pub(super) keyed_effects: HashMap<String, usize>,
    pub(super) total_effects: usize,
}

impl Record {
    pub(super) fn effect(&mut self, key: Option<&str>) {
        match key {
            None => self.keyless_effects += 1,
            Some(key) => match self.keyed_effects.get_mut(key) {
                Some(n) => *n += 1,
                None => {
                    self.keyed_effects.insert(key.to_owned(), 1);
                }
            },
        }
        self.total_effects += 1;
    }
}

/// State shared by the handle, the accept loop and every request.
pub(super) struct Shared {
    pub(super) plan: Plan,
    pub(super) record: Mutex<Record>,
    pub(super) connections: AtomicUsize,
    pub(super) body_limit: usize,
    /// Resolves `changed()` with an error once the `TestServer` is dropped.
    pub(super) shutdown: watch::Receiver<()>,
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shared")
            .field("plan", &self.plan)
            .field("connections", &self.connections)
            .field("body_limit", &self.body_limit)
            .finish_non_exhaustive()
    }
}

impl Shared {
    pub(super) fn record(&self) -> MutexGuard<'_, Record> {
        self.record.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

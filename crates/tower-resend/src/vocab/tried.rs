//! The instances one call has used, shared by its attempts and hedged
//! copies through their request extensions: the retry layer puts an empty
//! record on the call, the fleet layer below writes each instance it sends
//! a copy to, and picks the next one elsewhere.

use std::sync::{Arc, Mutex, PoisonError};

use http::uri::Authority;

/// A fleet that can say whether an instance this call has not used could
/// take its next attempt.
pub(crate) trait Elsewhere: Send + Sync {
    /// An instance not in `used` is in service (not set aside).
    fn has_other(&self, used: &[u64]) -> bool;

    /// Its instances in service fail as much as an outlier would (its
    /// outlier detection lets every instance back): the upstream as a
    /// whole is failing, not one instance of it.
    fn failing(&self) -> bool;

    /// How many instances the fleet has.
    fn len(&self) -> usize;

    /// The addresses of the fleet's instances.
    fn authorities(&self) -> Vec<Arc<Authority>>;
}

#[derive(Default)]
struct Record {
    /// The instances used, by id, with their addresses (for an error to
    /// name them), in the order of first use; one list, so that a call
    /// allocates for it once.
    used: Vec<(u64, Arc<Authority>)>,
    fleet: Option<Arc<dyn Elsewhere>>,
    /// The instance whose answer came last (for the attempt's record).
    answered: Option<Arc<Authority>>,
}

/// What a call's fleet says of its next attempt.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct NextAttempt {
    /// An instance this call has not used can take it.
    pub(crate) elsewhere: bool,
    /// The upstream fails as a whole: the fleet's instances fail as much
    /// as an outlier would ([`Elsewhere::failing`]), or (set by the retry
    /// layer) the last attempts all failed.
    pub(crate) upstream_failing: bool,
}

/// The instances one call has used; clones share them.
#[derive(Clone, Default)]
pub(crate) struct Tried(Arc<Mutex<Record>>);

impl Tried {
    fn lock(&self) -> std::sync::MutexGuard<'_, Record> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The instances used so far.
    pub(crate) fn used(&self) -> Vec<u64> {
        self.lock().used.iter().map(|(id, _)| *id).collect()
    }

    /// The instance this call used last (first used last, for one it
    /// went back to).
    pub(crate) fn last_used(&self) -> Option<u64> {
        self.lock().used.last().map(|(id, _)| *id)
    }

    /// The addresses of the instances used so far, in the order the call
    /// first used them.
    pub(crate) fn servers(&self) -> Vec<Arc<Authority>> {
        self.lock()
            .used
            .iter()
            .map(|(_, server)| Arc::clone(server))
            .collect()
    }

    /// A copy of this call went to instance `id`, at `server`, of `fleet`.
    pub(crate) fn record(&self, id: u64, server: &Arc<Authority>, fleet: Arc<dyn Elsewhere>) {
        let mut r = self.lock();
        if !r.used.iter().any(|(used, _)| *used == id) {
            r.used.push((id, Arc::clone(server)));
        }
        r.fleet.get_or_insert(fleet);
    }

    /// The instance at `server` answered a copy of this call.
    pub(crate) fn answered(&self, server: Arc<Authority>) {
        self.lock().answered = Some(server);
    }

    /// The fleet this call's copies went to, once one went.
    pub(crate) fn fleet(&self) -> Option<Arc<dyn Elsewhere>> {
        self.lock().fleet.clone()
    }

    /// The instance that answered last, taken (for the attempt's record).
    pub(crate) fn take_answered(&self) -> Option<Arc<Authority>> {
        self.lock().answered.take()
    }

    /// What the fleet says of the call's next attempt (asked only after
    /// an answer that is not final).
    pub(crate) fn next(&self) -> NextAttempt {
        let r = self.lock();
        let Some(fleet) = r.fleet.as_ref() else {
            return NextAttempt::default();
        };
        let used: Vec<u64> = r.used.iter().map(|(id, _)| *id).collect();
        NextAttempt {
            elsewhere: fleet.has_other(&used),
            upstream_failing: fleet.failing(),
        }
    }
}

impl std::fmt::Debug for Tried {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Tried").field(&self.lock().used).finish()
    }
}

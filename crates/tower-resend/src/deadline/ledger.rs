//! Where a call's time went, for a server that must say why it answered 504.
//!
//! A server opens a [`scope_with_ledger`](super::scope_with_ledger) per
//! inbound request. Inside it, every tower-resend stack records its outbound calls
//! (by upstream name) and the handler may mark its own work with
//! [`internal`]; when the deadline runs out, [`TimeLedger::snapshot`] says
//! what was running and how long each part took.

use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};

use crate::name::Name;

use std::time::Duration;

use tokio::time::Instant;

/// What kind of work took the time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Source {
    /// An outbound call through a tower-resend stack.
    Upstream,
    /// The handler's own work, marked with [`internal`].
    Internal,
}

impl Source {
    /// `"upstream"` or `"internal"`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Upstream => "upstream",
            Self::Internal => "internal",
        }
    }
}

/// A record of the work done under one deadline scope. Cheap to clone
/// (clones share the record).
#[derive(Clone, Default)]
pub struct TimeLedger {
    inner: Arc<Mutex<Entries>>,
}

#[derive(Default)]
struct Entries {
    next_id: u64,
    active: Vec<(u64, Source, Name, Instant)>,
    spent: Vec<(Source, Name, Duration)>,
}

/// One piece of work in a [`Snapshot`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Upstream call or internal work.
    pub source: Source,
    /// The upstream's name, or the name the handler gave its work.
    pub name: Name,
    /// Time spent so far (for active work, until the snapshot was taken).
    pub spent: Duration,
}

/// What a [`TimeLedger`] held at one instant.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// Work still running, oldest first.
    pub active: Vec<Entry>,
    /// Finished work, summed by source and name, in the order first seen.
    pub finished: Vec<Entry>,
}

impl Snapshot {
    /// The innermost (newest) work still running: where the time is going now.
    pub fn running(&self) -> Option<&Entry> {
        self.active.last()
    }

    /// Total time per source and name, active and finished together.
    pub fn totals(&self) -> Vec<Entry> {
        let mut out: Vec<Entry> = Vec::new();
        for e in self.finished.iter().chain(&self.active) {
            match out
                .iter_mut()
                .find(|o| o.source == e.source && o.name == e.name)
            {
                Some(o) => o.spent += e.spent,
                None => out.push(e.clone()),
            }
        }
        out
    }
}

impl TimeLedger {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Entries> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records that work of `source` named `name` starts now; it ends when
    /// the returned guard is dropped.
    pub fn start(&self, source: Source, name: Name) -> LedgerGuard {
        let mut e = self.lock();
        let id = e.next_id;
        e.next_id += 1;
        e.active.push((id, source, name, Instant::now()));
        LedgerGuard {
            ledger: self.clone(),
            id,
        }
    }

    /// What was running and what was spent, as of now.
    pub fn snapshot(&self) -> Snapshot {
        let now = Instant::now();
        let e = self.lock();
        let mut finished: Vec<Entry> = Vec::new();
        for (source, name, spent) in &e.spent {
            match finished
                .iter_mut()
                .find(|f| f.source == *source && f.name == *name)
            {
                Some(f) => f.spent += *spent,
                None => finished.push(Entry {
                    source: *source,
                    name: name.clone(),
                    spent: *spent,
                }),
            }
        }
        Snapshot {
            active: e
                .active
                .iter()
                .map(|(_, source, name, since)| Entry {
                    source: *source,
                    name: name.clone(),
                    spent: now.saturating_duration_since(*since),
                })
                .collect(),
            finished,
        }
    }
}

impl fmt::Debug for TimeLedger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("TimeLedger").field(&self.snapshot()).finish()
    }
}

/// Ends a piece of work in a [`TimeLedger`] when dropped.
#[derive(Debug)]
pub struct LedgerGuard {
    ledger: TimeLedger,
    id: u64,
}

impl Drop for LedgerGuard {
    fn drop(&mut self) {
        let mut e = self.ledger.lock();
        if let Some(i) = e.active.iter().position(|(id, ..)| *id == self.id) {
            let (_, source, name, since) = e.active.remove(i);
            e.spent.push((source, name, since.elapsed()));
        }
    }
}

/// Marks `future` as the handler's own work named `name` (a database query,
/// say) in the ambient ledger, if the task has one; otherwise it just runs.
///
/// ```
/// # async fn query() -> u32 { 7 }
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let rows = tower_resend::deadline::internal("db", query()).await;
/// # assert_eq!(rows, 7);
/// # }
/// ```
pub fn internal<F: Future>(name: impl Into<Name>, future: F) -> impl Future<Output = F::Output> {
    let name = name.into();
    async move {
        // Recorded from its first poll to its end (or until it is dropped).
        let _work = super::current_ledger().map(|l| l.start(Source::Internal, name));
        future.await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn records_active_and_finished_work() {
        let l = TimeLedger::new();
        let db = l.start(Source::Internal, "db".into());
        tokio::time::advance(Duration::from_millis(30)).await;
        drop(db);
        let _up = l.start(Source::Upstream, "shipping".into());
        tokio::time::advance(Duration::from_millis(70)).await;
        let s = l.snapshot();
        assert_eq!(
            s.running().map(|e| (e.source, &*e.name)),
            Some((Source::Upstream, "shipping"))
        );
        assert_eq!(
            s.running().map(|e| e.spent),
            Some(Duration::from_millis(70))
        );
        assert_eq!(
            s.finished,
            vec![Entry {
                source: Source::Internal,
                name: "db".into(),
                spent: Duration::from_millis(30)
            }]
        );
        assert_eq!(s.totals().len(), 2);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn internal_marks_work_in_the_ambient_ledger() {
        let l = TimeLedger::new();
        let d = super::super::Deadline::after(Duration::from_secs(1));
        super::super::server::scope_with_ledger(d, l.clone(), async {
            internal("db", tokio::time::sleep(Duration::from_millis(20))).await;
        })
        .await;
        assert_eq!(l.snapshot().finished[0].spent, Duration::from_millis(20));
        // Outside a scope it just runs.
        internal("db", async {}).await;
    }
}

//! Up or down: the [`Power`] a [`FaultProxy`](crate::FaultProxy) publishes,
//! and the [`Stop`] and [`Gate`] through which a connection's task hears that
//! it must reset its connection.

use tokio::sync::watch;

/// Whether the target is "up", and how many times it went down.
#[derive(Clone, Copy, Debug)]
pub(super) struct Power {
    pub(super) down: bool,
    /// Bumped by every [`FaultProxy::down`](crate::FaultProxy::down): a
    /// connection accepted under an older generation is reset.
    pub(super) generation: u64,
}

/// Tells a connection task that it must reset its connection.
pub(super) struct Stop {
    pub(super) shutdown: watch::Receiver<()>,
    pub(super) power: watch::Receiver<Power>,
    /// The generation the connection was accepted under.
    pub(super) generation: u64,
}

impl Stop {
    /// Completes once the proxy is dropped or taken down.
    pub(super) async fn stopped(&mut self) {
        let generation = self.generation;
        tokio::select! {
            biased;
            _ = self.shutdown.changed() => {}
            _ = self.power.wait_for(|power| power.generation != generation) => {}
        }
    }

    /// A [`Gate`] for the relay, which runs beside [`Stop::stopped`].
    pub(super) fn gate(&self) -> Gate {
        Gate {
            power: self.power.clone(),
            generation: self.generation,
        }
    }
}

/// Checked before relaying anything, so that nothing passes once
/// [`FaultProxy::down`](crate::FaultProxy::down) has returned, even on a task
/// that is running at that moment on another thread.
pub(super) struct Gate {
    power: watch::Receiver<Power>,
    generation: u64,
}

impl Gate {
    pub(super) fn check(&self) -> Result<(), Down> {
        if self.power.borrow().generation == self.generation {
            Ok(())
        } else {
            Err(Down)
        }
    }
}

/// What [`Gate::check`] finds once the target went down: the connection is
/// to be reset.
#[derive(Debug)]
pub(super) struct Down;

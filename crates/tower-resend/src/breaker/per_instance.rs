//! The circuit breaker over a fleet: a circuit per instance, with the
//! layer's rules, so that one bad instance opens its own circuit and not
//! the upstream's (the fleet then picks among the others).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use arc_swap::ArcSwap;
use http::uri::Authority;

use super::shared::{Breaker, Config, Ticket};
use super::state::{observes_upstream, outcome_of, Outcome};
use crate::name::Name;
use crate::vocab::{Circuits, Class, Pass, Refusal};

/// Each instance's circuit, by the instance's id.
type Map = HashMap<u64, Arc<Breaker<()>>>;

/// Every instance's circuit, made when the instance joins the fleet (or,
/// failing that, the first time an attempt goes there), kept while it is
/// in the fleet (however large), gone with it. An attempt looks its
/// circuit up in a map it loads without a lock or a count that every
/// thread writes; the map is made again, whole, only when the fleet
/// changes.
pub(crate) struct InstanceCircuits {
    config: Config,
    circuits: ArcSwap<Map>,
    /// Held by whoever makes the map again, so that two changes at once
    /// do not lose one (an attempt never takes it but for an instance the
    /// map does not have yet).
    changing: Mutex<()>,
}

impl InstanceCircuits {
    pub(crate) fn new(config: Config) -> Self {
        Self {
            config,
            circuits: ArcSwap::from_pointee(HashMap::new()),
            changing: Mutex::new(()),
        }
    }

    /// A new circuit for the instance at `authority`, named by it in its
    /// errors and its metrics.
    fn make(&self, authority: &Authority) -> Arc<Breaker<()>> {
        let mut config = self.config.clone();
        config.upstream = Some(Name::from(authority.to_string()));
        Arc::new(Breaker::new(config, (), false))
    }

    fn circuit(&self, id: u64, authority: &Authority) -> Arc<Breaker<()>> {
        if let Some(c) = self.circuits.load().get(&id) {
            return Arc::clone(c);
        }
        // An instance the fleet has not told of yet (or a circuit asked
        // for outside a fleet): made and added, under the lock.
        let _changing = self.changing.lock().unwrap_or_else(PoisonError::into_inner);
        let now = self.circuits.load();
        if let Some(c) = now.get(&id) {
            return Arc::clone(c);
        }
        let mut next = Map::clone(&now);
        let made = Arc::clone(next.entry(id).or_insert_with(|| self.make(authority)));
        self.circuits.store(Arc::new(next));
        made
    }
}

impl Circuits for InstanceCircuits {
    fn keep(&self, live: &[(u64, &Authority)]) {
        let _changing = self.changing.lock().unwrap_or_else(PoisonError::into_inner);
        let now = self.circuits.load();
        let next: Map = live
            .iter()
            .map(|&(id, authority)| {
                let circuit = now.get(&id).cloned();
                (id, circuit.unwrap_or_else(|| self.make(authority)))
            })
            .collect();
        self.circuits.store(Arc::new(next));
    }

    fn admit(&self, id: u64, authority: &Authority) -> Result<Box<dyn Pass>, Refusal> {
        let circuit = self.circuit(id, authority);
        let ticket = circuit.try_admit(None)?;
        Ok(Box::new(InstancePass {
            circuit,
            ticket,
            settled: false,
        }))
    }
}

/// An attempt let through an instance's circuit.
struct InstancePass {
    circuit: Arc<Breaker<()>>,
    ticket: Ticket,
    settled: bool,
}

impl Pass for InstancePass {
    fn settle(
        mut self: Box<Self>,
        class: Class,
        error: Option<&(dyn std::error::Error + 'static)>,
    ) {
        self.settled = true;
        let outcome = match error {
            Some(e) if !observes_upstream(e) => Outcome::Ignored,
            _ => outcome_of(class, self.circuit.failing()),
        };
        self.circuit.settle(self.ticket, outcome);
    }
}

impl Drop for InstancePass {
    fn drop(&mut self) {
        if !self.settled {
            self.circuit.settle(self.ticket, Outcome::Ignored);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::breaker::CircuitBreakerLayer;

    /// A circuit for every instance however many there are (a DNS fleet of
    /// 2 000), made when the fleet tells of it; an instance the fleet has
    /// not told of gets one at its first attempt; an instance that leaves
    /// takes its circuit with it.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn every_instance_keeps_its_circuit_while_it_is_in_the_fleet() {
        let (_, circuits) = CircuitBreakerLayer::new().into_instances(());
        let authority = |id: u64| -> Authority {
            format!("10.0.{}.{}:80", id / 256, id % 256)
                .parse()
                .unwrap()
        };
        let authorities: Vec<Authority> = (0..2000).map(authority).collect();
        let live: Vec<(u64, &Authority)> = (0..2000).zip(&authorities).collect();
        circuits.keep(&live);
        let held = |c: &InstanceCircuits| c.circuits.load().len();
        assert_eq!(held(&circuits), 2000);
        let first = circuits.circuit(7, &authority(7));
        for (id, a) in &live {
            assert!(circuits.admit(*id, a).is_ok());
        }
        assert_eq!(held(&circuits), 2000, "no circuit made again");
        // The same instance gets its own circuit again, not a new one.
        assert!(Arc::ptr_eq(&first, &circuits.circuit(7, &authority(7))));
        // One the fleet has not told of: made at its first attempt.
        assert!(circuits.admit(5000, &authority(5000)).is_ok());
        assert_eq!(held(&circuits), 2001);
        // Half the fleet leaves: half the circuits go; the others keep
        // theirs.
        let kept = circuits.circuit(1500, &authority(1500));
        circuits.keep(&live[1000..]);
        assert_eq!(held(&circuits), 1000);
        assert!(!circuits.circuits.load().contains_key(&7));
        assert!(Arc::ptr_eq(
            &kept,
            &circuits.circuit(1500, &authority(1500))
        ));
    }
}

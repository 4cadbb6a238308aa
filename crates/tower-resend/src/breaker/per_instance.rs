//! The circuit breaker over a fleet: a circuit per instance, with the
//! layer's rules, so that one bad instance opens its own circuit and not
//! the upstream's (the fleet then picks among the others).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use http::uri::Authority;

use super::shared::{Breaker, Config, Ticket};
use super::state::{observes_upstream, outcome_of, Outcome};
use crate::name::Name;
use crate::vocab::{Circuits, Class, Pass, Refusal};

/// Every instance's circuit, made the first time an attempt goes there,
/// kept while the instance is in the fleet (however large), gone with it.
pub(crate) struct InstanceCircuits {
    config: Config,
    circuits: Mutex<HashMap<u64, Arc<Breaker<()>>>>,
}

impl InstanceCircuits {
    pub(crate) fn new(config: Config) -> Self {
        Self {
            config,
            circuits: Mutex::new(HashMap::new()),
        }
    }

    fn circuit(&self, id: u64, authority: &Authority) -> Arc<Breaker<()>> {
        let mut circuits = self.circuits.lock().unwrap_or_else(PoisonError::into_inner);
        Arc::clone(circuits.entry(id).or_insert_with(|| {
            // Named by the instance, in its errors and its metrics.
            let mut config = self.config.clone();
            config.upstream = Some(Name::from(authority.to_string()));
            Arc::new(Breaker::new(config, ()))
        }))
    }
}

impl Circuits for InstanceCircuits {
    fn retain(&self, live: &[u64]) {
        let mut circuits = self.circuits.lock().unwrap_or_else(PoisonError::into_inner);
        let mut live = live.to_vec();
        live.sort_unstable();
        circuits.retain(|id, _| live.binary_search(id).is_ok());
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
    /// 2 000), and an instance that leaves takes its circuit with it.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn every_instance_keeps_its_circuit_while_it_is_in_the_fleet() {
        let (_, circuits) = CircuitBreakerLayer::new().into_instances(());
        let authority = |id: u64| -> Authority {
            format!("10.0.{}.{}:80", id / 256, id % 256)
                .parse()
                .unwrap()
        };
        for id in 0..2000 {
            assert!(circuits.admit(id, &authority(id)).is_ok());
        }
        let held = |c: &InstanceCircuits| c.circuits.lock().unwrap().len();
        assert_eq!(held(&circuits), 2000);
        // The same instance gets its own circuit again, not a new one.
        let first = circuits.circuit(7, &authority(7));
        assert!(Arc::ptr_eq(&first, &circuits.circuit(7, &authority(7))));
        // Half the fleet leaves: half the circuits go.
        let live: Vec<u64> = (1000..2000).rev().collect();
        circuits.retain(&live);
        assert_eq!(held(&circuits), 1000);
        assert!(!circuits.circuits.lock().unwrap().contains_key(&7));
    }
}

//! The tests' capture of tracing events, for the modules whose events are
//! part of what they promise (the breaker's changes of state, the service
//! config's fields not read).

use std::fmt;
use std::sync::{Arc, Mutex};

/// One event: its level, its message, and its other fields as they print.
pub(crate) type Event = (tracing::Level, String, Vec<(String, String)>);

/// Collects the events whose target starts with a prefix.
///
/// With one dispatcher alive, tracing asks the registering thread's own
/// default whether a callsite is wanted, and another test's thread (with
/// none) would make it "never" for all; with two alive, it asks them all:
/// keep a second one ([`Events::keep_callsites_open`]) while testing.
#[derive(Clone)]
pub(crate) struct Events {
    prefix: &'static str,
    events: Arc<Mutex<Vec<Event>>>,
}

impl Events {
    /// The events of targets under `prefix` (`tower_resend::breaker`).
    pub(crate) fn under(prefix: &'static str) -> Self {
        Self {
            prefix,
            events: Arc::default(),
        }
    }

    /// A second dispatcher to hold while testing (see above).
    pub(crate) fn keep_callsites_open() -> tracing::Dispatch {
        tracing::Dispatch::new(Self::under(""))
    }

    /// The events so far.
    pub(crate) fn got(&self) -> Vec<Event> {
        self.events.lock().unwrap().clone()
    }
}

/// The value of field `name` of an event's `fields`.
pub(crate) fn field<'a>(fields: &'a [(String, String)], name: &str) -> Option<&'a str> {
    fields
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

impl tracing::Subscriber for Events {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        #[derive(Default)]
        struct Fields(String, Vec<(String, String)>);
        impl tracing::field::Visit for Fields {
            fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
                match field.name() {
                    "message" => self.0 = value.to_owned(),
                    name => self.1.push((name.to_owned(), value.to_owned())),
                }
            }
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn fmt::Debug) {
                let value = format!("{value:?}");
                match field.name() {
                    "message" => self.0 = value,
                    name => self.1.push((name.to_owned(), value)),
                }
            }
        }
        if !event.metadata().target().starts_with(self.prefix) {
            return;
        }
        let mut f = Fields::default();
        event.record(&mut f);
        let level = *event.metadata().level();
        self.events.lock().unwrap().push((level, f.0, f.1));
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

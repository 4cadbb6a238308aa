//! The fleet's two errors: a fleet that cannot be built as it was given
//! ([`InvalidFleet`]), and an attempt that failed at one of its instances
//! ([`InstanceError`]).

use std::fmt;
use std::sync::Arc;

use http::uri::Authority;

use crate::error::BoxError;

/// A fleet that cannot be built as it was given: an instance's address
/// that is not a base URI (a scheme and an authority, and a path if the
/// upstream's API sits under one, but no query and no fragment), or no
/// instance at all.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidFleet {
    problem: Problem,
    /// The address refused (empty for [`Problem::Empty`]).
    address: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Problem {
    NotABase,
    Query,
    Fragment,
    Empty,
}

impl InvalidFleet {
    fn new(problem: Problem, address: &str) -> Self {
        Self {
            problem,
            address: address.to_owned(),
        }
    }

    pub(super) fn not_a_base(address: &str) -> Self {
        Self::new(Problem::NotABase, address)
    }

    pub(super) fn query(address: &str) -> Self {
        Self::new(Problem::Query, address)
    }

    pub(super) fn fragment(address: &str) -> Self {
        Self::new(Problem::Fragment, address)
    }

    /// No instance at all.
    pub(super) fn empty() -> Self {
        Self::new(Problem::Empty, "")
    }

    /// The same problem, found in `address`.
    pub(super) fn at(mut self, address: &str) -> Self {
        address.clone_into(&mut self.address);
        self
    }
}

impl fmt::Display for InvalidFleet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let address = &self.address;
        match self.problem {
            Problem::Empty => {
                f.write_str("a fleet needs at least one instance: the list of instances is empty")
            }
            Problem::NotABase => write!(
                f,
                "invalid instance address {address:?}: expected a base URI such as \
                 \"http://10.0.0.1:8080\" (or, with a path kept on every request, \
                 \"http://10.0.0.1:8080/api/v2\")"
            ),
            Problem::Query => write!(
                f,
                "invalid instance address {address:?}: a base URI cannot have a query \
                 (each request's query is its own): leave out the \"?\" and what follows"
            ),
            Problem::Fragment => write!(
                f,
                "invalid instance address {address:?}: a base URI cannot have a fragment \
                 (it is never sent): leave out the \"#\" and what follows"
            ),
        }
    }
}

impl std::error::Error for InvalidFleet {}

/// An attempt that failed at one instance of a [fleet](super): it names
/// the instance, and the instances the call had tried by then (when a
/// retry layer above keeps the record); the failure itself is its
/// [`source`](std::error::Error::source), which tower-resend's
/// [`Error::from_box`](crate::Error::from_box) and the classifiers read
/// through as if it were not there.
///
/// As the Rust API guidelines ask of an error with a source, its text is
/// its own words only ("instance 10.0.0.2:8080 (the call tried
/// 10.0.0.1:8080, 10.0.0.2:8080)"): a report that walks the chain, as
/// [`tower_resend::Error`](crate::Error)'s text does, says the cause after
/// it. tower-resend's own errors (an attempt timeout, a deadline) are not
/// wrapped: the layers above read them as they are.
pub struct InstanceError {
    instance: Arc<Authority>,
    tried: Box<[Arc<Authority>]>,
    source: BoxError,
}

impl InstanceError {
    /// The failure `source` of an attempt at `instance`, after the call
    /// had tried `tried` (in the order it used them).
    pub(super) fn new(
        instance: Arc<Authority>,
        tried: Vec<Arc<Authority>>,
        source: BoxError,
    ) -> Self {
        Self {
            instance,
            tried: tried.into_boxed_slice(),
            source,
        }
    }

    /// The instance the attempt failed at.
    pub fn instance(&self) -> &Authority {
        &self.instance
    }

    /// The instances the call had tried when this attempt failed, this
    /// one included, in the order it used them; empty when no retry layer
    /// above keeps the call's record.
    pub fn tried(&self) -> impl Iterator<Item = &Authority> + '_ {
        self.tried.iter().map(|a| &**a)
    }
}

impl fmt::Debug for InstanceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InstanceError")
            .field("instance", &self.instance)
            .field("tried", &self.tried)
            .field("source", &self.source)
            .finish()
    }
}

impl fmt::Display for InstanceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "instance {}", self.instance)?;
        if self.tried.len() > 1 {
            f.write_str(" (the call tried ")?;
            for (i, a) in self.tried.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "{a}")?;
            }
            f.write_str(")")?;
        }
        Ok(())
    }
}

impl std::error::Error for InstanceError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.source)
    }
}

#[cfg(test)]
mod tests {
    use std::io;

    use http::{Method, Uri};

    use super::*;
    use crate::classify::{Class, Classify, HttpClassifier, RequestFacts};
    use crate::Error;

    fn authority(s: &str) -> Arc<Authority> {
        Arc::new(s.parse().unwrap())
    }

    fn refused_at(instance: &str, tried: &[&str]) -> InstanceError {
        let refused = io::Error::from(io::ErrorKind::ConnectionRefused);
        let tried = tried.iter().map(|a| authority(a)).collect();
        InstanceError::new(
            authority(instance),
            tried,
            Error::connect(Box::new(refused)).into(),
        )
    }

    #[test]
    fn an_instance_error_names_the_instances_and_hides_nothing_of_its_cause() {
        let e = refused_at("127.0.0.1:2", &["127.0.0.1:1", "127.0.0.1:2"]);
        assert_eq!(
            e.to_string(),
            "instance 127.0.0.1:2 (the call tried 127.0.0.1:1, 127.0.0.1:2)"
        );
        assert_eq!(e.instance().as_str(), "127.0.0.1:2");
        assert_eq!(e.tried().count(), 2);
        // One instance tried: it is the one named.
        assert_eq!(
            refused_at("127.0.0.1:1", &["127.0.0.1:1"]).to_string(),
            "instance 127.0.0.1:1"
        );
        assert_eq!(
            refused_at("127.0.0.1:1", &[]).to_string(),
            "instance 127.0.0.1:1"
        );

        // The classifier walks through it: still "not sent".
        let (method, uri, headers) = (Method::GET, Uri::from_static("/"), http::HeaderMap::new());
        let facts = RequestFacts::new(&method, &uri, &headers);
        let class = Classify::<()>::classify_error(&HttpClassifier::new(), &facts, &e).class();
        assert_eq!(class, Class::NotSent);

        // So does `Error::from_box`: a transport error not sent, whose text
        // names the instance and then its cause.
        let err = Error::from_box(Box::new(e));
        assert!(err.is_not_sent(), "{err}");
        let text = err.to_string();
        assert!(
            text.contains("instance 127.0.0.1:2 (the call tried 127.0.0.1:1, 127.0.0.1:2)"),
            "{text}"
        );
        assert!(text.to_lowercase().contains("refused"), "{text}");
        // Its summary (for callers) leaves the addresses out.
        assert!(!err.summary().to_string().contains("127.0.0.1"));
    }

    #[test]
    fn an_empty_fleet_says_so() {
        assert_eq!(
            InvalidFleet::empty().to_string(),
            "a fleet needs at least one instance: the list of instances is empty"
        );
    }
}

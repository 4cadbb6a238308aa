//! The fleet's errors: a fleet that cannot be built as it was given
//! ([`InvalidFleet`]).

use std::fmt;

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_fleet_says_so() {
        assert_eq!(
            InvalidFleet::empty().to_string(),
            "a fleet needs at least one instance: the list of instances is empty"
        );
    }
}

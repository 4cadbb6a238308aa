//! The name of an upstream, cheap to hand to every call.

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

/// The name of an upstream ("shipping"): it shows up in errors, tracing and
/// 504 bodies.
///
/// A `&'static str` (the usual case: a literal) is copied with each call; any
/// other string is shared. Either way no call allocates, and no two threads
/// contend on a reference count for a literal name.
///
/// ```
/// use tower_resend::Name;
///
/// let a: Name = "shipping".into();
/// let b: Name = String::from("shipping").into();
/// assert_eq!(a, b);
/// assert_eq!(&*a, "shipping");
/// ```
#[derive(Clone)]
pub struct Name(Repr);

#[derive(Clone)]
enum Repr {
    Static(&'static str),
    Shared(Arc<str>),
}

impl Name {
    /// The name.
    pub fn as_str(&self) -> &str {
        match &self.0 {
            Repr::Static(s) => s,
            Repr::Shared(s) => s,
        }
    }
}

impl Deref for Name {
    type Target = str;

    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl AsRef<str> for Name {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl PartialEq for Name {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for Name {}

impl std::hash::Hash for Name {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_str().hash(state);
    }
}

impl fmt::Debug for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<&'static str> for Name {
    fn from(s: &'static str) -> Self {
        Self(Repr::Static(s))
    }
}

impl From<String> for Name {
    fn from(s: String) -> Self {
        Self(Repr::Shared(s.into()))
    }
}

impl From<Arc<str>> for Name {
    fn from(s: Arc<str>) -> Self {
        Self(Repr::Shared(s))
    }
}

impl From<Box<str>> for Name {
    fn from(s: Box<str>) -> Self {
        Self(Repr::Shared(s.into()))
    }
}

//! [`Script`]: which [`Reply`] each request gets.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::arrival::Arrival;
use crate::reply::Reply;

pub(crate) type ReplyFn = Arc<dyn Fn(&Arrival) -> Reply + Send + Sync + 'static>;

/// Which [`Reply`] each request gets.
///
/// A script has a queue of replies and a fallback. The Nth request it handles
/// gets the Nth queued reply; once the queue is used up, every request gets the
/// fallback ([`Reply::ok`] unless set with [`otherwise`](Script::otherwise) or
/// [`from_fn`](Script::from_fn)). [`route`](Script::route) sends requests for
/// one path to a sub-script with its own queue and fallback.
///
/// A script is a plain value: each [`TestServer`](crate::TestServer) started
/// from it (or from a clone of it) starts at the head of the queue.
///
/// Requests whose body could not be read (the client failed mid-body, or it
/// exceeded the body limit) are recorded as arrivals but do not consume a
/// queued reply.
///
/// ```
/// use tower_resend_testkit::{Reply, Script};
///
/// let script = Script::new()
///     .then_n(2, Reply::status(503))
///     .otherwise(Reply::ok().body("done"))
///     .route("/health", Script::new());
/// # let _ = script;
/// ```
#[derive(Clone)]
pub struct Script {
    queue: Vec<(usize, Reply)>,
    fallback: Fallback,
    routes: Vec<(String, Script)>,
}

#[derive(Clone)]
enum Fallback {
    Reply(Reply),
    Fn(ReplyFn),
}

impl fmt::Debug for Fallback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fallback::Reply(reply) => reply.fmt(f),
            Fallback::Fn(_) => f.write_str("<fn>"),
        }
    }
}

impl fmt::Debug for Script {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Script")
            .field("queue", &self.queue)
            .field("fallback", &self.fallback)
            .field("routes", &self.routes)
            .finish()
    }
}

impl Default for Script {
    fn default() -> Script {
        Script::new()
    }
}

impl Script {
    /// Every request gets `200 OK`.
    pub fn new() -> Script {
        Script {
            queue: Vec::new(),
            fallback: Fallback::Reply(Reply::ok()),
            routes: Vec::new(),
        }
    }

    /// Every request not served from the queue gets the reply `f` computes
    /// from its [`Arrival`]: full control. Combine with [`then`](Script::then)
    /// and [`route`](Script::route) as with any script.
    ///
    /// `f` runs on the server's tasks; it must not block.
    ///
    /// ```
    /// use tower_resend_testkit::{Reply, Script};
    ///
    /// // The first two arrivals at the server fail, the rest succeed.
    /// let script = Script::from_fn(|arrival| {
    ///     if arrival.attempt <= 2 { Reply::status(503) } else { Reply::ok() }
    /// });
    /// # let _ = script;
    /// ```
    pub fn from_fn(f: impl Fn(&Arrival) -> Reply + Send + Sync + 'static) -> Script {
        Script {
            fallback: Fallback::Fn(Arc::new(f)),
            ..Script::new()
        }
    }

    /// Queue `reply` for the next request in line.
    pub fn then(self, reply: Reply) -> Script {
        self.then_n(1, reply)
    }

    /// Queue `reply` for the next `n` requests in line.
    pub fn then_n(mut self, n: usize, reply: Reply) -> Script {
        if n > 0 {
            self.queue.push((n, reply));
        }
        self
    }

    /// The reply for every request once the queue is used up (default
    /// [`Reply::ok`]). Replaces a [`from_fn`](Script::from_fn) function.
    pub fn otherwise(mut self, reply: Reply) -> Script {
        self.fallback = Fallback::Reply(reply);
        self
    }

    /// Requests whose path (without the query) equals `path` follow `script`
    /// (its own queue, fallback and routes) instead of this one. Routing a
    /// path again replaces the earlier route.
    pub fn route(mut self, path: &str, script: Script) -> Script {
        self.routes.retain(|(p, _)| p != path);
        self.routes.push((path.to_owned(), script));
        self
    }

    /// The runtime form: shared replies and a cursor per queue.
    pub(crate) fn compile(&self) -> Plan {
        let mut end = 0usize;
        let queue = self
            .queue
            .iter()
            .map(|(n, reply)| {
                end = end.saturating_add(*n);
                (end, Arc::new(reply.clone()))
            })
            .collect();
        Plan {
            queue,
            queued: end,
            next: AtomicUsize::new(0),
            fallback: match &self.fallback {
                Fallback::Reply(reply) => Decision::Reply(Arc::new(reply.clone())),
                Fallback::Fn(f) => Decision::Fn(f.clone()),
            },
            routes: self
                .routes
                .iter()
                .map(|(path, script)| (path.clone(), script.compile()))
                .collect(),
        }
    }
}

/// What to do with one request, as decided by a [`Plan`].
#[derive(Clone)]
pub(crate) enum Decision {
    /// Act on this reply.
    Reply(Arc<Reply>),
    /// Ask this function.
    Fn(ReplyFn),
}

/// A compiled [`Script`] with its queue cursors.
pub(crate) struct Plan {
    /// `(cumulative end, reply)`: positions `prev_end..end` get `reply`.
    queue: Vec<(usize, Arc<Reply>)>,
    queued: usize,
    next: AtomicUsize,
    fallback: Decision,
    routes: Vec<(String, Plan)>,
}

impl fmt::Debug for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Plan")
            .field("queued", &self.queued)
            .field("next", &self.next)
            .field("routes", &self.routes.len())
            .finish_non_exhaustive()
    }
}

impl Plan {
    /// Picks the decision for a request to `path`, advancing the queue.
    ///
    /// Callers serialize calls (the server holds its record lock) so that queue
    /// order matches arrival order.
    pub(crate) fn decide(&self, path: &str) -> Decision {
        if let Some((_, plan)) = self.routes.iter().find(|(p, _)| p == path) {
            return plan.decide(path);
        }
        if self.queued > 0 {
            let position = self.next.load(Ordering::Relaxed);
            if position < self.queued {
                self.next.store(position + 1, Ordering::Relaxed);
                if let Some((_, reply)) = self.queue.iter().find(|(end, _)| position < *end) {
                    return Decision::Reply(reply.clone());
                }
            }
        }
        self.fallback.clone()
    }
}

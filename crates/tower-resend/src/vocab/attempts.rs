use std::fmt;
use std::time::Duration;

use std::sync::Arc;

use http::uri::Authority;
use http::StatusCode;

use super::{Class, GrpcCode};

/// One attempt of a call: what it got, how long the call waited before it,
/// how long it took, and (for an upstream that is a
/// [fleet](crate::fleet)) which instance answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attempt {
    class: Class,
    status: Option<StatusCode>,
    // In the padding after `status`.
    grpc: Option<GrpcCode>,
    replayed: bool,
    // The classification's "may the server have acted on it?".
    maybe_processed: bool,
    // Copies sent (more than 1: hedged), and the one whose answer came
    // back; saturating, and in the padding too.
    copies: u8,
    won: u8,
    waited: Duration,
    took: Duration,
    server_wait: Option<Duration>,
    server: Option<Arc<Authority>>,
}

impl Attempt {
    pub(crate) const fn new(
        class: Class,
        status: Option<StatusCode>,
        waited: Duration,
        took: Duration,
        server_wait: Option<Duration>,
    ) -> Self {
        Self {
            class,
            status,
            grpc: None,
            replayed: false,
            // The HTTP table's answer, until the classification says.
            maybe_processed: match class {
                Class::Unknown => true,
                Class::Overloaded => !matches!(status, Some(StatusCode::TOO_MANY_REQUESTS)),
                _ => false,
            },
            copies: 1,
            won: 1,
            waited,
            took,
            server_wait,
            server: None,
        }
    }

    /// The attempt, answered by the instance at `server` (of a fleet).
    pub(crate) fn with_server(mut self, server: Option<Arc<Authority>>) -> Self {
        self.server = server;
        self
    }

    /// The instance of a [fleet](crate::fleet) that answered this attempt
    /// (with a hedged attempt, the copy that answered); `None` when the
    /// upstream is the request's URI.
    pub fn server(&self) -> Option<&Authority> {
        self.server.as_deref()
    }

    /// The attempt, answered with the gRPC status `code` (from its
    /// classification, [`Classification::grpc_code`](crate::classify::Classification::grpc_code)).
    pub(crate) const fn with_grpc_code(mut self, code: Option<GrpcCode>) -> Self {
        self.grpc = code;
        self
    }

    /// The attempt, answered with a response the server replayed from its
    /// idempotency store.
    pub(crate) const fn with_replayed(mut self, replayed: bool) -> Self {
        self.replayed = replayed;
        self
    }

    /// The attempt, whose classification says whether the server may have
    /// acted on it ([`Classification::maybe_processed`](crate::classify::Classification::maybe_processed)).
    pub(crate) const fn with_maybe_processed(mut self, maybe: bool) -> Self {
        self.maybe_processed = maybe;
        self
    }

    /// The attempt, hedged: `sent` copies went, and copy `won` answered.
    pub(crate) fn with_copies(mut self, sent: u32, won: u32) -> Self {
        self.copies = u8::try_from(sent).unwrap_or(u8::MAX);
        self.won = u8::try_from(won).unwrap_or(u8::MAX);
        self
    }

    /// Copies of the attempt sent, the first included: more than one when
    /// it was [hedged](crate::stack::StackBuilder::hedge) and a backup went out.
    pub const fn copies(&self) -> u32 {
        self.copies as u32
    }

    /// The copy whose answer the attempt returned, counted from 1 (2 or
    /// more: a backup's). Known for answers; 1 for an error.
    pub const fn winning_copy(&self) -> u32 {
        self.won as u32
    }

    /// True when the server answered the attempt with a response replayed
    /// from its idempotency store (`Idempotent-Replayed: true`): the
    /// recorded answer of an earlier attempt under the same key.
    pub const fn replayed(&self) -> bool {
        self.replayed
    }

    /// False when the attempt's result promises that the server did not act
    /// on it: [not sent](Class::NotSent), answered
    /// [not processed](Class::NotProcessed) (408, 425, or a failure marked
    /// `idempotent-nothing-done`), or refused as overloaded in a way that
    /// says so (429, RESOURCE_EXHAUSTED, a shed 503); true otherwise (a
    /// plain 503 makes no such promise).
    pub(crate) fn may_have_run(&self) -> bool {
        match self.class {
            Class::NotSent | Class::NotProcessed => false,
            Class::Overloaded | Class::Unknown => self.maybe_processed,
            Class::Success | Class::Rejected | Class::InProgress => true,
        }
    }

    /// What the attempt's result says the server did.
    pub const fn class(&self) -> Class {
        self.class
    }

    /// The response status, when the attempt got a response. A gRPC answer
    /// is a 200 whatever its outcome: see [`grpc_code`](Self::grpc_code).
    pub const fn status(&self) -> Option<StatusCode> {
        self.status
    }

    /// The gRPC status the attempt was answered with, when its response
    /// carried `grpc-status` in its headers (a trailers-only answer: the
    /// shape of a call that failed before any message). `None` for HTTP
    /// answers, errors, and gRPC answers whose status comes in the trailers.
    ///
    /// ```
    /// use tower_resend::classify::GrpcCode;
    /// use tower_resend::retry::Attempts;
    ///
    /// fn unavailable_attempts(a: &Attempts) -> usize {
    ///     a.iter().filter(|a| a.grpc_code() == Some(GrpcCode::Unavailable)).count()
    /// }
    /// # let _ = unavailable_attempts;
    /// ```
    pub const fn grpc_code(&self) -> Option<GrpcCode> {
        self.grpc
    }

    /// How long the call waited before this attempt (zero for the first).
    pub const fn waited(&self) -> Duration {
        self.waited
    }

    /// How long the attempt took, from sending to its result.
    pub const fn took(&self) -> Duration {
        self.took
    }

    /// The wait the server asked for (`Retry-After`), if it asked.
    pub const fn server_wait(&self) -> Option<Duration> {
        self.server_wait
    }
}

/// Why a call stopped retrying.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Stop {
    /// The result was final: a success, or a rejection that will not change.
    Final,
    /// Retrying was not allowed for this call: switched off, or an outer
    /// retry layer is in charge.
    Disabled,
    /// The attempt cap was reached.
    MaxAttempts,
    /// The shared retry budget was empty.
    Budget,
    /// The wait and a useful attempt did not fit before the deadline, or the
    /// server asked for a wait beyond it.
    Deadline,
    /// The server asked for a longer wait than the configured maximum, or
    /// asked not to be retried.
    ServerSaidNo,
    /// The server may have acted on a request that is not safe to resend.
    OutcomeUnknown,
    /// The request body was too large to keep a copy of.
    NotReplayable,
    /// The server answered with a failure it replayed from its idempotency
    /// store: every attempt under the key gets the same answer, and the
    /// work it records may be half done. The call is outcome-unknown.
    Replayed,
    /// A circuit breaker refused the attempt: the upstream is unwell.
    CircuitOpen,
    /// The adaptive throttle turned the next attempt away: the upstream has
    /// been rejecting most calls.
    Throttled,
    /// Every instance of the fleet that the attempt could go to was at its
    /// limit on attempts in flight, or the fleet at its total limit: the
    /// fleet has more than it serves.
    AtCapacity,
    /// A pacing layer found the upstream's stated quota with no room for
    /// the attempt before the call's deadline.
    QuotaSpent,
}

impl fmt::Display for Stop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Final => "final answer",
            Self::Disabled => "retries disabled",
            Self::MaxAttempts => "attempt cap reached",
            Self::Budget => "retry budget exhausted",
            Self::Deadline => "no time left for another attempt",
            Self::ServerSaidNo => "server asked not to retry (soon)",
            Self::OutcomeUnknown => "outcome unknown, not safe to resend",
            Self::NotReplayable => "body too large to resend",
            Self::Replayed => "a failure replayed by the server, the same for every retry",
            Self::CircuitOpen => "circuit open",
            Self::Throttled => "throttled",
            Self::AtCapacity => "the fleet at its limits",
            Self::QuotaSpent => "the upstream's quota spent",
        })
    }
}

/// What happened during a call: every attempt, the waits between them, the
/// total time and why retrying stopped.
///
/// The retry layer puts it in the extensions of every final response, and on
/// every error ([`Error::history`](crate::Error::history)).
///
/// ```
/// use tower_resend::retry::Attempts;
///
/// fn describe(resp: &http::Response<()>) -> String {
///     match resp.extensions().get::<Attempts>() {
///         Some(a) => format!("{} attempt(s) in {:?}, stopped: {}", a.len(), a.elapsed(), a.stop()),
///         None => "not called through a retry layer".to_owned(),
///     }
/// }
/// # let _ = describe;
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attempts {
    // The first attempt inline: a call answered at once allocates nothing here.
    first: Option<Attempt>,
    // The others behind one pointer: every response carries this value in a
    // box of its own, and 88 bytes cost less there than 104 (glibc served
    // the larger one from its slow path on every loopback call: -269
    // instructions per call, callgrind).
    #[allow(clippy::box_collection)] // one pointer wide, not three: the point
    rest: Option<Box<Vec<Attempt>>>,
    elapsed: Duration,
    stop: Stop,
}

impl Attempts {
    pub(crate) const fn new() -> Self {
        Self {
            first: None,
            rest: None,
            elapsed: Duration::ZERO,
            stop: Stop::Final,
        }
    }

    pub(crate) fn push(&mut self, attempt: Attempt) {
        if self.first.is_none() {
            self.first = Some(attempt);
        } else {
            self.rest.get_or_insert_with(Box::default).push(attempt);
        }
    }

    pub(crate) fn finish(&mut self, elapsed: Duration, stop: Stop) {
        self.elapsed = elapsed;
        self.stop = stop;
    }

    /// The number of attempts made.
    pub fn len(&self) -> u32 {
        u32::from(self.first.is_some()).saturating_add(
            u32::try_from(self.rest.as_ref().map_or(0, |r| r.len())).unwrap_or(u32::MAX),
        )
    }

    /// The retries: the attempts after the first.
    pub fn retries(&self) -> u32 {
        self.len().saturating_sub(1)
    }

    /// The hedges, apart from the retries: the backup copies sent, over
    /// every attempt (each attempt's [`copies`](Attempt::copies) beyond
    /// its first).
    pub fn hedges(&self) -> u32 {
        self.iter().map(|a| a.copies().saturating_sub(1)).sum()
    }

    /// True when no attempt was made.
    pub fn is_empty(&self) -> bool {
        self.first.is_none()
    }

    /// The attempts, in order.
    pub fn iter(&self) -> impl Iterator<Item = &Attempt> + '_ {
        self.first
            .iter()
            .chain(self.rest.iter().flat_map(|r| r.iter()))
    }

    /// The last attempt.
    pub fn last(&self) -> Option<&Attempt> {
        self.rest
            .as_ref()
            .and_then(|r| r.last())
            .or(self.first.as_ref())
    }

    /// The total time of the call, waits included.
    pub fn elapsed(&self) -> Duration {
        self.elapsed
    }

    /// The total time spent waiting between attempts.
    pub fn waited(&self) -> Duration {
        self.iter().map(Attempt::waited).sum()
    }

    /// Why retrying stopped.
    pub fn stop(&self) -> Stop {
        self.stop
    }

    /// True when at least one attempt may have reached the server.
    pub fn any_sent(&self) -> bool {
        self.iter().any(|a| a.class != Class::NotSent)
    }

    /// True when attempts were made and the server can have acted on none of
    /// them: each was [not sent](Class::NotSent), answered
    /// [not processed](Class::NotProcessed) (408, 425, a failure marked
    /// `idempotent-nothing-done: true`), or refused as overloaded in a way
    /// that says so (429, RESOURCE_EXHAUSTED, a 503 or UNAVAILABLE marked
    /// `idempotent-nothing-done: true`, as tower-resend-server's shedding
    /// marks it). A plain 503 or UNAVAILABLE does not count: it makes no
    /// such promise.
    ///
    /// The whole call then did nothing upstream, and running the operation
    /// again is safe; when this is false, the outcome may be unknown.
    /// [`Error::nothing_processed`](crate::Error::nothing_processed) asks
    /// the same of a failed call.
    pub fn none_processed(&self) -> bool {
        !self.is_empty() && !self.iter().any(Attempt::may_have_run)
    }
}

impl fmt::Display for Attempts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, a) in self.iter().enumerate() {
            if i > 0 {
                write!(f, ", waited {}, ", Readable(a.waited))?;
            }
            match (a.grpc, a.status) {
                (Some(code), _) => write!(f, "#{} grpc {code} ({})", i + 1, a.class)?,
                (None, Some(s)) => write!(f, "#{} {} ({})", i + 1, s.as_u16(), a.class)?,
                (None, None) => write!(f, "#{} {}", i + 1, a.class)?,
            }
            if let Some(server) = &a.server {
                write!(f, " from {server}")?;
            }
        }
        write!(f, "; {} in all; {}", Readable(self.elapsed), self.stop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn history(attempts: &[(Class, Option<u16>)]) -> Attempts {
        let mut a = Attempts::new();
        for &(class, status) in attempts {
            let status = status.map(|s| StatusCode::from_u16(s).unwrap());
            a.push(Attempt::new(
                class,
                status,
                Duration::ZERO,
                Duration::ZERO,
                None,
            ));
        }
        a.finish(Duration::ZERO, Stop::MaxAttempts);
        a
    }

    #[test]
    fn none_processed_only_when_no_attempt_can_have_been_acted_on() {
        use Class::*;
        let none: &[&[(Class, Option<u16>)]] = &[
            &[(NotSent, None)],
            &[(NotProcessed, Some(408))],
            &[(Overloaded, Some(429))],
            &[
                (NotSent, None),
                (NotProcessed, Some(425)),
                (Overloaded, Some(429)),
            ],
        ];
        for h in none {
            assert!(history(h).none_processed(), "{h:?}");
        }
        let some: &[&[(Class, Option<u16>)]] = &[
            // No attempt at all says nothing.
            &[],
            &[(Overloaded, Some(503))],
            // gRPC's RESOURCE_EXHAUSTED and UNAVAILABLE come with a 200.
            &[(Overloaded, Some(200))],
            &[(Overloaded, None)],
            &[(Unknown, Some(500))],
            &[(Unknown, None)],
            &[(InProgress, Some(409))],
            &[(Rejected, Some(400))],
            &[(Success, Some(200))],
            &[
                (NotSent, None),
                (Overloaded, Some(429)),
                (Unknown, Some(502)),
            ],
            &[(Unknown, None), (NotSent, None)],
        ];
        for h in some {
            assert!(!history(h).none_processed(), "{h:?}");
        }
    }

    #[test]
    fn grpc_attempts_show_their_status_not_http_200() {
        let mut a = Attempts::new();
        a.push(
            Attempt::new(
                Class::Overloaded,
                Some(StatusCode::OK),
                Duration::ZERO,
                Duration::from_millis(3),
                None,
            )
            .with_grpc_code(Some(GrpcCode::Unavailable)),
        );
        a.push(
            Attempt::new(
                Class::Overloaded,
                Some(StatusCode::OK),
                Duration::from_millis(200),
                Duration::from_millis(3),
                Some(Duration::from_millis(150)),
            )
            .with_grpc_code(Some(GrpcCode::ResourceExhausted)),
        );
        // A gRPC call that got its answer: the status comes in the trailers.
        a.push(Attempt::new(
            Class::Success,
            Some(StatusCode::OK),
            Duration::from_millis(300),
            Duration::from_millis(3),
            None,
        ));
        a.finish(Duration::from_millis(509), Stop::Final);
        assert_eq!(
            a.iter().map(Attempt::grpc_code).collect::<Vec<_>>(),
            [
                Some(GrpcCode::Unavailable),
                Some(GrpcCode::ResourceExhausted),
                None
            ]
        );
        assert_eq!(
            a.to_string(),
            "#1 grpc UNAVAILABLE (overloaded), waited 200 ms, #2 grpc RESOURCE_EXHAUSTED (overloaded), \
             waited 300 ms, #3 200 (success); 509 ms in all; final answer"
        );
        // The code fits in the padding: the record does not grow.
        assert_eq!(std::mem::size_of::<Attempt>(), 64);
    }

    #[test]
    fn keeps_order_and_totals() {
        let mut a = Attempts::new();
        assert!(a.is_empty());
        a.push(Attempt::new(
            Class::NotSent,
            None,
            Duration::ZERO,
            Duration::from_millis(1),
            None,
        ));
        assert!(!a.any_sent());
        a.push(Attempt::new(
            Class::Overloaded,
            Some(StatusCode::SERVICE_UNAVAILABLE),
            Duration::from_millis(100),
            Duration::from_millis(5),
            Some(Duration::from_secs(1)),
        ));
        a.push(Attempt::new(
            Class::Success,
            Some(StatusCode::OK),
            Duration::from_secs(1),
            Duration::from_millis(5),
            None,
        ));
        a.finish(Duration::from_millis(1111), Stop::Final);
        assert_eq!((a.len(), a.retries(), a.hedges()), (3, 2, 0));
        assert!(a.any_sent());
        assert_eq!(a.waited(), Duration::from_millis(1100));
        assert_eq!(a.last().and_then(Attempt::status), Some(StatusCode::OK));
        assert_eq!(
            a.iter().map(Attempt::class).collect::<Vec<_>>(),
            [Class::NotSent, Class::Overloaded, Class::Success]
        );
        assert_eq!(
            a.to_string(),
            "#1 not_sent, waited 100 ms, #2 503 (overloaded), waited 1 s, #3 200 (success); 1.11 s in all; final answer"
        );
    }
}

/// A duration as a message says it: whole milliseconds under a second
/// ("502 ms", "<1 ms"), seconds to two decimals from there ("1.3 s",
/// "12 s").
#[derive(Clone, Copy, Debug)]
pub(crate) struct Readable(pub(crate) Duration);

impl fmt::Display for Readable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = self.0;
        if d.is_zero() {
            f.write_str("0 ms")
        } else if d < Duration::from_millis(1) {
            f.write_str("<1 ms")
        } else {
            write_ms(f, (d.as_micros() + 500) / 1000)
        }
    }
}

/// `ms` milliseconds: "502 ms" under a second, else "1.3 s", "12 s".
pub(crate) fn write_ms(f: &mut fmt::Formatter<'_>, ms: u128) -> fmt::Result {
    if ms < 1000 {
        return write!(f, "{ms} ms");
    }
    let centis = (ms + 5) / 10;
    let (secs, frac) = (centis / 100, centis % 100);
    match frac {
        0 => write!(f, "{secs} s"),
        _ if frac % 10 == 0 => write!(f, "{secs}.{} s", frac / 10),
        _ => write!(f, "{secs}.{frac:02} s"),
    }
}

//! How an [`Error`] says itself: its `Debug`, its sentence, its summary.

use std::fmt;
use std::time::Duration;

use super::{Error, ErrorKind, RetryAdvice};
use crate::vocab::{percent, write_ms, Readable, Refusal, Why};

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = &self.inner;
        let mut d = f.debug_struct("Error");
        d.field("kind", &i.kind);
        if i.not_sent {
            d.field("not_sent", &true);
        }
        if let Some(p) = i.phase {
            d.field("phase", &p);
        }
        if let Some(l) = i.limit {
            d.field("limit", &l);
        }
        if let Some(u) = &i.upstream {
            d.field("upstream", u);
        }
        if i.attempts > 0 {
            d.field("attempts", &i.attempts);
        }
        if let Some(e) = i.elapsed {
            d.field("elapsed", &e);
        }
        if let Some(k) = &i.key {
            d.field("key", k);
        }
        if let Some(h) = &i.history {
            d.field("history", h);
        }
        if let Some(c) = &i.circuit {
            d.field("circuit", c);
        }
        if let Some(s) = &i.source {
            d.field("source", s);
        }
        d.finish()
    }
}

impl fmt::Display for Error {
    /// One sentence: what fired, after how long, over how many attempts,
    /// the last cause, and for an unknown outcome what to do. Durations in
    /// milliseconds ("502 ms"), seconds past 10 s ("12.5 s").
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write_sentence(f, true)
    }
}

/// [`Error::summary`]: the sentence without any text of other errors.
#[derive(Clone, Copy, Debug)]
struct Summary<'a>(&'a Error);

impl fmt::Display for Summary<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.write_sentence(f, false)
    }
}

impl Error {
    /// The error's sentence in tower-resend's own words only: what
    /// [`Display`](fmt::Display) says, less the text of any other error
    /// down the chain (a peer's message, an address, a path). For answers
    /// that go back to callers: a `tonic::Status`, a problem document.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use std::time::Duration;
    /// use tower::ServiceExt;
    ///
    /// let shipping = tower_resend::stack().name("shipping").max_attempts(1)
    ///     .service(tower_resend::hyper_client(Duration::from_secs(2)));
    /// let req = http::Request::get("http://127.0.0.1:9/").body(String::new()).unwrap();
    /// let err = shipping.oneshot(req).await.unwrap_err();
    /// // "shipping: could not connect (nothing was sent)": no address, no OS text.
    /// assert_eq!(err.summary().to_string(), "shipping: could not connect (nothing was sent)");
    /// assert!(err.to_string().len() > err.summary().to_string().len());
    /// # }
    /// ```
    pub fn summary(&self) -> impl fmt::Display + '_ {
        Summary(self)
    }

    fn write_sentence(&self, f: &mut fmt::Formatter<'_>, foreign: bool) -> fmt::Result {
        let i = &self.inner;
        if let Some(u) = &i.upstream {
            write!(f, "{u}: ")?;
        }
        let out_of_time = i
            .history
            .as_ref()
            .is_some_and(|h| h.stop() == crate::vocab::Stop::Deadline);
        match i.kind {
            ErrorKind::DeadlineExceeded => {
                f.write_str("deadline exceeded")?;
                if let Some(p) = i.phase.filter(|_| !out_of_time) {
                    write!(f, " {p}")?;
                }
            }
            ErrorKind::AttemptTimeout => f.write_str("attempt timed out")?,
            ErrorKind::ConnectTimeout => f.write_str("connect timed out (nothing was sent)")?,
            ErrorKind::Transport if i.not_sent => {
                f.write_str("could not connect (nothing was sent)")?;
            }
            ErrorKind::Transport => f.write_str("transport error")?,
            ErrorKind::OutcomeUnknown => f.write_str("outcome unknown")?,
            ErrorKind::RetriesExhausted => f.write_str("retries exhausted")?,
            ErrorKind::BudgetExhausted => f.write_str("retry budget exhausted")?,
            ErrorKind::BodyNotReplayable => f.write_str("body not replayable")?,
            ErrorKind::Throttled => f.write_str(
                "throttled: the upstream has been rejecting most calls, this one was not sent",
            )?,
            ErrorKind::AtCapacity => f.write_str(
                "at capacity: the fleet has as many attempts in flight as its limits \
                 allow (at every instance the call could use, or in all), this one was \
                 not sent",
            )?,
            ErrorKind::QuotaSpent => {
                // (The limit is a wait to come, not a time spent.)
                f.write_str("quota spent: the upstream's stated quota has no room for this call")?;
                if let Some(wait) = i.limit {
                    write!(f, " for another {}", Readable(wait))?;
                }
                f.write_str(", past its deadline; it was not sent")?;
                if i.attempts > 1 {
                    write!(f, " ({} attempts)", i.attempts)?;
                }
                return self.write_advice(f);
            }
            ErrorKind::CircuitOpen => {
                write_circuit(f, i.circuit)?;
                if i.attempts > 1 {
                    write!(f, " ({} attempts)", i.attempts)?;
                }
                return Ok(());
            }
        }
        if let Some(l) = i.limit {
            write!(f, " after {}", Readable(l))?;
        } else if let Some(e) = i.elapsed {
            write!(f, " after {}", Readable(e))?;
        }
        if i.attempts > 1 {
            write!(f, " ({} attempts)", i.attempts)?;
        }
        match i.kind {
            // The last attempt's own failure adds nothing to this.
            ErrorKind::DeadlineExceeded if out_of_time => {
                return f.write_str(": no time left for another attempt");
            }
            ErrorKind::BudgetExhausted => f.write_str(
                ": the upstream is failing for many calls, so this one was not retried",
            )?,
            ErrorKind::BodyNotReplayable => {
                f.write_str(
                    ": a retry was needed but the request body was too large to keep, \
                     so it was not resent",
                )?;
            }
            _ => {}
        }
        if let Some(s) = &i.source {
            if i.kind != ErrorKind::AttemptTimeout && i.kind != ErrorKind::ConnectTimeout {
                write_cause(f, self, &**s, foreign)?;
            }
        }
        self.write_advice(f)
    }

    /// What to do next, in words rendered from [`Error::retry_advice`]
    /// alone, so that the sentence never advises what the advice does not.
    /// `After` adds nothing: the words of the kind already say why to wait
    /// (nothing was sent, the circuit is open for so long).
    fn write_advice(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.retry_advice() {
            RetryAdvice::SameKey(wait) => {
                // (SameKey is advised only with a key to send again.)
                let key = self.idempotency_key().unwrap_or("?");
                write!(
                    f,
                    "; the server may have processed the request: send it again only with \
                     the same Idempotency-Key, {key}"
                )?;
                if !wait.is_zero() {
                    write!(f, ", after {}", Readable(wait))?;
                }
                Ok(())
            }
            RetryAdvice::VerifyFirst if self.replayed() => f.write_str(
                "; the server answers every attempt under this Idempotency-Key with its record \
                 of this failure, and the work may be half done: verify (look the resource up) \
                 before sending it again",
            ),
            RetryAdvice::VerifyFirst => f.write_str(
                "; the server may have processed the request, which is not safe to send again: \
                 verify (look the resource up) before resending",
            ),
            RetryAdvice::Never => f.write_str("; sending it again will not help"),
            RetryAdvice::After(_) => Ok(()),
        }
    }
}

/// ": " and the cause of `outer`, once: a tower-resend error as it says itself
/// (or only its own cause, when it says what `outer` already said); any
/// other error's text (when `foreign`), then its own cause when that text
/// does not already say it (hyper-util's "client error (Connect)" is
/// skipped for what is under it). Without `foreign`, only a tower-resend error
/// down the chain is said.
fn write_cause(
    f: &mut fmt::Formatter<'_>,
    outer: &Error,
    cause: &(dyn std::error::Error + 'static),
    foreign: bool,
) -> fmt::Result {
    let mut next = Some(cause);
    while let Some(e) = next {
        if let Some(ours) = e.downcast_ref::<Error>() {
            if ours.kind() == outer.kind() && ours.inner.not_sent == outer.inner.not_sent {
                next = ours.inner.source.as_deref().map(|s| s as _);
                continue;
            }
            f.write_str(": ")?;
            return ours.write_sentence(f, foreign);
        }
        if !foreign || is_terse_wrapper(e) {
            next = e.source();
            continue;
        }
        let text = e.to_string();
        write!(f, ": {text}")?;
        next = e.source().filter(|c| !text.contains(&c.to_string()));
    }
    Ok(())
}

#[cfg(feature = "hyper-client")]
fn is_terse_wrapper(e: &(dyn std::error::Error + 'static)) -> bool {
    e.is::<hyper_util::client::legacy::Error>()
}

#[cfg(not(feature = "hyper-client"))]
fn is_terse_wrapper(_: &(dyn std::error::Error + 'static)) -> bool {
    false
}

/// "circuit open for another 3.2 s after 57% of 140 calls failed".
fn write_circuit(f: &mut fmt::Formatter<'_>, circuit: Option<Refusal>) -> fmt::Result {
    struct Wait(Duration);
    impl fmt::Display for Wait {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            // Rounded up: never less than is left.
            write_ms(f, self.0.as_micros().div_ceil(1000))
        }
    }
    match circuit {
        Some(Refusal::Open {
            left,
            why: Why::Ratio { failures, calls },
        }) => write!(
            f,
            "circuit open for another {} after {}% of {calls} calls failed",
            Wait(left),
            percent(failures, calls),
        ),
        Some(Refusal::Open {
            left,
            why: Why::Probe,
        }) => write!(
            f,
            "circuit open for another {} after a probe failed",
            Wait(left)
        ),
        Some(Refusal::Probing { probes, .. }) => write!(
            f,
            "circuit half-open and its {probes} probe(s) still out: not sent"
        ),
        None => f.write_str("circuit open: not sent"),
    }
}

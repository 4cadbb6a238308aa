//! The rules of the idempotency layer (DESIGN section 7) as pure
//! functions, one per step of a keyed request: what the layer knows at that
//! step in, what to do out. Each step's outcome admits only what that step
//! can do, so that no caller has an arm for what cannot happen. They do no
//! I/O. The I/O around them (the body read, the store calls and their
//! timeouts, the supervised handler, the commit) lives in the neighbouring
//! files, and no rule lives there.
//!
//! A keyed request meets the steps in order:
//!
//! 1. [`arrived`] ([`Arrival`] → [`OnArrival`]): is it the layer's at all
//!    (an unsafe method with a key), is it refused (400), or does it pass
//!    (in the transactional mode, an unsafe request without a key runs in a
//!    transaction: [`OnArrival::Transact`])?
//! 2. [`body_read`] ([`BodyRead`] → [`OnBody`]): its body read, or too
//!    large (413), or failed (400).
//! 3. [`found`] ([`Found`] → [`OnFound`]): what holds its key: run the
//!    handler, replay, 409, 422, or fail closed (503, [`unavailable`], which
//!    also answers a transaction that could not begin for an unkeyed
//!    request).
//! 4. [`renewed`] (the store's answer → [`OnRenewal`]): a renewal of its
//!    lease, while the handler runs.
//! 5. [`ended`] ([`Ended`] → [`OnEnd`]): how the handler ended, and so what
//!    is kept ([`Keep`]: its response, 5xx included on a lease, or a
//!    response of the layer's own), or what is answered unkept ([`Unkept`]:
//!    the lease released, the transaction rolled back). The handler's
//!    response, error and deadline cut pass through as they are (type
//!    parameters), so what is kept is what the handler gave.
//! 6. What keeping it found: on a lease, [`completed`] (→ [`OnCompletion`]:
//!    stored, a lease lost, or held for a store that did not answer); in a
//!    transaction, [`committed`] ([`Commit`] → [`OnCommit`]: committed, or
//!    rolled back and why, or a commit whose outcome is unknown).
//!
//! Two modes: a lease in a [`Store`](crate::Store), or the handler's own
//! transaction ([`PostgresTransactional`](crate::PostgresTransactional)),
//! where the database undoes what is not kept. Two protocols: the same rules,
//! with gRPC's statuses read where HTTP's are.

use std::time::Duration;

use http::{Method, StatusCode};
use tower_resend::classify::GrpcCode;

use crate::problems::{Answer, Failure};
use crate::store::{Begin, Fingerprint, LeaseState, StoreError, StoredResponse};

/// What holds a key while its handler runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// A lease in a store: what the handler did stays done.
    Lease,
    /// The handler's own transaction: what is not committed is undone.
    Transaction,
}

/// The key a request carries: `K` is what the caller knows of a
/// well-formed one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KeyHeader<K> {
    Absent,
    Malformed(&'static str),
    Present(K),
}

/// What became of reading a keyed request's body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BodyRead {
    Read,
    TooLarge { cap: usize },
    Failed,
}

/// What a handler answered, as far as the rules care.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Answered {
    pub(crate) status: StatusCode,
    /// The gRPC status, from the headers of a trailers-only response or the
    /// trailers.
    pub(crate) grpc: Option<GrpcCode>,
    /// It carries `grpc-retry-pushback-ms` (the server asks for a wait).
    pub(crate) pushback: bool,
    /// The handler marked it: nothing was done.
    pub(crate) nothing_done: bool,
    /// The handler marked it: keep it, even a 5xx.
    pub(crate) keep: bool,
}

/// What keeping an end found.
#[derive(Debug)]
pub(crate) enum Kept {
    /// A lease store's `complete` ([`completed`]).
    Stored(Result<LeaseState, StoreError>),
    /// The record and the commit of a transaction, and the status the
    /// handler answered ([`committed`]).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    Committed(Commit, StatusCode),
}

/// How a transaction's end went.
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Commit {
    /// Committed, with the key's record.
    Done,
    /// Not committed: a statement of the handler's had failed, so the
    /// transaction could only roll back (or the database refused the
    /// COMMIT); what its SQLSTATE says of another try.
    Aborted(Sqlstate),
    /// Not committed: the claimed row was gone (changed or deleted through
    /// the handler's own transaction), or the database refused the record.
    Refused,
    /// The commit may or may not have happened (the connection was lost
    /// during it).
    Unknown,
}

/// What the SQLSTATE of the statement that aborted a transaction says of
/// another try with the same request.
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Sqlstate {
    /// Class 23, integrity constraint violation (23505 unique, 23503
    /// foreign key, 23514 check, …): the same on every try.
    Integrity,
    /// 40001 serialization failure, 40P01 deadlock detected: the next try
    /// may pass.
    Transient,
    /// Any other, or none seen (the statement went around the layer's
    /// executor).
    Other,
}

#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
impl Sqlstate {
    /// What `code` (a five-character SQLSTATE) says.
    pub(crate) fn of(code: &str) -> Self {
        match code {
            "40001" | "40P01" => Self::Transient,
            _ if code.starts_with("23") => Self::Integrity,
            _ => Self::Other,
        }
    }
}

/// Step 1: a request arrived, its body not read yet. `K` is what the
/// caller knows of a well-formed key (handed back to read the body).
#[derive(Debug)]
pub(crate) struct Arrival<K> {
    pub(crate) mode: Mode,
    pub(crate) method: Method,
    pub(crate) key: KeyHeader<K>,
    /// The route requires a key.
    pub(crate) required: bool,
    /// The caller presented no credential (under the default scope).
    pub(crate) anonymous: bool,
    /// Keyed requests without credentials are refused.
    pub(crate) refuse_anonymous: bool,
}

/// What to do with a request that arrived.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum OnArrival<K> {
    /// Not the layer's business: the handler runs as if the layer were not
    /// there.
    Pass,
    /// An unsafe request without a key, in the transactional mode: the
    /// handler runs in a transaction, with no record.
    Transact,
    /// A keyed request: read its body.
    ReadBody(K),
    /// Answer on the layer's own account; nothing runs.
    Refuse(Answer),
}

/// What to do once a keyed request's body is read (or not).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum OnBody {
    /// Its body is read: claim its key.
    Claim,
    /// Answer on the layer's own account; nothing runs.
    Refuse(Answer),
}

/// Step 3: the store (or this process's held responses) said what holds
/// the key.
#[derive(Debug)]
pub(crate) struct Found {
    pub(crate) found: Result<Begin, StoreError>,
    /// This request's fingerprint.
    pub(crate) fingerprint: Fingerprint,
    /// The `Retry-After` of a 409.
    pub(crate) retry_after: Duration,
}

/// What to do once the store said what holds the key.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum OnFound {
    /// The key is this request's: run the handler.
    Run,
    /// The operation finished: replay its response; the handler does not
    /// run.
    Replay(Box<StoredResponse>),
    /// Answer on the layer's own account; nothing runs, nothing is kept.
    Refuse(Answer),
}

/// What to do once a renewal of the lease answered.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum OnRenewal {
    /// The lease is renewed (or needs no renewal): renew again in a third
    /// of a lease.
    Renewed,
    /// The key's finished record is this request's own: its response is
    /// stored already.
    AlreadyStored,
    /// Another request took the key over: another run may have happened.
    /// Reported; the work cannot be taken back.
    LeaseLost,
    /// The store did not answer the renewal: try at the next one (the lease
    /// still has two thirds of its life).
    RenewLater,
}

/// Step 5: how a handler ended. `R` is its response, `E` its error, `C`
/// where the time went when the deadline cut it: the rules hand each on to
/// what is kept or answered, so that no caller pairs them up again.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Ended<R, E, C> {
    /// It answered, and the response's body was read (up to the cap).
    Answered(Answered, R),
    /// It answered, and the response's body failed after the head.
    BodyFailed,
    /// It returned an error instead of a response.
    Failed(E),
    /// It panicked.
    Panicked,
    /// The inbound deadline ran out while it worked, and cut it.
    DeadlineCut(C),
}

/// What to do once the handler ended.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum OnEnd<R, E, C> {
    /// Keep this as the key's end (lease: store it; transaction: record it
    /// and commit), and answer with it.
    Keep(Keep<R, E, C>),
    /// Nothing was done: release the lease, and answer with the handler's
    /// response, unkept, so that a retry runs.
    Release(R),
    /// Roll the transaction back (the claim with it, so that a retry runs),
    /// and answer so.
    RollBack(Unkept<R, E, C>),
}

/// What a handler's end is kept as.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Keep<R, E, C> {
    /// Its own response.
    Response(R),
    /// A response of the layer's own: the work may have been done.
    Answer(Answer),
    /// Its error: kept as the layer's `Answer` (the work may have been
    /// done); the error itself still reaches its first caller as it is.
    Failed(Answer, E),
    /// The deadline's 504 (DEADLINE_EXCEEDED), saying where the time went.
    Deadline(C),
}

/// What the caller is answered with once a transaction is rolled back.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Unkept<R, E, C> {
    /// The handler's response.
    Response(R),
    /// The handler's error.
    Error(E),
    /// A response of the layer's own.
    Answer(Answer),
    /// The deadline's 504 (DEADLINE_EXCEEDED).
    Deadline(C),
}

/// What to do once a lease store's `complete` answered.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum OnCompletion {
    /// Stored: answer with what was kept.
    Stored,
    /// Another request took the key over before the response could be
    /// stored: another run may have happened. Reported.
    LeaseLost,
    /// The store did not take it: hold it in this process (which answers
    /// the key from it) and store it in the background; answer with it.
    Hold,
}

/// What the caller is answered with once a commit did not happen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Reply {
    /// What the handler gave: its response, or its error.
    Handler,
    /// A response of the layer's own.
    Answer(Answer),
}

/// What to do once a transaction's end was committed (or not).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum OnCommit {
    /// Kept: answer with what was kept.
    Answered,
    /// Roll the transaction back (the claim with it, so that a retry runs),
    /// and answer so.
    RollBack(Reply),
    /// Answer on the layer's own account; nothing is left to roll back.
    Answer(Answer),
}

/// True for GET, HEAD, OPTIONS, TRACE, PUT and DELETE: methods a client may
/// resend without a key, which the layer leaves alone.
pub(crate) fn is_idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

/// Step 1: is the request the layer's at all (an unsafe method with a
/// key), is it refused (400), or does it pass?
pub(crate) fn arrived<K>(arrival: Arrival<K>) -> OnArrival<K> {
    let Arrival {
        mode,
        method,
        key,
        required,
        anonymous,
        refuse_anonymous,
    } = arrival;
    match key {
        _ if is_idempotent(&method) => OnArrival::Pass,
        KeyHeader::Malformed(reason) => OnArrival::Refuse(Answer::KeyInvalid(reason)),
        KeyHeader::Absent if required => OnArrival::Refuse(Answer::KeyRequired),
        KeyHeader::Absent if mode == Mode::Transaction => OnArrival::Transact,
        KeyHeader::Absent => OnArrival::Pass,
        KeyHeader::Present(_) if anonymous && refuse_anonymous => {
            OnArrival::Refuse(Answer::KeyNeedsCredentials)
        }
        KeyHeader::Present(key) => OnArrival::ReadBody(key),
    }
}

/// Step 2: a keyed request's body read, or too large (413), or failed
/// (400).
pub(crate) fn body_read(read: BodyRead) -> OnBody {
    match read {
        BodyRead::Read => OnBody::Claim,
        BodyRead::TooLarge { cap } => OnBody::Refuse(Answer::RequestTooLarge { cap }),
        BodyRead::Failed => OnBody::Refuse(Answer::RequestBodyFailed),
    }
}

/// Step 3: what holds the key: run the handler, replay, 409, 422, or fail
/// closed (503).
pub(crate) fn found(found: Found) -> OnFound {
    let Found {
        found,
        fingerprint,
        retry_after,
    } = found;
    match found {
        Err(e) => OnFound::Refuse(unavailable(&e)),
        Ok(Begin::Acquired) => OnFound::Run,
        Ok(
            Begin::InProgress { fingerprint: fp }
            | Begin::Completed {
                fingerprint: fp, ..
            },
        ) if fp != fingerprint => OnFound::Refuse(Answer::KeyReused),
        Ok(Begin::InProgress { .. }) => OnFound::Refuse(Answer::InProgress { retry_after }),
        Ok(Begin::Completed { response, .. }) => OnFound::Replay(response),
    }
}

/// A store that cannot answer (a claim, or the transaction of an unkeyed
/// request): fail closed, nothing run; one that is not set up says so.
pub(crate) fn unavailable(e: &StoreError) -> Answer {
    if e.is_not_set_up() {
        Answer::StoreNotSetUp
    } else {
        Answer::StoreUnavailable
    }
}

/// Step 4: a renewal of the lease answered, while the handler runs.
pub(crate) fn renewed(renewed: Result<LeaseState, StoreError>) -> OnRenewal {
    match renewed {
        Ok(LeaseState::Held) => OnRenewal::Renewed,
        Ok(LeaseState::Completed) => OnRenewal::AlreadyStored,
        Ok(LeaseState::Lost) => OnRenewal::LeaseLost,
        Err(_) => OnRenewal::RenewLater,
    }
}

/// Step 6, on a lease: what the store's `complete` found: done, a lease
/// lost, or held for a store that did not answer.
pub(crate) fn completed(completed: Result<LeaseState, StoreError>) -> OnCompletion {
    match completed {
        Ok(LeaseState::Held | LeaseState::Completed) => OnCompletion::Stored,
        Ok(LeaseState::Lost) => OnCompletion::LeaseLost,
        Err(_) => OnCompletion::Hold,
    }
}

/// Step 6, in a transaction: what the commit of the record found, the
/// handler having answered `status`.
pub(crate) fn committed(commit: Commit, status: StatusCode) -> OnCommit {
    match commit {
        Commit::Done => OnCommit::Answered,
        // The handler's statement failed, and it said so: its answer
        // is the answer (and the key is free, as nothing committed).
        Commit::Aborted(_) if status.is_client_error() || status.is_server_error() => {
            OnCommit::RollBack(Reply::Handler)
        }
        // It answered as if it had succeeded: nothing of it committed, and
        // the SQLSTATE says whether another try can pass. (Rolled back, the
        // key is free either way.) A constraint fails the same on every
        // try: final, not resent.
        Commit::Aborted(Sqlstate::Integrity) => {
            OnCommit::RollBack(Reply::Answer(Answer::ConstraintViolation))
        }
        // A serialization failure or a deadlock passes on another try.
        Commit::Aborted(Sqlstate::Transient) => {
            OnCommit::RollBack(Reply::Answer(Answer::TransactionConflict))
        }
        Commit::Aborted(Sqlstate::Other) => {
            OnCommit::RollBack(Reply::Answer(Answer::TransactionAborted))
        }
        Commit::Refused => OnCommit::RollBack(Reply::Answer(undone(Failure::Handler))),
        Commit::Unknown => OnCommit::Answer(Answer::CommitOutcomeUnknown),
    }
}

/// A failure rolled back: it may be sent again.
const fn undone(failure: Failure) -> Answer {
    Answer::Failed {
        failure,
        undone: true,
    }
}

/// A failure kept: the work may have been done, and never runs again.
const fn kept(failure: Failure) -> Answer {
    Answer::Failed {
        failure,
        undone: false,
    }
}

/// Step 5. Once a handler has started, on a lease its end is final: its
/// response is kept, 5xx included, unless it says nothing was done (it is
/// marked so, it is a 429, or its gRPC status says it was not processed:
/// UNAVAILABLE, or RESOURCE_EXHAUSTED with a pushback). In a transaction,
/// what is not kept is undone: a 5xx (or a gRPC server error) is rolled
/// back too, unless the handler marks it to be kept.
pub(crate) fn ended<R, E, C>(mode: Mode, ended: Ended<R, E, C>) -> OnEnd<R, E, C> {
    match (mode, ended) {
        (Mode::Lease, Ended::Answered(a, r)) if nothing_done(&a) => OnEnd::Release(r),
        (Mode::Transaction, Ended::Answered(a, r)) if nothing_done(&a) => {
            OnEnd::RollBack(Unkept::Response(r))
        }
        (Mode::Transaction, Ended::Answered(a, r)) if server_error(&a) && !a.keep => {
            OnEnd::RollBack(Unkept::Response(r))
        }
        (_, Ended::Answered(_, r)) => OnEnd::Keep(Keep::Response(r)),
        (Mode::Lease, Ended::BodyFailed) => OnEnd::Keep(Keep::Answer(kept(Failure::ResponseLost))),
        (Mode::Lease, Ended::Failed(e)) => OnEnd::Keep(Keep::Failed(kept(Failure::Handler), e)),
        (Mode::Lease, Ended::Panicked) => OnEnd::Keep(Keep::Answer(kept(Failure::Panic))),
        (Mode::Lease, Ended::DeadlineCut(c)) => OnEnd::Keep(Keep::Deadline(c)),
        (Mode::Transaction, Ended::BodyFailed) => {
            OnEnd::RollBack(Unkept::Answer(undone(Failure::ResponseLost)))
        }
        (Mode::Transaction, Ended::Failed(e)) => OnEnd::RollBack(Unkept::Error(e)),
        (Mode::Transaction, Ended::Panicked) => {
            OnEnd::RollBack(Unkept::Answer(undone(Failure::Panic)))
        }
        (Mode::Transaction, Ended::DeadlineCut(c)) => OnEnd::RollBack(Unkept::Deadline(c)),
    }
}

/// The answer says the request was not processed.
fn nothing_done(a: &Answered) -> bool {
    a.nothing_done
        || a.status == StatusCode::TOO_MANY_REQUESTS
        || a.grpc == Some(GrpcCode::Unavailable)
        || (a.grpc == Some(GrpcCode::ResourceExhausted) && a.pushback)
}

/// The answer is a server's failure: a 5xx, or a gRPC status of the 5xx
/// kind (as gRPC maps them to HTTP: UNKNOWN, INTERNAL, DATA_LOSS,
/// UNIMPLEMENTED, DEADLINE_EXCEEDED).
fn server_error(a: &Answered) -> bool {
    a.status.is_server_error()
        || matches!(
            a.grpc,
            Some(
                GrpcCode::Unknown
                    | GrpcCode::Internal
                    | GrpcCode::DataLoss
                    | GrpcCode::Unimplemented
                    | GrpcCode::DeadlineExceeded
            )
        )
}

#[cfg(test)]
#[path = "rules_tests.rs"]
mod tests;

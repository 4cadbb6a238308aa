//! The rules of the idempotency layer (DESIGN section 7) as one pure
//! function, [`decide`]: what the layer knows at a step in, what to do out.
//! It does no I/O. The I/O around it (the body read, the store calls and
//! their timeouts, the supervised handler, the commit) lives in the
//! neighbouring files, and no rule lives there.
//!
//! A keyed request meets the steps in order:
//!
//! 1. [`Step::Arrived`]: is it the layer's at all (an unsafe method with a
//!    key), is it refused (400), or does it pass?
//! 2. [`Step::BodyRead`]: its body read, or too large (413), or failed (400).
//! 3. [`Step::Found`]: what holds its key: run the handler, replay, 409,
//!    422, or fail closed (503).
//! 4. [`Step::Renewed`]: a renewal of its lease, while the handler runs.
//! 5. [`Step::Ended`]: how the handler ended, and so what is kept: its
//!    response (5xx included on a lease), a response of the layer's own,
//!    or nothing (the lease released, the transaction rolled back).
//! 6. [`Step::Kept`]: what keeping it found: done, held for a store that
//!    did not answer, a lease lost, or a transaction that did not commit.
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

/// The key a request carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KeyHeader {
    Absent,
    Malformed(&'static str),
    Present,
}

/// What became of reading a keyed request's body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BodyRead {
    Read,
    TooLarge { cap: usize },
    Failed,
}

/// How a handler ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ended {
    /// It answered, and the response's body was read (up to the cap).
    Answered(Answered),
    /// It answered, and the response's body failed after the head.
    BodyFailed,
    /// It returned an error instead of a response.
    Failed,
    /// It panicked.
    Panicked,
    /// The inbound deadline ran out while it worked, and cut it.
    DeadlineCut,
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
    /// A lease store's `complete`.
    Stored(Result<LeaseState, StoreError>),
    /// The record and the commit of a transaction, and the status the
    /// handler answered.
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

/// What the layer knows at one step of a request.
#[derive(Debug)]
pub(crate) enum Step {
    /// A request arrived, its body not read yet.
    Arrived {
        mode: Mode,
        method: Method,
        key: KeyHeader,
        /// The route requires a key.
        required: bool,
        /// The caller presented no credential (under the default scope).
        anonymous: bool,
        /// Keyed requests without credentials are refused.
        refuse_anonymous: bool,
    },
    /// A keyed request's body was read.
    BodyRead(BodyRead),
    /// The store (or this process's held responses) said what holds the key.
    Found {
        found: Result<Begin, StoreError>,
        fingerprint: Fingerprint,
        /// The `Retry-After` of a 409.
        retry_after: Duration,
    },
    /// A renewal of the lease answered.
    Renewed(Result<LeaseState, StoreError>),
    /// The handler ended.
    Ended { mode: Mode, ended: Ended },
    /// Keeping the end answered.
    Kept(Kept),
}

/// What a handler's end is kept as.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Keep {
    /// Its own response.
    Response,
    /// A response of the layer's own: the work may have been done.
    Answer(Answer),
    /// The deadline's 504 (DEADLINE_EXCEEDED), saying where the time went.
    Deadline,
}

/// What the caller is answered with once a transaction is rolled back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Reply {
    /// What the handler gave: its response, or its error.
    Handler,
    /// A response of the layer's own.
    Answer(Answer),
    /// The deadline's 504 (DEADLINE_EXCEEDED).
    Deadline,
}

/// What to do.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// Not the layer's business: the handler runs as if the layer were not
    /// there.
    Pass,
    /// An unsafe request without a key, in the transactional mode: the
    /// handler runs in a transaction, with no record.
    Transact,
    /// A keyed request: read its body.
    ReadBody,
    /// Its body is read: claim its key.
    Claim,
    /// Answer on the layer's own account; nothing ran, nothing is kept.
    Answer(Answer),
    /// The key is this request's: run the handler.
    Run,
    /// The operation finished: replay its response; the handler does not
    /// run.
    Replay(Box<StoredResponse>),
    /// The lease is renewed (or needs no renewal): renew again in a third
    /// of a lease.
    Renewed,
    /// The store did not answer the renewal: try at the next one (the lease
    /// still has two thirds of its life).
    RenewLater,
    /// The key's finished record is this request's own: its response is
    /// stored already.
    AlreadyStored,
    /// Another request took the key over: another run may have happened.
    /// Reported; the work cannot be taken back.
    LeaseLost,
    /// Keep this as the key's end (lease: store it; transaction: record it
    /// and commit), and answer with it.
    Keep(Keep),
    /// Nothing was done: release the lease, and answer with the handler's
    /// response, unkept, so that a retry runs.
    Release,
    /// Roll the transaction back (the claim with it, so that a retry runs),
    /// and answer so.
    RollBack(Reply),
    /// Kept: answer with what was kept.
    Answered,
    /// The store did not take it: hold it in this process (which answers
    /// the key from it) and store it in the background; answer with it.
    Hold,
}

/// True for GET, HEAD, OPTIONS, TRACE, PUT and DELETE: methods a client may
/// resend without a key, which the layer leaves alone.
pub(crate) fn is_idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

/// The rules: what to do at `step`.
pub(crate) fn decide(step: Step) -> Action {
    match step {
        Step::Arrived {
            mode,
            method,
            key,
            required,
            anonymous,
            refuse_anonymous,
        } => match key {
            _ if is_idempotent(&method) => Action::Pass,
            KeyHeader::Malformed(reason) => Action::Answer(Answer::KeyInvalid(reason)),
            KeyHeader::Absent if required => Action::Answer(Answer::KeyRequired),
            KeyHeader::Absent if mode == Mode::Transaction => Action::Transact,
            KeyHeader::Absent => Action::Pass,
            KeyHeader::Present if anonymous && refuse_anonymous => {
                Action::Answer(Answer::KeyNeedsCredentials)
            }
            KeyHeader::Present => Action::ReadBody,
        },
        Step::BodyRead(read) => match read {
            BodyRead::Read => Action::Claim,
            BodyRead::TooLarge { cap } => Action::Answer(Answer::RequestTooLarge { cap }),
            BodyRead::Failed => Action::Answer(Answer::RequestBodyFailed),
        },
        Step::Found {
            found,
            fingerprint,
            retry_after,
        } => match found {
            Err(e) if e.is_not_set_up() => Action::Answer(Answer::StoreNotSetUp),
            // The store cannot answer: fail closed.
            Err(_) => Action::Answer(Answer::StoreUnavailable),
            Ok(Begin::Acquired) => Action::Run,
            Ok(
                Begin::InProgress { fingerprint: fp }
                | Begin::Completed {
                    fingerprint: fp, ..
                },
            ) if fp != fingerprint => Action::Answer(Answer::KeyReused),
            Ok(Begin::InProgress { .. }) => Action::Answer(Answer::InProgress { retry_after }),
            Ok(Begin::Completed { response, .. }) => Action::Replay(response),
        },
        Step::Renewed(found) => match found {
            Ok(LeaseState::Held) => Action::Renewed,
            Ok(LeaseState::Completed) => Action::AlreadyStored,
            Ok(LeaseState::Lost) => Action::LeaseLost,
            Err(_) => Action::RenewLater,
        },
        Step::Ended { mode, ended } => on_end(mode, ended),
        Step::Kept(kept) => match kept {
            Kept::Stored(Ok(LeaseState::Held | LeaseState::Completed)) => Action::Answered,
            Kept::Stored(Ok(LeaseState::Lost)) => Action::LeaseLost,
            Kept::Stored(Err(_)) => Action::Hold,
            Kept::Committed(Commit::Done, _) => Action::Answered,
            // The handler's statement failed, and it said so: its answer
            // is the answer (and the key is free, as nothing committed).
            Kept::Committed(Commit::Aborted(_), status)
                if status.is_client_error() || status.is_server_error() =>
            {
                Action::RollBack(Reply::Handler)
            }
            // It answered as if it had succeeded: nothing of it committed,
            // and the SQLSTATE says whether another try can pass. (Rolled
            // back, the key is free either way.) A constraint fails the same
            // on every try: final, not resent.
            Kept::Committed(Commit::Aborted(Sqlstate::Integrity), _) => {
                Action::RollBack(Reply::Answer(Answer::ConstraintViolation))
            }
            // A serialization failure or a deadlock passes on another try.
            Kept::Committed(Commit::Aborted(Sqlstate::Transient), _) => {
                Action::RollBack(Reply::Answer(Answer::TransactionConflict))
            }
            Kept::Committed(Commit::Aborted(Sqlstate::Other), _) => {
                Action::RollBack(Reply::Answer(Answer::TransactionAborted))
            }
            Kept::Committed(Commit::Refused, _) => {
                Action::RollBack(Reply::Answer(undone(Failure::Handler)))
            }
            Kept::Committed(Commit::Unknown, _) => Action::Answer(Answer::CommitOutcomeUnknown),
        },
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
const fn kept(failure: Failure) -> Keep {
    Keep::Answer(Answer::Failed {
        failure,
        undone: false,
    })
}

/// Step 5. Once a handler has started, on a lease its end is final: its
/// response is kept, 5xx included, unless it says nothing was done (it is
/// marked so, it is a 429, or its gRPC status says it was not processed:
/// UNAVAILABLE, or RESOURCE_EXHAUSTED with a pushback). In a transaction,
/// what is not kept is undone: a 5xx (or a gRPC server error) is rolled
/// back too, unless the handler marks it to be kept.
fn on_end(mode: Mode, ended: Ended) -> Action {
    match (mode, ended) {
        (Mode::Lease, Ended::Answered(a)) if nothing_done(&a) => Action::Release,
        (Mode::Transaction, Ended::Answered(a)) if nothing_done(&a) => {
            Action::RollBack(Reply::Handler)
        }
        (Mode::Transaction, Ended::Answered(a)) if server_error(&a) && !a.keep => {
            Action::RollBack(Reply::Handler)
        }
        (_, Ended::Answered(_)) => Action::Keep(Keep::Response),
        (Mode::Lease, Ended::BodyFailed) => Action::Keep(kept(Failure::ResponseLost)),
        (Mode::Lease, Ended::Failed) => Action::Keep(kept(Failure::Handler)),
        (Mode::Lease, Ended::Panicked) => Action::Keep(kept(Failure::Panic)),
        (Mode::Lease, Ended::DeadlineCut) => Action::Keep(Keep::Deadline),
        (Mode::Transaction, Ended::BodyFailed) => {
            Action::RollBack(Reply::Answer(undone(Failure::ResponseLost)))
        }
        (Mode::Transaction, Ended::Failed) => Action::RollBack(Reply::Handler),
        (Mode::Transaction, Ended::Panicked) => {
            Action::RollBack(Reply::Answer(undone(Failure::Panic)))
        }
        (Mode::Transaction, Ended::DeadlineCut) => Action::RollBack(Reply::Deadline),
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

//! The rules of the idempotency layer, as pure functions: what the request
//! is, what the store holds for its key and how the handler ended, in; what
//! to do, out. The I/O around them (the store calls and their timeouts, the
//! detached handler, the lease renewals, the held responses) lives in the
//! neighbouring files; no rule lives there.
//!
//! Each function is one step of a keyed request, in order:
//!
//! 1. [`admit`]: does the layer take the request at all (a key on an unsafe
//!    method), refuse it (400), or pass it through?
//! 2. [`on_begin`]: what the store (or the responses this process holds)
//!    says of the key: run the handler, replay, 409, 422, or 503.
//! 3. [`on_renew`]: what a lease renewal found while the handler runs.
//! 4. [`on_end`]: how the handler ended, and so what is kept: the lease
//!    dropped (nothing was done), or a final response stored, 5xx included.
//! 5. [`on_store`]: what storing it found: done, the lease lost, or the
//!    store down (hold the response and try again).

use http::{Method, StatusCode};

use crate::store::{Begin, Fingerprint, LeaseState, StoreError, StoredResponse};

/// What the caller of a keyed request presented, as far as the rules care.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Request<'a> {
    pub(crate) method: &'a Method,
    /// The key: absent, malformed (with a reason), or well-formed.
    pub(crate) key: KeyHeader,
    /// The route requires a key ([`require_key_when`](crate::IdempotencyLayer::require_key_when)).
    pub(crate) required: bool,
    /// The caller presented no credential (under the default scope).
    pub(crate) anonymous: bool,
    /// Keyed requests without credentials are refused.
    pub(crate) refuse_anonymous: bool,
}

/// The key a request carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KeyHeader {
    Absent,
    Malformed(&'static str),
    Present,
}

/// Step 1: what the layer does with a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Admit {
    /// Not the layer's business: a safe method, or no key where none is
    /// required. The handler runs as if the layer were not there.
    Pass,
    /// Answered 400 with this code and message; nothing runs.
    Refuse(&'static str, &'static str),
    /// A keyed operation: read the body, fingerprint it, ask the store.
    Keyed,
}

/// True for GET, HEAD, OPTIONS, TRACE, PUT and DELETE: methods a client may
/// resend without a key, which the layer leaves alone.
pub(crate) fn is_idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

/// Step 1.
pub(crate) fn admit(req: &Request<'_>) -> Admit {
    if is_idempotent(req.method) {
        return Admit::Pass;
    }
    match req.key {
        KeyHeader::Malformed(reason) => Admit::Refuse("idempotency_key_invalid", reason),
        KeyHeader::Absent if req.required => Admit::Refuse(
            "idempotency_key_required",
            "this request must carry an Idempotency-Key header",
        ),
        KeyHeader::Absent => Admit::Pass,
        KeyHeader::Present if req.anonymous && req.refuse_anonymous => Admit::Refuse(
            "idempotency_key_needs_credentials",
            "a request with an Idempotency-Key must identify its caller (credentials)",
        ),
        KeyHeader::Present => Admit::Keyed,
    }
}

/// Step 2: what to do once the store (or this process's held responses)
/// has answered for the key.
#[derive(Debug)]
pub(crate) enum OnBegin {
    /// The lease is this request's: run the handler.
    Run,
    /// The operation finished: replay its response; the handler does not run.
    Replay(StoredResponse),
    /// The same operation is running: 409 with `Retry-After`.
    InProgress,
    /// The key was used with another request: 422.
    Mismatch,
    /// The store cannot answer: 503, nothing runs (fail closed).
    Unavailable(StoreError),
}

/// Step 2. `found` is the store's answer to `begin` (or a held response,
/// given as [`Begin::Completed`]), `fingerprint` this request's.
pub(crate) fn on_begin(found: Result<Begin, StoreError>, fingerprint: Fingerprint) -> OnBegin {
    match found {
        Err(e) => OnBegin::Unavailable(e),
        Ok(Begin::Acquired) => OnBegin::Run,
        Ok(
            Begin::InProgress { fingerprint: fp }
            | Begin::Completed {
                fingerprint: fp, ..
            },
        ) if fp != fingerprint => OnBegin::Mismatch,
        Ok(Begin::InProgress { .. }) => OnBegin::InProgress,
        Ok(Begin::Completed { response, .. }) => OnBegin::Replay(response),
    }
}

/// Step 3: what a renewal of the lease found, while the handler runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OnRenew {
    /// Renewed: renew again in a third of a lease.
    Renewed,
    /// Another request took the key over (this holder's lease expired,
    /// unrenewed): the work goes on (it cannot be taken back), and the loss
    /// is reported.
    Lost,
    /// The store did not answer: try again at the next renewal; the lease
    /// still has two thirds of its life when a renewal fails.
    Retry,
}

/// Step 3.
pub(crate) fn on_renew(found: &Result<LeaseState, StoreError>) -> OnRenew {
    match found {
        Ok(LeaseState::Held) => OnRenew::Renewed,
        Ok(LeaseState::Lost) => OnRenew::Lost,
        Err(_) => OnRenew::Retry,
    }
}

/// Step 4: how the handler ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ended {
    /// It answered, and the response's body was read (up to the cap).
    Answered {
        status: StatusCode,
        /// The handler marked the response [`NothingDone`](super::NothingDone).
        nothing_done: bool,
    },
    /// It answered, and the response's body failed after the head.
    BodyFailed,
    /// It returned an error instead of a response.
    Failed,
    /// It panicked.
    Panicked,
    /// The inbound deadline ran out while it worked, and cut it.
    DeadlineCut,
}

/// What is kept for the key once the handler has ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OnEnd {
    /// Nothing was done: drop the lease, so the caller's retry runs.
    Release,
    /// Store the handler's own response, and replay it from now on.
    StoreResponse,
    /// Store a 500 of the layer's own saying what happened (`code`): the
    /// work may have run, so it must not run again.
    StoreFailure(&'static str),
    /// Store the deadline's 504: the work may have run in part.
    StoreDeadline,
}

/// Step 4. Once the handler has started, its end is final: its response is
/// kept, 5xx included, unless it says nothing was done — it is marked
/// [`NothingDone`](super::NothingDone), or it is a 429 (RFC 6585: the
/// request was not processed).
pub(crate) fn on_end(ended: Ended) -> OnEnd {
    match ended {
        Ended::Answered {
            nothing_done: true, ..
        } => OnEnd::Release,
        Ended::Answered { status, .. } if status == StatusCode::TOO_MANY_REQUESTS => OnEnd::Release,
        Ended::Answered { .. } => OnEnd::StoreResponse,
        Ended::BodyFailed => OnEnd::StoreFailure("response_lost"),
        Ended::Failed => OnEnd::StoreFailure("handler_failed"),
        Ended::Panicked => OnEnd::StoreFailure("handler_panicked"),
        Ended::DeadlineCut => OnEnd::StoreDeadline,
    }
}

/// Step 5: what storing the final response found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OnStore {
    /// Stored: replays answer from the store.
    Stored,
    /// The lease was taken over before the response could be stored: another
    /// run of the key may have happened. Reported; nothing more can be done.
    LeaseLost,
    /// The store did not answer: hold the response in this process (which
    /// answers the key from it) and store it in the background until it
    /// lands.
    Hold,
}

/// Step 5.
pub(crate) fn on_store(found: &Result<LeaseState, StoreError>) -> OnStore {
    match found {
        Ok(LeaseState::Held) => OnStore::Stored,
        Ok(LeaseState::Lost) => OnStore::LeaseLost,
        Err(_) => OnStore::Hold,
    }
}

#[cfg(test)]
mod tests {
    //! DESIGN section 7, row by row.

    use super::*;
    use http::HeaderMap;

    fn req(method: &Method, key: KeyHeader) -> Request<'_> {
        Request {
            method,
            key,
            required: false,
            anonymous: false,
            refuse_anonymous: false,
        }
    }

    #[test]
    fn which_requests_are_the_layers() {
        // Safe methods pass, whatever they carry.
        for m in [
            Method::GET,
            Method::HEAD,
            Method::OPTIONS,
            Method::TRACE,
            Method::PUT,
            Method::DELETE,
        ] {
            for key in [
                KeyHeader::Absent,
                KeyHeader::Present,
                KeyHeader::Malformed("x"),
            ] {
                let mut r = req(&m, key);
                r.required = true;
                assert_eq!(admit(&r), Admit::Pass, "{m} {key:?}");
            }
        }
        for m in [Method::POST, Method::PATCH, Method::CONNECT] {
            // Key: 1..=255 visible ASCII, else 400.
            assert_eq!(
                admit(&req(&m, KeyHeader::Malformed("bad"))),
                Admit::Refuse("idempotency_key_invalid", "bad")
            );
            assert_eq!(admit(&req(&m, KeyHeader::Present)), Admit::Keyed);
            // No key: passes, unless the route requires one (400).
            assert_eq!(admit(&req(&m, KeyHeader::Absent)), Admit::Pass);
            let mut required = req(&m, KeyHeader::Absent);
            required.required = true;
            assert!(matches!(
                admit(&required),
                Admit::Refuse("idempotency_key_required", _)
            ));
            // Callers without credentials: keyed (the documented shared
            // scope), or refused when so configured.
            let mut anon = req(&m, KeyHeader::Present);
            anon.anonymous = true;
            assert_eq!(admit(&anon), Admit::Keyed);
            anon.refuse_anonymous = true;
            assert!(matches!(
                admit(&anon),
                Admit::Refuse("idempotency_key_needs_credentials", _)
            ));
            // Refusing anonymous callers does not touch the others.
            let mut known = req(&m, KeyHeader::Present);
            known.refuse_anonymous = true;
            assert_eq!(admit(&known), Admit::Keyed);
        }
    }

    fn stored() -> StoredResponse {
        StoredResponse {
            status: StatusCode::CREATED,
            headers: HeaderMap::new(),
            body: bytes::Bytes::from_static(b"done"),
            body_omitted: false,
        }
    }

    #[test]
    fn what_the_store_holds_decides_who_runs() {
        let (mine, other) = (Fingerprint([1; 32]), Fingerprint([2; 32]));
        // First request: it runs.
        assert!(matches!(on_begin(Ok(Begin::Acquired), mine), OnBegin::Run));
        // Same key while the first is running: 409.
        assert!(matches!(
            on_begin(Ok(Begin::InProgress { fingerprint: mine }), mine),
            OnBegin::InProgress
        ));
        // Same key after it finished: the stored response.
        match on_begin(
            Ok(Begin::Completed {
                fingerprint: mine,
                response: stored(),
            }),
            mine,
        ) {
            OnBegin::Replay(r) => assert_eq!(r, stored()),
            other => panic!("{other:?}"),
        }
        // Same key, other fingerprint: 422, running or finished.
        assert!(matches!(
            on_begin(Ok(Begin::InProgress { fingerprint: other }), mine),
            OnBegin::Mismatch
        ));
        assert!(matches!(
            on_begin(
                Ok(Begin::Completed {
                    fingerprint: other,
                    response: stored()
                }),
                mine
            ),
            OnBegin::Mismatch
        ));
        // A store that cannot answer: fail closed.
        assert!(matches!(
            on_begin(Err(StoreError::new("down")), mine),
            OnBegin::Unavailable(_)
        ));
    }

    #[test]
    fn renewals() {
        assert_eq!(on_renew(&Ok(LeaseState::Held)), OnRenew::Renewed);
        assert_eq!(on_renew(&Ok(LeaseState::Lost)), OnRenew::Lost);
        assert_eq!(on_renew(&Err(StoreError::new("down"))), OnRenew::Retry);
    }

    #[test]
    fn once_the_handler_started_its_end_is_kept() {
        let answered = |code: u16, nothing_done| Ended::Answered {
            status: StatusCode::from_u16(code).unwrap(),
            nothing_done,
        };
        // Final responses are stored, 5xx included.
        for code in [200, 201, 302, 400, 404, 409, 422, 500, 502, 503, 504] {
            assert_eq!(
                on_end(answered(code, false)),
                OnEnd::StoreResponse,
                "{code}"
            );
            // ... unless the handler says nothing was done.
            assert_eq!(on_end(answered(code, true)), OnEnd::Release, "{code}");
        }
        // A 429 says the request was not processed.
        assert_eq!(on_end(answered(429, false)), OnEnd::Release);
        // A body that fails after the head: stored as a 5xx saying so.
        assert_eq!(
            on_end(Ended::BodyFailed),
            OnEnd::StoreFailure("response_lost")
        );
        // An error or a panic after the work may have begun: never again.
        assert_eq!(on_end(Ended::Failed), OnEnd::StoreFailure("handler_failed"));
        assert_eq!(
            on_end(Ended::Panicked),
            OnEnd::StoreFailure("handler_panicked")
        );
        // The deadline cut the work: its 504 is the operation's end.
        assert_eq!(on_end(Ended::DeadlineCut), OnEnd::StoreDeadline);
    }

    #[test]
    fn a_store_write_that_fails_is_held_and_retried() {
        assert_eq!(on_store(&Ok(LeaseState::Held)), OnStore::Stored);
        assert_eq!(on_store(&Ok(LeaseState::Lost)), OnStore::LeaseLost);
        assert_eq!(on_store(&Err(StoreError::new("down"))), OnStore::Hold);
    }
}

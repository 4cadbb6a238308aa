//! DESIGN section 7, row by row, in both modes and both protocols.

use super::*;
use http::HeaderMap;

use Mode::{Lease, Transaction};

fn arrival(mode: Mode, method: Method, key: KeyHeader<()>) -> Arrival<()> {
    Arrival {
        mode,
        method,
        key,
        required: false,
        anonymous: false,
        refuse_anonymous: false,
    }
}

#[test]
fn which_requests_are_the_layers() {
    for mode in [Lease, Transaction] {
        // Safe methods pass, whatever they carry, even where a key is required.
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
                KeyHeader::Present(()),
                KeyHeader::Malformed("x"),
            ] {
                let step = Arrival {
                    required: true,
                    ..arrival(mode, m.clone(), key)
                };
                assert_eq!(arrived(step), OnArrival::Pass, "{mode:?} {m} {key:?}");
            }
        }
        for m in [Method::POST, Method::PATCH, Method::CONNECT] {
            // Key: 1..=255 visible ASCII, else 400.
            assert_eq!(
                arrived(arrival(mode, m.clone(), KeyHeader::Malformed("bad"))),
                OnArrival::Refuse(Answer::KeyInvalid("bad"))
            );
            assert_eq!(
                arrived(arrival(mode, m.clone(), KeyHeader::Present(()))),
                OnArrival::ReadBody(())
            );
            // No key: the handler runs as it would without the layer (in
            // the transactional mode, in a transaction), unless the route
            // requires one (400).
            let unkeyed = match mode {
                Lease => OnArrival::Pass,
                Transaction => OnArrival::Transact,
            };
            assert_eq!(
                arrived(arrival(mode, m.clone(), KeyHeader::Absent)),
                unkeyed
            );
            let required = Arrival {
                required: true,
                ..arrival(mode, m.clone(), KeyHeader::Absent)
            };
            assert_eq!(arrived(required), OnArrival::Refuse(Answer::KeyRequired));
            // Callers without credentials: keyed (the documented shared
            // scope), or refused when so configured.
            let anon = |refuse_anonymous| Arrival {
                mode,
                method: m.clone(),
                key: KeyHeader::Present(()),
                required: false,
                anonymous: true,
                refuse_anonymous,
            };
            assert_eq!(arrived(anon(false)), OnArrival::ReadBody(()));
            assert_eq!(
                arrived(anon(true)),
                OnArrival::Refuse(Answer::KeyNeedsCredentials)
            );
            // Refusing anonymous callers does not touch the others.
            let known = Arrival {
                mode,
                method: m.clone(),
                key: KeyHeader::Present(()),
                required: false,
                anonymous: false,
                refuse_anonymous: true,
            };
            assert_eq!(arrived(known), OnArrival::ReadBody(()));
        }
    }
}

#[test]
fn a_body_over_the_cap_or_broken_runs_nothing() {
    assert_eq!(body_read(BodyRead::Read), OnBody::Claim);
    assert_eq!(
        body_read(BodyRead::TooLarge { cap: 8 }),
        OnBody::Refuse(Answer::RequestTooLarge { cap: 8 })
    );
    assert_eq!(
        body_read(BodyRead::Failed),
        OnBody::Refuse(Answer::RequestBodyFailed)
    );
}

fn stored() -> StoredResponse {
    StoredResponse::new(
        StatusCode::CREATED,
        HeaderMap::new(),
        bytes::Bytes::from_static(b"done"),
    )
}

fn on(found: Result<Begin, StoreError>, fingerprint: Fingerprint) -> OnFound {
    super::found(Found {
        found,
        fingerprint,
        retry_after: Duration::from_secs(3),
    })
}

#[test]
fn what_holds_the_key_decides_who_runs() {
    let (mine, other) = (Fingerprint([1; 32]), Fingerprint([2; 32]));
    // First request: it runs.
    assert_eq!(on(Ok(Begin::Acquired), mine), OnFound::Run);
    // Same key while the first is running: 409, with the configured wait.
    assert_eq!(
        on(Ok(Begin::InProgress { fingerprint: mine }), mine),
        OnFound::Refuse(Answer::InProgress {
            retry_after: Duration::from_secs(3)
        })
    );
    // Same key after it finished: the stored response.
    let done = Begin::Completed {
        fingerprint: mine,
        response: Box::new(stored()),
    };
    assert_eq!(on(Ok(done), mine), OnFound::Replay(Box::new(stored())));
    // Same key, other fingerprint: 422, running or finished.
    assert_eq!(
        on(Ok(Begin::InProgress { fingerprint: other }), mine),
        OnFound::Refuse(Answer::KeyReused)
    );
    let theirs = Begin::Completed {
        fingerprint: other,
        response: Box::new(stored()),
    };
    assert_eq!(on(Ok(theirs), mine), OnFound::Refuse(Answer::KeyReused));
    // A store that cannot answer: fail closed; one that is not set up says so.
    assert_eq!(
        on(Err(StoreError::new("down")), mine),
        OnFound::Refuse(Answer::StoreUnavailable)
    );
    assert_eq!(
        on(Err(StoreError::not_set_up("no table")), mine),
        OnFound::Refuse(Answer::StoreNotSetUp)
    );
    // The transaction of an unkeyed request that cannot begin: the same.
    assert_eq!(
        unavailable(&StoreError::new("down")),
        Answer::StoreUnavailable
    );
    assert_eq!(
        unavailable(&StoreError::not_set_up("no table")),
        Answer::StoreNotSetUp
    );
}

#[test]
fn renewals() {
    assert_eq!(renewed(Ok(LeaseState::Held)), OnRenewal::Renewed);
    // The holder's own finished record: its response is stored, no lease is
    // lost (a renewal that crossed its `complete` must not cry wolf).
    assert_eq!(renewed(Ok(LeaseState::Completed)), OnRenewal::AlreadyStored);
    assert_eq!(renewed(Ok(LeaseState::Lost)), OnRenewal::LeaseLost);
    assert_eq!(renewed(Err(StoreError::new("down"))), OnRenewal::RenewLater);
}

fn http(code: u16) -> Answered {
    Answered {
        status: StatusCode::from_u16(code).unwrap(),
        grpc: None,
        pushback: false,
        nothing_done: false,
        keep: false,
    }
}

fn grpc(code: GrpcCode) -> Answered {
    Answered {
        grpc: Some(code),
        ..http(200)
    }
}

/// The handler's response, error and deadline cut, as the rules see them:
/// passed on as they are.
type End = OnEnd<(), (), ()>;

fn end(mode: Mode, e: Ended<(), (), ()>) -> End {
    ended(mode, e)
}

fn answered(mode: Mode, a: Answered) -> End {
    end(mode, Ended::Answered(a, ()))
}

const KEEP: End = OnEnd::Keep(Keep::Response(()));
const RELEASE: End = OnEnd::Release(());
const ROLL_BACK: End = OnEnd::RollBack(Unkept::Response(()));

#[test]
fn on_a_lease_once_the_handler_started_its_end_is_kept() {
    // Final responses are stored, 5xx included ...
    for code in [200, 201, 302, 400, 404, 409, 422, 500, 502, 503, 504] {
        assert_eq!(answered(Lease, http(code)), KEEP, "{code}");
        // ... unless the handler says nothing was done.
        let marked = Answered {
            nothing_done: true,
            ..http(code)
        };
        assert_eq!(answered(Lease, marked), RELEASE, "{code}");
    }
    // A 429 says the request was not processed.
    assert_eq!(answered(Lease, http(429)), RELEASE);
    // A body that fails after the head: stored as a 500 saying so.
    let failed = |failure| Answer::Failed {
        failure,
        undone: false,
    };
    let kept = |failure| OnEnd::Keep(Keep::Answer(failed(failure)));
    assert_eq!(end(Lease, Ended::BodyFailed), kept(Failure::ResponseLost));
    // An error or a panic after the work may have begun: never again.
    assert_eq!(
        end(Lease, Ended::Failed(())),
        OnEnd::Keep(Keep::Failed(failed(Failure::Handler), ()))
    );
    assert_eq!(end(Lease, Ended::Panicked), kept(Failure::Panic));
    // The deadline cut the work: its 504 is the operation's end.
    assert_eq!(
        end(Lease, Ended::DeadlineCut(())),
        OnEnd::Keep(Keep::Deadline(()))
    );
}

#[test]
fn on_a_lease_a_grpc_status_that_says_nothing_was_done_releases_the_key() {
    for code in [
        GrpcCode::Ok,
        GrpcCode::InvalidArgument,
        GrpcCode::NotFound,
        GrpcCode::AlreadyExists,
        GrpcCode::Aborted,
        GrpcCode::Internal,
        GrpcCode::Unknown,
        GrpcCode::DeadlineExceeded,
        // Without a pushback, RESOURCE_EXHAUSTED may be a quota the work
        // itself spent.
        GrpcCode::ResourceExhausted,
    ] {
        assert_eq!(answered(Lease, grpc(code)), KEEP, "{code}");
    }
    assert_eq!(answered(Lease, grpc(GrpcCode::Unavailable)), RELEASE);
    let pushed_back = Answered {
        pushback: true,
        ..grpc(GrpcCode::ResourceExhausted)
    };
    assert_eq!(answered(Lease, pushed_back), RELEASE);
    // Marked by the handler (a tonic `Status` with the marker): released.
    let marked = Answered {
        nothing_done: true,
        ..grpc(GrpcCode::FailedPrecondition)
    };
    assert_eq!(answered(Lease, marked), RELEASE);
}

#[test]
fn in_a_transaction_what_is_not_kept_is_undone() {
    // 2xx, 3xx and 4xx commit with their record.
    for code in [200, 201, 302, 400, 404, 409, 422] {
        assert_eq!(answered(Transaction, http(code)), KEEP, "{code}");
    }
    // A 5xx rolls back, and the key with it, so a retry runs ...
    for code in [500, 502, 503, 504] {
        assert_eq!(answered(Transaction, http(code)), ROLL_BACK, "{code}");
        // ... unless the handler says to keep it.
        let kept = Answered {
            keep: true,
            ..http(code)
        };
        assert_eq!(answered(Transaction, kept), KEEP, "{code}");
    }
    // Nothing done: rolled back, marked or not, kept or not.
    for a in [
        http(429),
        Answered {
            nothing_done: true,
            ..http(201)
        },
        Answered {
            nothing_done: true,
            keep: true,
            ..http(500)
        },
    ] {
        assert_eq!(answered(Transaction, a), ROLL_BACK, "{a:?}");
    }
    // gRPC: the server-error statuses roll back like a 5xx, the others commit.
    for code in [
        GrpcCode::Internal,
        GrpcCode::Unknown,
        GrpcCode::DataLoss,
        GrpcCode::Unimplemented,
        GrpcCode::DeadlineExceeded,
        GrpcCode::Unavailable,
    ] {
        assert_eq!(answered(Transaction, grpc(code)), ROLL_BACK, "{code}");
    }
    for code in [
        GrpcCode::Ok,
        GrpcCode::InvalidArgument,
        GrpcCode::AlreadyExists,
    ] {
        assert_eq!(answered(Transaction, grpc(code)), KEEP, "{code}");
    }
    // Failures: rolled back, and said so; the handler's own error reaches
    // its caller as it is.
    let undone = |failure| {
        OnEnd::RollBack(Unkept::Answer(Answer::Failed {
            failure,
            undone: true,
        }))
    };
    assert_eq!(
        end(Transaction, Ended::BodyFailed),
        undone(Failure::ResponseLost)
    );
    assert_eq!(end(Transaction, Ended::Panicked), undone(Failure::Panic));
    assert_eq!(
        end(Transaction, Ended::Failed(())),
        OnEnd::RollBack(Unkept::Error(()))
    );
    assert_eq!(
        end(Transaction, Ended::DeadlineCut(())),
        OnEnd::RollBack(Unkept::Deadline(()))
    );
}

#[test]
fn keeping_an_end() {
    // A lease store: stored, lost, or held for a store that did not answer.
    assert_eq!(completed(Ok(LeaseState::Held)), OnCompletion::Stored);
    assert_eq!(completed(Ok(LeaseState::Completed)), OnCompletion::Stored);
    assert_eq!(completed(Ok(LeaseState::Lost)), OnCompletion::LeaseLost);
    assert_eq!(completed(Err(StoreError::new("down"))), OnCompletion::Hold);
    // A transaction: committed; or not, and why.
    let committed = |c, code| super::committed(c, StatusCode::from_u16(code).unwrap());
    assert_eq!(committed(Commit::Done, 201), OnCommit::Answered);
    // A statement of the handler's failed, and it answered with an error:
    // its answer stands, nothing is kept, whatever the SQLSTATE.
    for failed in [Sqlstate::Integrity, Sqlstate::Transient, Sqlstate::Other] {
        for status in [409, 422, 500, 503] {
            assert_eq!(
                committed(Commit::Aborted(failed), status),
                OnCommit::RollBack(Reply::Handler),
                "{failed:?} {status}"
            );
        }
    }
    // ... and answered as if it had succeeded: it did not, and the SQLSTATE
    // says whether another try can pass. A constraint: never (a final 422);
    // a serialization failure or a deadlock: next time (503, Retry-After);
    // anything else: a 500, as the layer cannot say.
    assert_eq!(
        committed(Commit::Aborted(Sqlstate::Integrity), 201),
        OnCommit::RollBack(Reply::Answer(Answer::ConstraintViolation))
    );
    assert_eq!(
        committed(Commit::Aborted(Sqlstate::Transient), 200),
        OnCommit::RollBack(Reply::Answer(Answer::TransactionConflict))
    );
    assert_eq!(
        committed(Commit::Aborted(Sqlstate::Other), 201),
        OnCommit::RollBack(Reply::Answer(Answer::TransactionAborted))
    );
    assert_eq!(
        committed(Commit::Refused, 201),
        OnCommit::RollBack(Reply::Answer(Answer::Failed {
            failure: Failure::Handler,
            undone: true
        }))
    );
    // Only a commit that may have happened is unknown.
    assert_eq!(
        committed(Commit::Unknown, 201),
        OnCommit::Answer(Answer::CommitOutcomeUnknown)
    );
}

/// What a SQLSTATE says of another try.
#[test]
fn sqlstates_by_what_they_mean() {
    for code in ["23505", "23503", "23514", "23502", "23P01", "23000"] {
        assert_eq!(Sqlstate::of(code), Sqlstate::Integrity, "{code}");
    }
    for code in ["40001", "40P01"] {
        assert_eq!(Sqlstate::of(code), Sqlstate::Transient, "{code}");
    }
    for code in [
        "40000", "40002", "42P01", "25P02", "57014", "P0001", "XX000", "",
    ] {
        assert_eq!(Sqlstate::of(code), Sqlstate::Other, "{code}");
    }
}

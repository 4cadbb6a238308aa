//! The behaviour suite every HTTP transport must pass, written once and
//! expanded in each transport's test binary (`tests/retry.rs` over
//! hyper-util, `tests/reqwest.rs` over reqwest) with that binary's
//! `transport()` and `server()` in scope.

/// Expands the shared behaviour tests: GET through 503s, a 400 returned at
/// once, a POST without a key that worked then hung (sent once, outcome
/// unknown), a POST with keys (one key per call, reused on every attempt), a
/// closed port (retried, not sent), and a silent upstream (the deadline,
/// never later).
#[allow(unused_macros)] // the tonic binary shares `common` but not this suite
macro_rules! http_behaviour_suite {
    () => {
        mod http_behaviour_suite {
            use super::*;
            use http::Uri;
            use http_body_util::BodyExt;

            #[tokio::test(flavor = "current_thread", start_paused = true)]
            async fn get_through_503_503_200_answers_200_after_three_attempts() {
                let server = server(
                    Script::new()
                        .then_n(2, Reply::status(503))
                        .otherwise(Reply::ok().body("parcel 7")),
                )
                .await;
                let client = stack().service(transport());

                let resp = within(client.oneshot(get(server.uri("/items"))))
                    .await
                    .expect("the third attempt answers 200");

                assert_eq!(resp.status(), StatusCode::OK);
                let a = attempts(&resp);
                assert_eq!(a.len(), 3);
                assert_eq!(a.stop(), Stop::Final);
                assert_eq!(
                    a.iter().map(|a| a.status()).collect::<Vec<_>>(),
                    [
                        Some(StatusCode::SERVICE_UNAVAILABLE),
                        Some(StatusCode::SERVICE_UNAVAILABLE),
                        Some(StatusCode::OK)
                    ]
                );
                let body = resp
                    .into_body()
                    .collect()
                    .await
                    .expect("the body arrives")
                    .to_bytes();
                assert_eq!(body, "parcel 7");
                assert_eq!(server.arrival_count(), 3);
            }

            #[tokio::test(flavor = "current_thread", start_paused = true)]
            async fn get_answered_400_is_returned_after_one_attempt() {
                let server = server(Script::new().otherwise(Reply::status(400))).await;
                let client = stack().service(transport());

                let resp = within(client.oneshot(get(server.uri("/items"))))
                    .await
                    .expect("a 400 is an answer, not an error");

                assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
                assert_eq!(attempts(&resp).len(), 1);
                idle(10 * SECOND).await;
                assert_eq!(server.arrival_count(), 1);
            }

            #[tokio::test(flavor = "current_thread", start_paused = true)]
            async fn post_without_key_that_worked_then_hung_is_sent_once_and_outcome_unknown() {
                let server = server(Script::new().otherwise(Reply::work_then_hang())).await;
                let client = stack().attempt_timeout(SECOND).service(transport());

                let err = within(client.oneshot(post(server.uri("/charges"))))
                    .await
                    .expect_err("nobody answers");

                assert_eq!(err.kind(), ErrorKind::OutcomeUnknown);
                assert!(!err.is_not_sent());
                let history = err.history().expect("the retry layer records the call");
                assert_eq!(history.len(), 1);
                assert_eq!(history.stop(), Stop::OutcomeUnknown);
                idle(30 * SECOND).await;
                assert_eq!(server.arrival_count(), 1);
                assert_eq!(server.arrivals()[0].body, "amount=100");
                assert_eq!(server.total_effects(), 1);
            }

            #[tokio::test(flavor = "current_thread", start_paused = true)]
            async fn post_with_idempotency_keys_is_retried_with_one_key_per_logical_call() {
                let server = server(Script::new().otherwise(Reply::work_then_hang())).await;
                let client = stack()
                    .attempt_timeout(SECOND)
                    .idempotency_keys()
                    .service(transport());

                let mut chosen = Vec::new();
                for _ in 0..2 {
                    let err = within(client.clone().oneshot(post(server.uri("/charges"))))
                        .await
                        .expect_err("nobody answers");
                    // It may have been processed, under a key the stack
                    // chose: outcome unknown, and the key to retry with.
                    assert_eq!(err.kind(), ErrorKind::OutcomeUnknown, "{err}");
                    assert!(matches!(
                        err.retry_advice(),
                        tower_resend::RetryAdvice::SameKey(_)
                    ));
                    chosen.push(err.idempotency_key().map(str::to_owned));
                    assert_eq!(err.attempts(), 3);
                    assert_eq!(
                        err.history().map(|h| h.stop()),
                        Some(Stop::MaxAttempts),
                        "{err}"
                    );
                }

                idle(30 * SECOND).await;
                let arrivals = server.arrivals();
                assert_eq!(arrivals.len(), 6, "3 attempts (the cap) per logical POST");
                let keys: Vec<Option<String>> =
                    arrivals.iter().map(|a| a.idempotency_key.clone()).collect();
                let (first, second) = keys.split_at(3);
                assert!(first[0].is_some() && second[0].is_some(), "{keys:?}");
                assert!(first.iter().all(|k| *k == first[0]), "{keys:?}");
                assert!(second.iter().all(|k| *k == second[0]), "{keys:?}");
                assert_ne!(first[0], second[0], "two logical POSTs, two keys");
                assert_eq!(chosen, [first[0].clone(), second[0].clone()]);
                assert!(arrivals.iter().all(|a| a.body == "amount=100"));
                assert_eq!(server.effects(first[0].as_deref()), 3);
                assert_eq!(server.effects(None), 0);
            }

            #[tokio::test(flavor = "current_thread", start_paused = true)]
            async fn post_to_a_closed_port_is_retried_up_to_the_cap_and_says_not_sent() {
                let uri: Uri = format!("http://127.0.0.1:{}/charges", closed_port())
                    .parse()
                    .expect("a valid uri");
                let client = stack().no_budget().service(transport());

                let err = within(client.oneshot(post(uri)))
                    .await
                    .expect_err("nothing listens");

                assert_eq!(err.kind(), ErrorKind::RetriesExhausted);
                assert!(err.is_not_sent());
                assert!(!err.is_outcome_unknown());
                let history = err.history().expect("the retry layer records the call");
                assert_eq!(history.len(), 3);
                assert!(history.iter().all(|a| a.class() == Class::NotSent));
                assert!(!history.any_sent());
            }

            #[tokio::test(flavor = "current_thread", start_paused = true)]
            async fn a_silent_upstream_is_given_up_on_by_the_deadline_with_deadline_exceeded() {
                for seed in 0..8 {
                    let server = server(Script::new().otherwise(Reply::never())).await;
                    let client = stack()
                        .seed(seed)
                        .no_budget()
                        .total(SECOND)
                        .attempt_timeout(400 * MS)
                        .service(transport());
                    let start = Instant::now();
                    let err = within(client.oneshot(get(server.uri("/items"))))
                        .await
                        .expect_err("nobody answers");

                    let elapsed = start.elapsed();
                    assert!(elapsed <= SECOND + 5 * MS, "seed {seed}: {elapsed:?}");
                    assert_eq!(
                        err.kind(),
                        ErrorKind::DeadlineExceeded,
                        "seed {seed}: {err}"
                    );
                    assert!(!err.is_not_sent(), "seed {seed}: {err}");
                    assert!(
                        (2..=3).contains(&server.arrival_count()),
                        "seed {seed}: {}",
                        server.arrival_count()
                    );
                }
            }
        }
    };
}

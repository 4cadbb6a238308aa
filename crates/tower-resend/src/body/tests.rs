use std::collections::VecDeque;
use std::marker::PhantomPinned;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::Wake;

use http::HeaderValue;
use http_body_util::{BodyExt, Empty, Full};
use pin_project_lite::pin_project;
use proptest::prelude::*;

use std::sync::Arc;
use std::task::Waker;

use http::HeaderMap;

use super::*;

#[test]
fn stays_two_words() {
    // A request is moved many times inside hyper's client; a larger body
    // took `Request<ReplayBody<Empty<Bytes>>>` past 256 bytes, where each
    // of those moves costs more (BENCHMARKS.md, loopback instructions).
    assert!(std::mem::size_of::<ReplayBody<Empty<Bytes>>>() <= 16);
    assert!(std::mem::size_of::<http::Request<ReplayBody<Empty<Bytes>>>>() <= 256);
}

enum Step {
    Data(Bytes),
    Trailers(HeaderMap),
    Fail(&'static str),
    /// Returns `Pending` once, without waking anyone.
    Pending,
    Panic,
}

pin_project! {
    /// A body that plays a script. `!Unpin`, to show that none is needed.
    struct Script {
        steps: VecDeque<Step>,
        #[pin]
        _pin: PhantomPinned,
    }
}

impl Script {
    fn new(steps: impl IntoIterator<Item = Step>) -> Self {
        Self {
            steps: steps.into_iter().collect(),
            _pin: PhantomPinned,
        }
    }

    fn chunks<I: IntoIterator<Item = Vec<u8>>>(chunks: I) -> Self {
        Self::new(chunks.into_iter().map(|c| Step::Data(Bytes::from(c))))
    }
}

impl Body for Script {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().steps.pop_front() {
            None => Poll::Ready(None),
            Some(Step::Data(data)) => Poll::Ready(Some(Ok(Frame::data(data)))),
            Some(Step::Trailers(t)) => Poll::Ready(Some(Ok(Frame::trailers(t)))),
            Some(Step::Fail(msg)) => Poll::Ready(Some(Err(msg.into()))),
            Some(Step::Pending) => Poll::Pending,
            Some(Step::Panic) => panic!("the original body panicked"),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.steps.is_empty()
    }
}

type Polled = Poll<Option<Result<Frame<Bytes>, BoxError>>>;

fn poll<B>(body: &mut ReplayBody<B>) -> Polled
where
    B: Body,
    B::Error: Into<BoxError>,
{
    Pin::new(body).poll_frame(&mut Context::from_waker(Waker::noop()))
}

fn next_data<B>(body: &mut ReplayBody<B>) -> Bytes
where
    B: Body,
    B::Error: Into<BoxError>,
{
    match poll(body) {
        Poll::Ready(Some(Ok(frame))) => frame.into_data().expect("a data frame"),
        other => panic!("expected data, got {other:?}"),
    }
}

fn next_error<B>(body: &mut ReplayBody<B>) -> BoxError
where
    B: Body,
    B::Error: Into<BoxError>,
{
    match poll(body) {
        Poll::Ready(Some(Err(e))) => e,
        other => panic!("expected an error, got {other:?}"),
    }
}

fn replay_reason(e: &BoxError) -> Reason {
    e.downcast_ref::<ReplayError>()
        .expect("a ReplayError")
        .reason
}

/// Reads to the end (skipping `Pending`s the script plays): the data
/// frames and the trailers.
fn read_all<B>(body: &mut ReplayBody<B>) -> Result<(Vec<Bytes>, Option<HeaderMap>), BoxError>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let mut data = Vec::new();
    let mut trailers = None;
    for _ in 0..10_000 {
        match poll(body) {
            Poll::Pending => {}
            Poll::Ready(None) => return Ok((data, trailers)),
            Poll::Ready(Some(Err(e))) => return Err(e),
            Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                Ok(d) => data.push(d),
                Err(frame) => trailers = frame.into_trailers().ok(),
            },
        }
    }
    panic!("body did not end");
}

fn concat(chunks: &[Bytes]) -> Vec<u8> {
    chunks.iter().flat_map(|c| c.iter().copied()).collect()
}

fn script_of_sizes(sizes: &[usize]) -> (Script, Vec<u8>) {
    let chunks: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| (0..n).map(|j| (i * 31 + j) as u8).collect())
        .collect();
    let all = chunks.concat();
    (Script::chunks(chunks), all)
}

#[test]
fn full_body_is_replayed_from_the_same_allocation() {
    let original = Bytes::from(vec![42u8; 1000]);
    let ptr = original.as_ptr();
    let body = ReplayBody::new(Full::new(original), DEFAULT_REPLAY_CAP);
    assert_eq!(body.size_hint().exact(), Some(1000));

    let mut first = body.try_clone().unwrap();
    assert_eq!(first.size_hint().exact(), Some(1000));
    let a = next_data(&mut first);
    assert_eq!(a.as_ptr(), ptr);
    assert!(matches!(poll(&mut first), Poll::Ready(None)));
    assert!(first.is_end_stream());

    let mut second = body.try_clone().unwrap();
    assert!(!second.is_end_stream());
    assert_eq!(second.size_hint().exact(), Some(1000));
    let b = next_data(&mut second);
    assert_eq!(b.as_ptr(), ptr, "replayed without a copy");
    assert_eq!(a, b);
    assert!(second.is_end_stream());
    assert!(matches!(poll(&mut second), Poll::Ready(None)));
    assert!(!body.is_capped());
}

#[test]
fn many_chunks_under_the_cap_are_replayed_byte_for_byte() {
    let sizes: Vec<usize> = (0..100).map(|i| (i * 7) % 50).collect();
    let (script, all) = script_of_sizes(&sizes);
    let body = ReplayBody::new(script, DEFAULT_REPLAY_CAP);

    let (first, _) = read_all(&mut body.try_clone().unwrap()).unwrap();
    let (second, _) = read_all(&mut body.try_clone().unwrap()).unwrap();
    assert_eq!(concat(&first), all);
    assert_eq!(first, second, "same frames, same boundaries");
    let (third, _) = read_all(&mut body.try_clone().unwrap()).unwrap();
    assert_eq!(concat(&third), all);
}

#[test]
fn a_partly_read_attempt_is_replayed_then_the_rest_streamed() {
    let (script, all) = script_of_sizes(&[3, 4, 5, 6, 7]);
    let body = ReplayBody::new(script, DEFAULT_REPLAY_CAP);

    let mut first = body.try_clone().unwrap();
    next_data(&mut first);
    next_data(&mut first);
    drop(first);

    let mut second = body.try_clone().unwrap();
    assert_eq!(second.size_hint().lower(), 7, "kept bytes are counted");
    let (chunks, _) = read_all(&mut second).unwrap();
    assert_eq!(chunks.len(), 5);
    assert_eq!(concat(&chunks), all);

    let (chunks, _) = read_all(&mut body.try_clone().unwrap()).unwrap();
    assert_eq!(concat(&chunks), all);
}

#[test]
fn over_the_cap_streams_once_and_is_not_replayable() {
    let (script, all) = script_of_sizes(&[4, 4, 4]);
    let body = ReplayBody::new(script, 10);
    let mut first = body.try_clone().unwrap();
    next_data(&mut first);
    next_data(&mut first);
    assert!(!body.is_capped());
    assert!(body.try_clone().is_some(), "8 bytes kept, under the cap");

    let (rest, _) = read_all(&mut first).unwrap();
    assert_eq!(
        concat(&rest),
        all[8..],
        "the attempt in progress streams on"
    );
    assert!(body.is_capped());
    assert!(body.try_clone().is_none());
}

#[test]
fn a_clone_made_before_the_cap_fails_instead_of_sending_half() {
    let (script, _) = script_of_sizes(&[4, 4, 4]);
    let body = ReplayBody::new(script, 10);
    let mut first = body.try_clone().unwrap();
    let mut early = body.try_clone().unwrap();
    read_all(&mut first).unwrap();
    let e = next_error(&mut early);
    assert_eq!(replay_reason(&e), Reason::Capped);
    assert!(matches!(poll(&mut early), Poll::Ready(None)));
}

#[test]
fn exactly_at_the_cap_is_replayable_one_more_byte_is_not() {
    for (cap, replayable) in [(12, true), (11, false)] {
        let (script, all) = script_of_sizes(&[4, 4, 4]);
        let body = ReplayBody::new(script, cap);
        let (first, _) = read_all(&mut body.try_clone().unwrap()).unwrap();
        assert_eq!(concat(&first), all);
        assert_eq!(body.is_capped(), !replayable, "cap {cap}");
        match body.try_clone() {
            Some(mut again) => {
                assert!(replayable);
                assert_eq!(concat(&read_all(&mut again).unwrap().0), all);
            }
            None => assert!(!replayable),
        }
    }
}

#[test]
fn an_error_of_the_original_reaches_the_attempt_and_ends_replays() {
    let body = ReplayBody::new(
        Script::new([Step::Data(Bytes::from_static(b"ab")), Step::Fail("boom")]),
        DEFAULT_REPLAY_CAP,
    );
    let mut early = body.try_clone().unwrap();
    let mut first = body.try_clone().unwrap();
    assert_eq!(next_data(&mut first), "ab");
    assert_eq!(next_error(&mut first).to_string(), "boom");
    assert!(first.is_end_stream());
    assert!(matches!(poll(&mut first), Poll::Ready(None)));

    assert!(body.try_clone().is_none());
    assert!(!body.is_capped(), "failed, not capped");
    // A clone made before the failure cannot finish either.
    let e = next_error(&mut early);
    assert_eq!(replay_reason(&e), Reason::Failed);
}

#[test]
fn a_panic_of_the_original_makes_the_body_not_replayable() {
    let body = ReplayBody::new(
        Script::new([Step::Data(Bytes::from_static(b"ab")), Step::Panic]),
        DEFAULT_REPLAY_CAP,
    );
    let mut early = body.try_clone().unwrap();
    let mut first = body.try_clone().unwrap();
    assert_eq!(next_data(&mut first), "ab");
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| poll(&mut first)));
    assert!(panicked.is_err());
    assert!(body.try_clone().is_none());
    assert_eq!(replay_reason(&next_error(&mut early)), Reason::Failed);
}

#[test]
fn trailers_are_replayed() {
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static("0"));
    let body = ReplayBody::new(
        Script::new([
            Step::Data(Bytes::from_static(b"payload")),
            Step::Trailers(trailers.clone()),
        ]),
        DEFAULT_REPLAY_CAP,
    );
    for _ in 0..3 {
        let (data, got) = read_all(&mut body.try_clone().unwrap()).unwrap();
        assert_eq!(concat(&data), b"payload");
        assert_eq!(got.as_ref(), Some(&trailers));
    }
}

#[test]
fn trailers_count_toward_the_cap() {
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static("0"));
    // 7 data bytes + 12 for the trailer's name and value.
    for (cap, replayable) in [(19, true), (18, false)] {
        let body = ReplayBody::new(
            Script::new([
                Step::Data(Bytes::from_static(b"payload")),
                Step::Trailers(trailers.clone()),
            ]),
            cap,
        );
        let (_, got) = read_all(&mut body.try_clone().unwrap()).unwrap();
        assert_eq!(got.as_ref(), Some(&trailers), "streamed either way");
        assert_eq!(body.try_clone().is_some(), replayable, "cap {cap}");
    }
}

#[test]
fn an_empty_body_costs_nothing() {
    let from_full = ReplayBody::new(Full::new(Bytes::new()), DEFAULT_REPLAY_CAP);
    let from_empty = ReplayBody::new(Empty::<Bytes>::new(), 0);
    for body in [&from_full.try_clone().unwrap(), &from_full] {
        assert!(matches!(body.inner, Inner::Empty), "no shared state");
    }
    assert!(matches!(from_empty.inner, Inner::Empty));

    for _ in 0..3 {
        let mut clone = from_empty.try_clone().unwrap();
        assert!(matches!(clone.inner, Inner::Empty));
        assert!(clone.is_end_stream());
        assert_eq!(clone.size_hint().exact(), Some(0));
        assert!(matches!(poll(&mut clone), Poll::Ready(None)));
    }
    assert!(!from_empty.is_capped(), "even with a cap of 0");
    assert_eq!(format!("{from_empty:?}"), "ReplayBody { empty: true }");
}

#[test]
fn a_late_dropped_attempt_is_superseded_by_the_next() {
    let (script, all) = script_of_sizes(&[1, 2, 3, 4, 5]);
    let body = ReplayBody::new(script, DEFAULT_REPLAY_CAP);
    let mut first = body.try_clone().unwrap();
    next_data(&mut first);
    next_data(&mut first);

    // The transport still holds `first` while the next attempt runs and
    // reads past it.
    let mut second = body.try_clone().unwrap();
    for _ in 0..3 {
        next_data(&mut second);
    }

    // `first` may still be polled: it replays what was kept, then cannot
    // read the original on, and says so rather than end.
    assert_eq!(next_data(&mut first).len(), 3);
    assert!(!first.is_end_stream());
    let e = next_error(&mut first);
    assert_eq!(replay_reason(&e), Reason::Superseded);
    assert!(first.is_end_stream());
    assert!(matches!(poll(&mut first), Poll::Ready(None)));

    let (rest, _) = read_all(&mut second).unwrap();
    assert_eq!(concat(&rest), all[6..]);

    // A third attempt still replays everything.
    let (chunks, _) = read_all(&mut body.try_clone().unwrap()).unwrap();
    assert_eq!(concat(&chunks), all);
}

#[test]
fn an_older_clone_replays_what_a_newer_one_read() {
    let (script, all) = script_of_sizes(&[1, 2, 3, 4, 5]);
    let body = ReplayBody::new(script, DEFAULT_REPLAY_CAP);
    // Made in this order, read in the other: the older one may replay
    // all that was kept, but not read the original on.
    let mut older = body.try_clone().unwrap();
    let mut newer = body.try_clone().unwrap();
    next_data(&mut newer);
    next_data(&mut newer);
    assert_eq!(next_data(&mut older).len(), 1);
    assert_eq!(next_data(&mut older).len(), 2);
    assert_eq!(replay_reason(&next_error(&mut older)), Reason::Superseded);
    let (rest, _) = read_all(&mut newer).unwrap();
    assert_eq!(concat(&rest), all[3..]);
}

#[test]
fn an_older_clone_still_alive_at_the_end_replays_the_whole_body() {
    let (script, all) = script_of_sizes(&[1, 2, 3]);
    let body = ReplayBody::new(script, DEFAULT_REPLAY_CAP);
    let mut first = body.try_clone().unwrap();
    next_data(&mut first);
    let mut second = body.try_clone().unwrap();
    assert_eq!(concat(&read_all(&mut second).unwrap().0), all);
    // Everything was kept, so the late one needs nothing of the original.
    assert_eq!(concat(&read_all(&mut first).unwrap().0), all[1..]);
}

#[test]
fn an_early_clone_replays_what_the_attempt_before_it_read() {
    // Like tower's retry, which clones the request before sending it.
    let (script, all) = script_of_sizes(&[5, 6, 7]);
    let body = ReplayBody::new(script, DEFAULT_REPLAY_CAP);
    let mut first = body.try_clone().unwrap();
    let mut second = body.try_clone().unwrap();
    assert_eq!(concat(&read_all(&mut first).unwrap().0), all);
    assert_eq!(concat(&read_all(&mut second).unwrap().0), all);
}

#[derive(Default)]
struct CountWakes(AtomicUsize);

impl Wake for CountWakes {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn a_waiting_clone_is_woken_when_a_newer_one_takes_over() {
    let body = ReplayBody::new(
        Script::new([
            Step::Data(Bytes::from_static(b"a")),
            Step::Pending,
            Step::Data(Bytes::from_static(b"b")),
            Step::Data(Bytes::from_static(b"c")),
        ]),
        DEFAULT_REPLAY_CAP,
    );
    let wakes = Arc::new(CountWakes::default());
    let waker = Waker::from(Arc::clone(&wakes));
    let mut first = body.try_clone().unwrap();
    assert_eq!(next_data(&mut first), "a");
    let polled = Pin::new(&mut first).poll_frame(&mut Context::from_waker(&waker));
    assert!(polled.is_pending());
    assert_eq!(wakes.0.load(Ordering::SeqCst), 0);

    let mut second = body.try_clone().unwrap();
    assert_eq!(next_data(&mut second), "a");
    assert_eq!(
        wakes.0.load(Ordering::SeqCst),
        0,
        "replaying takes nothing over"
    );
    assert_eq!(next_data(&mut second), "b");
    assert_eq!(
        wakes.0.load(Ordering::SeqCst),
        1,
        "the older clone was woken"
    );
    // Woken, it replays what was kept, then may not read the original on.
    assert_eq!(next_data(&mut first), "b");
    assert_eq!(replay_reason(&next_error(&mut first)), Reason::Superseded);
    assert_eq!(next_data(&mut second), "c");
    assert!(matches!(poll(&mut second), Poll::Ready(None)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clones_read_on_two_threads_at_once_never_mix_bodies() {
    let sizes: Vec<usize> = (1..=64).collect();
    for _ in 0..50 {
        let (script, all) = script_of_sizes(&sizes);
        let body = ReplayBody::new(script, DEFAULT_REPLAY_CAP);
        let older = body.try_clone().unwrap();
        let newer = body.try_clone().unwrap();
        let older = tokio::spawn(older.collect());
        let newer = tokio::spawn(newer.collect());
        let newer = newer
            .await
            .unwrap()
            .expect("the newest clone always finishes");
        assert_eq!(newer.to_bytes(), all);
        match older.await.unwrap() {
            Ok(whole) => assert_eq!(whole.to_bytes(), all),
            Err(e) => assert_eq!(replay_reason(&e), Reason::Superseded),
        }
        assert_eq!(
            body.try_clone()
                .unwrap()
                .collect()
                .await
                .unwrap()
                .to_bytes(),
            all
        );
    }
}

#[test]
fn debug_does_not_need_a_debug_body() {
    let body = ReplayBody::new(Script::chunks([vec![1, 2, 3]]), 10);
    let mut clone = body.try_clone().unwrap();
    next_data(&mut clone);
    let shown = format!("{clone:?}");
    assert!(shown.contains("kept_bytes: 3"), "{shown}");
    assert!(shown.contains("capped: false"), "{shown}");
}

proptest! {
    #[test]
    fn replays_exactly_the_body_or_nothing(
        sizes in proptest::collection::vec(0usize..200, 0..30),
        cap in 0usize..3000,
    ) {
        let (script, all) = script_of_sizes(&sizes);
        let body = ReplayBody::new(script, cap);
        let (first, _) = read_all(&mut body.try_clone().unwrap()).unwrap();
        prop_assert_eq!(concat(&first), all.clone());
        if all.len() <= cap {
            prop_assert!(!body.is_capped());
            let mut again = body.try_clone().expect("replayable");
            prop_assert_eq!(again.size_hint().exact(), Some(all.len() as u64));
            prop_assert_eq!(concat(&read_all(&mut again).unwrap().0), all);
        } else {
            prop_assert!(body.is_capped());
            prop_assert!(body.try_clone().is_none());
        }
    }
}

//! Outbound keys derived from the inbound operation's key.

use std::borrow::Cow;
use std::cell::RefCell;
use std::fmt;
use std::future::Future;

use http::HeaderValue;
use uuid::Uuid;

tokio::task_local! {
    /// The key source of the [`derive_keys`] scope the task is in: a tokio
    /// task-local, as the scope must cross the handler's own `.await`s.
    static KEYS: RefCell<KeySource>;
}

/// The namespace of every derived key: UUID v5 of
/// `resend:idempotency:derive_keys` in the URL namespace.
const RESEND_NAMESPACE: Uuid = Uuid::from_u128(0x6393_c5d8_6f18_5e6a_a7ea_edc1_8538_2ad0);

/// What a [`derive_keys`] scope hands down to the task: the inbound
/// operation's scope and key, and how many keys each upstream has been given
/// so far.
struct KeySource {
    scope: Cow<'static, str>,
    key: HeaderValue,
    // Made when the first key is derived.
    derived: Option<Box<Derived>>,
}

/// What deriving keys has needed so far.
struct Derived {
    // Hashed from `scope` and `key`.
    namespace: Uuid,
    // Per upstream: the ordinal of its next key.
    calls: Vec<(Box<str>, u32)>,
}

impl fmt::Debug for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The scope may be made of the caller's credentials: not printed.
        let calls: &[(Box<str>, u32)] = self.derived.as_ref().map_or(&[], |d| &d.calls);
        f.debug_struct("KeySource")
            .field("key", &self.key)
            .field("calls", &calls)
            .finish_non_exhaustive()
    }
}

/// Runs `future` as the handler of an inbound operation keyed `key` within
/// `scope`: unsafe requests sent inside it by an
/// [`SetIdempotencyKeyLayer`](super::SetIdempotencyKeyLayer) that would get a fresh
/// key get one derived from (`scope`, `key`, upstream, ordinal) instead.
///
/// `scope` is the caller's identity (what the server keyed the operation
/// under), `key` the inbound `Idempotency-Key`. The ordinal counts the keys
/// given so far to the same upstream in this scope (0, 1, 2…), so calls to
/// other upstreams in between do not shift it. A run of the same operation
/// that makes the same calls in the same order to each upstream sends the
/// same keys again, and the upstream answers the repeats from what it
/// stored: a re-run after a crash does no work twice downstream. Another
/// scope or another key gives unrelated keys.
///
/// Keys the caller set still win (an [`IdempotencyKey`](super::IdempotencyKey)
/// extension, an `Idempotency-Key` header), [`NoIdempotencyKey`](super::NoIdempotencyKey)
/// still opts out, and neither uses up an ordinal. The scope costs nothing
/// until the first key is derived; the scope and key are hashed once, then.
///
/// A key is `Uuid::new_v5(ns, upstream ++ [0] ++ ordinal as u32 big-endian)`,
/// written hyphenated in lower case, where
/// `ns = Uuid::new_v5(6393c5d8-6f18-5e6a-a7ea-edc185382ad0, scope ++ [0] ++ key)`.
/// The upstream is the layer's [`upstream`](super::SetIdempotencyKeyLayer::upstream)
/// name, or else the request URI's authority (`host:port` as written).
///
/// The scope belongs to the task that awaits the returned future, like a
/// deadline [`scope`](crate::deadline::scope).
///
/// ```
/// use http::{HeaderValue, Request};
/// use tower_resend::idempotency::{derive_keys, SetIdempotencyKeyLayer};
/// use tower::{service_fn, Layer, ServiceExt};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let shipping = SetIdempotencyKeyLayer::new().upstream("shipping").layer(service_fn(
///     |req: Request<()>| async move {
///         Ok::<_, std::convert::Infallible>(req.headers()["idempotency-key"].clone())
///     },
/// ));
///
/// // A keyed handler that makes two calls to shipping.
/// let run = |key: &'static str| {
///     let shipping = shipping.clone();
///     derive_keys("caller-1", HeaderValue::from_static(key), async move {
///         let post = || Request::post("http://shipping/shipments").body(()).unwrap();
///         let a = shipping.clone().oneshot(post()).await.unwrap();
///         let b = shipping.oneshot(post()).await.unwrap();
///         [a, b]
///     })
/// };
///
/// let first = run("order-7").await;
/// assert_ne!(first[0], first[1]);
/// // The same operation run again sends the same keys.
/// assert_eq!(run("order-7").await, first);
/// // Another operation, other keys.
/// let other = run("order-8").await;
/// assert_ne!(other[0], first[0]);
/// assert_ne!(other[1], first[1]);
/// # }
/// ```
pub fn derive_keys<F: Future>(
    scope: impl Into<Cow<'static, str>>,
    key: HeaderValue,
    future: F,
) -> impl Future<Output = F::Output> {
    let source = KeySource {
        scope: scope.into(),
        key,
        derived: None,
    };
    KEYS.scope(RefCell::new(source), future)
}

/// The next key for `upstream` in the current task's [`derive_keys`] scope;
/// `None` outside one.
pub(super) fn derived(upstream: &str) -> Option<Uuid> {
    KEYS.try_with(|source| source.try_borrow_mut().ok()?.next(upstream))
        .ok()
        .flatten()
}

impl KeySource {
    /// The next key for `upstream`, using up its ordinal; `None` once an
    /// upstream has had `u32::MAX` keys.
    fn next(&mut self, upstream: &str) -> Option<Uuid> {
        let (scope, key_value) = (&self.scope, &self.key);
        let derived = self.derived.get_or_insert_with(|| {
            Box::new(Derived {
                namespace: namespace(scope, key_value),
                calls: Vec::new(),
            })
        });
        let ordinal = match derived
            .calls
            .iter_mut()
            .find(|(name, _)| **name == *upstream)
        {
            Some((_, next)) => {
                let ordinal = *next;
                *next = ordinal.checked_add(1)?;
                ordinal
            }
            None => {
                derived.calls.push((upstream.into(), 1));
                0
            }
        };
        Some(key(&derived.namespace, upstream, ordinal))
    }
}

fn namespace(scope: &str, key: &HeaderValue) -> Uuid {
    let mut name = Vec::with_capacity(scope.len() + 1 + key.len());
    name.extend_from_slice(scope.as_bytes());
    name.push(0);
    name.extend_from_slice(key.as_bytes());
    Uuid::new_v5(&RESEND_NAMESPACE, &name)
}

fn key(namespace: &Uuid, upstream: &str, ordinal: u32) -> Uuid {
    let mut name = Vec::with_capacity(upstream.len() + 5);
    name.extend_from_slice(upstream.as_bytes());
    name.push(0);
    name.extend_from_slice(&ordinal.to_be_bytes());
    Uuid::new_v5(namespace, &name)
}

#[cfg(test)]
mod tests {
    use std::task::Poll;

    use super::*;

    #[test]
    fn the_namespace_is_what_its_docs_say() {
        assert_eq!(
            RESEND_NAMESPACE,
            Uuid::new_v5(&Uuid::NAMESPACE_URL, b"resend:idempotency:derive_keys")
        );
        assert_eq!(
            RESEND_NAMESPACE.to_string(),
            "6393c5d8-6f18-5e6a-a7ea-edc185382ad0"
        );
    }

    #[test]
    fn keys_follow_the_formula() {
        let ns = namespace("caller-1", &HeaderValue::from_static("order-7"));
        assert_eq!(ns, Uuid::new_v5(&RESEND_NAMESPACE, b"caller-1\0order-7"));
        assert_eq!(
            key(&ns, "shipping", 0x0102_0304),
            Uuid::new_v5(&ns, b"shipping\0\x01\x02\x03\x04")
        );
        assert_eq!(key(&ns, "shipping", 0).get_version_num(), 5);
        // The separator keeps the parts apart.
        let moved = namespace("caller-1o", &HeaderValue::from_static("rder-7"));
        assert_ne!(ns, moved);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn ordinals_count_per_upstream_and_stop_before_they_wrap() {
        let key = HeaderValue::from_static("k");
        let keys = derive_keys("s", key.clone(), async {
            [
                derived("a"),
                derived("b"),
                derived("a"),
                derived("b"),
                derived("a"),
            ]
        })
        .await;
        let ns = namespace("s", &key);
        let want = |u, n| Some(super::key(&ns, u, n));
        assert_eq!(
            keys,
            [
                want("a", 0),
                want("b", 0),
                want("a", 1),
                want("b", 1),
                want("a", 2)
            ]
        );

        let last = derive_keys("s", key.clone(), async {
            with_source(|s| {
                s.next("c");
                if let Some(d) = s.derived.as_mut() {
                    d.calls.push(("a".into(), u32::MAX - 1));
                }
            });
            [derived("a"), derived("a"), derived("b")]
        })
        .await;
        assert_eq!(last, [want("a", u32::MAX - 1), None, want("b", 0)]);

        assert_eq!(derived("a"), None);
    }

    /// A scope is seen only while its future is polled: two polled in turn
    /// on one task each see their own, a scope inside another hides it for
    /// as long as it runs, a task spawned inside sees none, and a poll that
    /// panics leaves the scope around it in place.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_scope_is_seen_only_while_its_future_is_polled() {
        let ns = |scope: &str, k: &'static str| namespace(scope, &HeaderValue::from_static(k));
        let first = |scope: &str, k: &'static str| Some(key(&ns(scope, k), "u", 0));
        let turn = |scope: &'static str| {
            derive_keys(scope, HeaderValue::from_static("k"), async {
                let a = derived("u");
                tokio::task::yield_now().await;
                (a, derived("u"))
            })
        };
        let (a, b) = tokio::join!(turn("a"), turn("b"));
        let second = |scope| Some(key(&ns(scope, "k"), "u", 1));
        assert_eq!(
            (a, b),
            (
                (first("a", "k"), second("a")),
                (first("b", "k"), second("b"))
            )
        );

        let nested = derive_keys("outer", HeaderValue::from_static("k"), async {
            let inner = derive_keys("inner", HeaderValue::from_static("k"), async {
                derived("u")
            })
            .await;
            let spawned = tokio::spawn(async { derived("u") }).await.unwrap();
            let panicked = std::panic::AssertUnwindSafe(derive_keys(
                "boom",
                HeaderValue::from_static("k"),
                async { panic!("a handler that panics") },
            ));
            let caught = panics(panicked).await;
            (inner, spawned, caught, derived("u"))
        })
        .await;
        assert_eq!(
            nested,
            (first("inner", "k"), None, true, first("outer", "k"))
        );
        assert_eq!(derived("u"), None, "no scope outside");
    }

    /// Runs `f` on the key source of the scope the task is in.
    fn with_source<R>(f: impl FnOnce(&mut KeySource) -> R) -> Option<R> {
        KEYS.try_with(|source| f(&mut source.borrow_mut())).ok()
    }

    /// Polls `fut` to its end, telling whether it panicked.
    async fn panics<F: Future + std::panic::UnwindSafe>(fut: F) -> bool {
        let mut fut = std::pin::pin!(fut);
        std::future::poll_fn(move |cx| {
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| fut.as_mut().poll(cx))) {
                Ok(Poll::Pending) => Poll::Pending,
                Ok(Poll::Ready(_)) => Poll::Ready(false),
                Err(_) => Poll::Ready(true),
            }
        })
        .await
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn nothing_is_hashed_until_a_key_is_derived() {
        let fut = derive_keys("s", HeaderValue::from_static("k"), async {
            let untouched = with_source(|s| s.derived.is_none());
            derived("a");
            let hashed = with_source(|s| s.derived.is_some());
            (untouched, hashed)
        });
        fn spawnable<T: Send + 'static>(_: &T) {}
        spawnable(&fut);
        assert_eq!(fut.await, (Some(true), Some(true)));
        let debug = format!(
            "{:?}",
            KeySource {
                scope: "secret-scope".into(),
                key: HeaderValue::from_static("k"),
                derived: None,
            }
        );
        assert!(
            debug.contains("KeySource { key: \"k\", calls: [], .. }"),
            "{debug}"
        );
        assert!(!debug.contains("secret-scope"), "{debug}");
    }
}

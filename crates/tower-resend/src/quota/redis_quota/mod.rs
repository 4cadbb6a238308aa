//! [`RedisQuota`]: the pacing layer's quotas in Redis, shared by every
//! process that paces its calls to one upstream (feature `quota-redis`).

mod scripts;

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use redis::{Script, ScriptInvocation, Value};
use tokio::time::Instant;

use super::pace::{counts_calls, MAX_QUOTAS};
use super::Reading;

/// The default key prefix of a [`RedisQuota`]: `resend:quota:`.
pub const DEFAULT_QUOTA_PREFIX: &str = "resend:quota:";

/// How long one call to Redis may take, by default: past it, the call is
/// paced by the process's own view.
pub const DEFAULT_REDIS_TIMEOUT: Duration = Duration::from_millis(50);

/// How long, after Redis failed, calls are paced by the process's own view
/// before Redis is asked again, by default.
pub const DEFAULT_RECHECK: Duration = Duration::from_secs(1);

/// Where a [`PaceLayer`](super::PaceLayer) keeps its quotas so that every
/// process calling one upstream shares them (feature `quota-redis`):
/// twenty pods calling one API then spend one quota, together never more.
/// Put it on a layer with [`PaceLayer::shared_in`](super::PaceLayer::shared_in).
///
/// # What is shared
///
/// One Redis hash per quota name, under the key `<prefix>{<name>}`
/// ([prefix](Self::prefix), default [`DEFAULT_QUOTA_PREFIX`]; the braces a
/// Redis Cluster hash tag), with a field per quota the answers stated
/// (policy and partition): what is left, the reset, the window, the pace's
/// next slot. Before each call, one script takes its place atomically (or
/// says how long to wait, or that the quota has no room before the call's
/// deadline); after each answer, another writes what the answer said (in a
/// window already told of, the lowest count and the earliest reset hold).
/// Every time is Redis's clock (`TIME`), so pods whose clocks disagree
/// share one reset. The key expires a window after the last reset it
/// holds: nothing is left behind. On a Redis Cluster
/// ([`cluster`](Self::cluster)), the key's hash tag puts the whole quota on
/// one node, and each script runs there.
///
/// # When Redis fails
///
/// Each call to Redis is bounded by a [timeout](Self::timeout) (50 ms by
/// default): a call never waits longer for Redis. When Redis fails (an
/// error, a refused connection, no answer in time), the call is paced by
/// the process's own view of the quotas (which every answer updates,
/// Redis or not), and so are the calls of the next
/// [second](Self::recheck), without asking Redis; then Redis is asked
/// again. Each call so paced is counted
/// ([`PaceStats::fallbacks`](super::PaceStats::fallbacks)); the outage is
/// a `tracing` warning when it begins, and an info event when it ends.
///
/// ```no_run
/// use tower_resend::quota::{PaceLayer, RedisQuota};
///
/// # async fn demo() -> Result<(), redis::RedisError> {
/// let client = redis::Client::open("redis://127.0.0.1:6379")?;
/// let manager = client.get_connection_manager().await?;
/// let pace = PaceLayer::new().shared_in(RedisQuota::new(manager, "github"));
/// let github = tower_resend::stack().name("github").pace(pace);
/// # let _ = github;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RedisQuota {
    conn: Conn,
    name: Arc<str>,
    prefix: Arc<str>,
    timeout: Duration,
    recheck: Duration,
    state: Arc<State>,
}

/// How a [`RedisQuota`] reaches Redis: the application's connection, a
/// manager or a cluster's.
#[derive(Clone)]
enum Conn {
    Manager(ConnectionManager),
    Cluster(ClusterConnection),
}

/// The scripts, and the outage every clone shares.
struct State {
    take: Script,
    note: Script,
    /// Redis has failed, and has not answered since.
    down: AtomicBool,
    /// Until then, calls do not ask Redis.
    quiet_until: Mutex<Option<Instant>>,
}

impl fmt::Debug for RedisQuota {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisQuota")
            .field("key", &String::from_utf8_lossy(&self.key()))
            .field("timeout", &self.timeout)
            .field("recheck", &self.recheck)
            .field("down", &self.state.down.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// What Redis said of a call's place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Taken {
    /// Its place is taken, this long from now (zero: now).
    Place(Duration),
    /// A quota is spent for this long: ask again then.
    Spent(Duration),
    /// No room before the call's deadline, for this long; nothing taken.
    Refused(Duration),
    /// Redis knows nothing of the quota yet.
    Unknown,
}

impl RedisQuota {
    /// Shares the quotas named `name` (one upstream's: `"github"`) on the
    /// application's connection manager: its settings (reconnection, TLS,
    /// credentials) are the application's. The manager is shared, not
    /// owned: the quota uses clones of it. Layers that pace calls to one
    /// upstream give it the same name; two upstreams, two names.
    pub fn new(manager: ConnectionManager, name: impl Into<Arc<str>>) -> Self {
        Self::with_conn(Conn::Manager(manager), name.into())
    }

    /// Shares the quotas named `name` on the application's Redis Cluster
    /// connection: each script goes to the node that holds the quota's
    /// key (one hash tag, `{<name>}`), redirections and failovers handled
    /// by the connection.
    ///
    /// ```no_run
    /// use redis::cluster::ClusterClient;
    /// use tower_resend::quota::{PaceLayer, RedisQuota};
    ///
    /// # async fn demo() -> Result<(), redis::RedisError> {
    /// let nodes = ["redis://10.0.0.1:6379", "redis://10.0.0.2:6379", "redis://10.0.0.3:6379"];
    /// let conn = ClusterClient::new(nodes)?.get_async_connection().await?;
    /// let pace = PaceLayer::new().shared_in(RedisQuota::cluster(conn, "github"));
    /// # let _ = pace;
    /// # Ok(())
    /// # }
    /// ```
    pub fn cluster(conn: ClusterConnection, name: impl Into<Arc<str>>) -> Self {
        Self::with_conn(Conn::Cluster(conn), name.into())
    }

    fn with_conn(conn: Conn, name: Arc<str>) -> Self {
        Self {
            conn,
            name,
            prefix: DEFAULT_QUOTA_PREFIX.into(),
            timeout: DEFAULT_REDIS_TIMEOUT,
            recheck: DEFAULT_RECHECK,
            state: Arc::new(State {
                take: Script::new(scripts::TAKE),
                note: Script::new(scripts::NOTE),
                down: AtomicBool::new(false),
                quiet_until: Mutex::new(None),
            }),
        }
    }

    /// Prefixes the key with `prefix`. Default [`DEFAULT_QUOTA_PREFIX`].
    /// Keep `{` and `}` out of it and out of the name: the braces around
    /// the name are a Redis Cluster hash tag.
    #[must_use]
    pub fn prefix(mut self, prefix: impl Into<Arc<str>>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How long one call to Redis may take: past it, the call is paced by
    /// the process's own view. Default [`DEFAULT_REDIS_TIMEOUT`] (50 ms).
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How long, after Redis failed, calls are paced by the process's own
    /// view without asking Redis. Default [`DEFAULT_RECHECK`] (1 s).
    #[must_use]
    pub fn recheck(mut self, after: Duration) -> Self {
        self.recheck = after;
        self
    }

    /// The quota's Redis key: `<prefix>{<name>}`.
    fn key(&self) -> Vec<u8> {
        let mut k = Vec::with_capacity(self.prefix.len() + self.name.len() + 2);
        k.extend_from_slice(self.prefix.as_bytes());
        k.push(b'{');
        k.extend_from_slice(self.name.as_bytes());
        k.push(b'}');
        k
    }

    /// Whether a call at `now` asks Redis: not while an outage is quiet.
    pub(crate) fn asks(&self, now: Instant) -> bool {
        let quiet = self
            .state
            .quiet_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        quiet.is_none_or(|until| now >= until)
    }

    /// Takes a call's place, with `time_left` of its deadline, `burst`
    /// calls beyond the pace, a wait leaving at least `min_left`. `None`
    /// when Redis failed (the outage then begins, or goes on).
    pub(crate) async fn take(
        &self,
        time_left: Option<Duration>,
        burst: u32,
        min_left: Duration,
    ) -> Option<Taken> {
        let mut call = self.state.take.key(self.key());
        call.arg(burst)
            .arg(time_left.map_or(-1, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX)))
            .arg(millis_up(min_left));
        let answer = self.invoke(&call).await?;
        let taken = match answer {
            Value::Array(v) => match v.as_slice() {
                [Value::Int(kind), Value::Int(ms)] => {
                    let d = Duration::from_millis(u64::try_from(*ms).unwrap_or(0));
                    match kind {
                        0 => Some(Taken::Place(d)),
                        1 => Some(Taken::Spent(d)),
                        2 => Some(Taken::Refused(d)),
                        3 => Some(Taken::Unknown),
                        _ => None,
                    }
                }
                _ => None,
            },
            _ => None,
        };
        if taken.is_none() {
            self.failed(&"an answer the take script never gives");
        }
        taken
    }

    /// Writes what an answer to a call sent at `sent` said, while
    /// `pending` calls of this process are out; values past `cap` held to
    /// it. In a task of its own, so that the answer is not held back.
    pub(crate) fn note(&self, reading: &Reading, sent: Instant, pending: u64, cap: Duration) {
        if reading.quotas.is_empty() && reading.retry_after.is_none() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let head = [
            pending.to_string(),
            reading
                .retry_after
                .map_or(-1, |d| millis_up(d.min(cap)))
                .to_string(),
            MAX_QUOTAS.to_string(),
        ];
        let mut args = Vec::with_capacity(6 * reading.quotas.len().min(MAX_QUOTAS));
        for q in reading.quotas.iter().take(MAX_QUOTAS) {
            args.push(field(&q.policy, q.partition.as_deref()));
            args.push(u8::from(counts_calls(q.form, &q.policy)).to_string());
            args.push(q.remaining.to_string());
            args.push(millis_up(q.reset.min(cap)).to_string());
            args.push(
                q.limit
                    .map_or(-1, |l| i64::try_from(l).unwrap_or(i64::MAX))
                    .to_string(),
            );
            args.push(q.window.map_or(-1, |w| millis_up(w.min(cap))).to_string());
        }
        let this = self.clone();
        runtime.spawn(async move {
            let mut call = this.state.note.key(this.key());
            // How long ago the call went, as the script runs (rounded up:
            // never later than it went).
            let age = millis_up(Instant::now().saturating_duration_since(sent));
            call.arg(&head).arg(age).arg(args);
            let _ = this.invoke(&call).await;
        });
    }

    /// Runs one script call within the timeout; `None` (and the outage
    /// told) when it failed.
    async fn invoke(&self, call: &ScriptInvocation<'_>) -> Option<Value> {
        let run = async {
            match self.conn.clone() {
                Conn::Manager(mut c) => call.invoke_async::<Value>(&mut c).await,
                Conn::Cluster(mut c) => call.invoke_async::<Value>(&mut c).await,
            }
        };
        match tokio::time::timeout(self.timeout, run).await {
            Ok(Ok(value)) => {
                if self.state.down.swap(false, Ordering::AcqRel) {
                    tracing::info!(
                        resend.quota.name = &*self.name,
                        "Redis answers again: the quota is shared again",
                    );
                }
                Some(value)
            }
            Ok(Err(e)) => {
                self.failed(&e);
                None
            }
            Err(_) => {
                self.failed(&format_args!("no answer within {:?}", self.timeout));
                None
            }
        }
    }

    /// Redis failed: calls are paced by the process's own view for a
    /// while; said once per outage.
    fn failed(&self, error: &dyn fmt::Display) {
        let until = Instant::now() + self.recheck;
        *self
            .state
            .quiet_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(until);
        if !self.state.down.swap(true, Ordering::AcqRel) {
            tracing::warn!(
                resend.quota.name = &*self.name,
                error = %error,
                "Redis failed: calls paced by this process's own view of the quota until it answers",
            );
        }
    }
}

/// A quota's field in the hash: its policy's length, the policy, and its
/// partition key in hex (so that no two quotas read alike).
fn field(policy: &str, partition: Option<&[u8]>) -> String {
    use std::fmt::Write as _;
    let mut f = format!("{}:{policy}:", policy.len());
    if let Some(p) = partition {
        for b in p {
            let _ = write!(f, "{b:02x}");
        }
    }
    f
}

/// Milliseconds, rounded up (a reset never early), at most `i64::MAX`.
fn millis_up(d: Duration) -> i64 {
    i64::try_from(d.as_nanos().div_ceil(1_000_000)).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_keep_policies_and_partitions_apart() {
        assert_eq!(field("default", None), "7:default:");
        assert_eq!(field("a", Some(b"\x01\xff")), "1:a:01ff");
        assert_ne!(field("a:1", None), field("a", Some(b"1")));
    }

    /// The note script leaves out an answer that may tell of the window
    /// before the one Redis holds (the rule of `pace.rs`, in Lua): a
    /// window of 2 s, rolled past its reset 50 ms ago; an answer to a call
    /// sent 100 ms before that reset, stating `t=1`, changes nothing; one
    /// stating `t=2` (the new window's) is taken.
    #[tokio::test(flavor = "current_thread")]
    async fn an_answer_of_the_window_before_is_left_out() {
        let mut conn = connect().await;
        let key = format!("resend-test:quota-stale:{}:{{q}}", std::process::id());
        let (secs, micros): (i64, i64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
        let now = secs * 1000 + micros / 1000;
        // Rolled past its reset (`now - 50`): whole, assumed, until one
        // window on.
        let (reset, field) = (now - 50, field("default", None));
        let state = format!("20 {} 2000 20 20 2000 {} 1 1", reset + 2000, reset);
        let _: () = redis::cmd("HSET")
            .arg(&key)
            .arg(&field)
            .arg(&state)
            .query_async(&mut conn)
            .await
            .unwrap();
        let _: () = redis::cmd("PEXPIRE")
            .arg(&key)
            .arg(10_000)
            .query_async(&mut conn)
            .await
            .unwrap();
        let note = Script::new(scripts::NOTE);
        // pending, Retry-After, most quotas, age; field, calls, left,
        // reset, size, window.
        let answer = |left: i64, reset_ms: i64| {
            let mut call = note.key(&key);
            call.arg(0).arg(-1).arg(MAX_QUOTAS).arg(150);
            call.arg(&field)
                .arg(1)
                .arg(left)
                .arg(reset_ms)
                .arg(20)
                .arg(2000);
            call
        };
        // What the field holds after an answer.
        let note_then_read = |left, reset_ms| {
            let mut conn = conn.clone();
            let (call, key, field) = (answer(left, reset_ms), key.clone(), field.clone());
            async move {
                let _: Value = call.invoke_async(&mut conn).await.unwrap();
                let held: String = redis::cmd("HGET")
                    .arg(&key)
                    .arg(&field)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                held
            }
        };
        let after = note_then_read(0, 1000).await;
        assert_eq!(
            after, state,
            "an answer of the window before changed nothing"
        );
        let after = note_then_read(17, 2000).await;
        assert!(
            after.starts_with("17 "),
            "the new window's answer is taken: {after}"
        );
        let _: () = redis::cmd("DEL")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .unwrap();
    }

    /// Calls that go before any answer is noted (Redis knows nothing yet)
    /// are counted, whichever process sent them, and the first answer's
    /// count does not know of those still out: ten went, the first answer
    /// (from a process with four of them still out) says 19 are left, and
    /// the quota holds 10 (19 less the nine others), not 15.
    #[tokio::test(flavor = "current_thread")]
    async fn calls_that_went_before_any_answer_count_against_the_first() {
        let mut conn = connect().await;
        let key = format!("resend-test:quota-blind:{}:{{q}}", std::process::id());
        let take = Script::new(scripts::TAKE);
        for _ in 0..10 {
            let mut call = take.key(&key);
            call.arg(0).arg(-1).arg(50);
            let answer: Vec<i64> = call.invoke_async(&mut conn).await.unwrap();
            assert_eq!(answer, [3, 0], "Redis knows nothing of the quota yet");
        }
        let note = Script::new(scripts::NOTE);
        let mut call = note.key(&key);
        call.arg(4).arg(-1).arg(MAX_QUOTAS).arg(5);
        call.arg(field("default", None))
            .arg(1)
            .arg(19)
            .arg(2000)
            .arg(20)
            .arg(2000);
        let _: Value = call.invoke_async(&mut conn).await.unwrap();
        let all: Vec<String> = redis::cmd("HGETALL")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(all.len(), 2, "the count of blind calls is spent: {all:?}");
        assert!(all[1].starts_with("10 "), "{all:?}");
        let _: () = redis::cmd("DEL")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .unwrap();
    }

    /// A connection to this machine's Redis (`RESEND_REDIS_URL`, default
    /// `redis://127.0.0.1:6379`): the test fails without it.
    async fn connect() -> redis::aio::MultiplexedConnection {
        let url =
            std::env::var("RESEND_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        let client = redis::Client::open(url.as_str()).expect("a Redis URL");
        let connect = client.get_multiplexed_async_connection();
        tokio::time::timeout(Duration::from_secs(3), connect)
            .await
            .unwrap_or_else(|_| panic!("Redis at {url} is needed by this test: no answer"))
            .unwrap_or_else(|e| panic!("Redis at {url} is needed by this test: {e}"))
    }

    #[test]
    fn milliseconds_round_up() {
        assert_eq!(millis_up(Duration::from_micros(1)), 1);
        assert_eq!(millis_up(Duration::from_millis(5)), 5);
        assert_eq!(millis_up(Duration::MAX), i64::MAX);
    }
}

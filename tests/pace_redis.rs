//! Pacing with its quotas shared through Redis (`RedisQuota`), on loopback.
//!
//! Two stacks, each with a `PaceLayer` of its own (no memory shared: two
//! processes, as far as pacing goes), call one upstream whose quota is 20
//! calls per 2 s window, stated in the IETF fields, 429 beyond it; 10
//! callers each, for 6 s. Sharing one Redis key, they never meet a 429;
//! beside them, the same two stacks without Redis do. These run on the
//! real clock: the scripts read Redis's clock (every process shares it, as
//! pods whose clocks disagree must), and on tokio's paused clock a reply
//! from another process (Redis) is raced by the clock's jumps to the next
//! timer (the 50 ms timeout), so the shared state would be measured
//! against a clock Redis does not follow. They need the Redis of this
//! machine (`RESEND_REDIS_URL`, default `redis://127.0.0.1:6379`) and fail
//! without it; each run uses a key prefix of its own.
//!
//! And the same with two processes: the test binary runs itself twice; and
//! with the two stacks on a Redis Cluster this binary starts.
//! (`redis-server` and `redis-cli` are needed for the cluster: without
//! them its test says so and passes, unless `CI` is set.)
//!
//! With Redis down (a port nothing listens on; a listener that accepts and
//! never answers), on the paused clock: calls still go, paced by each
//! process's own view, each held at most the quota's timeout, and counted
//! as fallbacks.
#![allow(clippy::print_stderr, clippy::print_stdout)] // a test reports; its child process speaks to its parent on stdout

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio::time::Instant;
use tower::ServiceExt;
use tower_resend::quota::{PaceLayer, RedisQuota};

#[allow(dead_code)] // each test binary uses part of the shared helpers
mod common;
#[allow(dead_code)] // each test binary uses part of the pacing helpers
mod pace_upstream;
/// The server crate's three-node Redis Cluster on loopback, started once
/// per test binary and stopped with it.
#[path = "../crates/tower-resend-server/tests/support/redis_cluster.rs"]
mod redis_cluster;

use pace_upstream::{load, upstream, Announce, Seen, Served};

/// The Redis of this machine.
fn url() -> String {
    std::env::var("RESEND_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// A key prefix no other run shares.
fn prefix() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    format!("resend-test:pace:{}:{nanos}:", std::process::id())
}

/// A connection manager on the Redis of this machine: the test fails if
/// it does not answer within 3 s.
async fn manager() -> ConnectionManager {
    let url = url();
    let connect = async {
        let client = redis::Client::open(url.as_str()).expect("a Redis URL");
        client.get_connection_manager().await
    };
    match tokio::time::timeout(Duration::from_secs(3), connect).await {
        Ok(Ok(manager)) => manager,
        Ok(Err(e)) => panic!("Redis at {url} is needed by this test: {e}"),
        Err(_) => panic!("Redis at {url} is needed by this test: no answer within 3 s"),
    }
}

mod shared {
    use super::*;

    const QUOTA: u64 = 20;
    const WINDOW: Duration = Duration::from_secs(2);
    const RUN: Duration = Duration::from_secs(6);
    /// Callers per stack.
    const CALLERS: usize = 10;

    /// What the upstream served, and what each stack's callers saw.
    struct Run {
        log: Vec<(Duration, u16)>,
        seen: [Seen; 2],
        fallbacks: [u64; 2],
    }

    impl Run {
        fn too_many(&self) -> usize {
            self.log.iter().filter(|(_, s)| *s == 429).count()
        }

        /// The 200s of each window.
        fn per_window(&self) -> Vec<u64> {
            let mut per = vec![0; (RUN.as_secs() / WINDOW.as_secs() + 2) as usize];
            for (at, status) in &self.log {
                let k = (at.as_nanos() / WINDOW.as_nanos()) as usize;
                if *status == 200 {
                    if let Some(n) = per.get_mut(k) {
                        *n += 1;
                    }
                }
            }
            per
        }
    }

    /// Two stacks, each with a pacing layer of its own, sharing `quota`
    /// or each with its own view alone, 10 callers each for the run.
    async fn two_stacks(quota: Option<RedisQuota>) -> Run {
        let served = Arc::new(Mutex::new(Served::default()));
        let server = upstream(Announce::Ietf, QUOTA, WINDOW, Arc::clone(&served)).await;
        let uri = server.uri("/");
        let in_redis = quota.is_some();
        let pace = || match &quota {
            Some(q) => PaceLayer::new().shared_in(q.clone()),
            None => PaceLayer::new(),
        };
        let (a, b) = (pace(), pace());
        let stack_a = common::stack().pace(a.clone()).service(common::transport());
        let stack_b = common::stack().pace(b.clone()).service(common::transport());
        let (seen_a, seen_b) = tokio::join!(
            load(stack_a, uri.clone(), CALLERS, RUN),
            load(stack_b, uri, CALLERS, RUN),
        );
        let log = std::mem::take(&mut served.lock().unwrap().log);
        let run = Run {
            log,
            seen: [seen_a, seen_b],
            fallbacks: [a.stats().fallbacks, b.stats().fallbacks],
        };
        eprintln!(
            "in Redis: {in_redis}: 200s per window {:?}, 429s {}, callers saw {:?}, fallbacks {:?}",
            run.per_window(),
            run.too_many(),
            run.seen,
            run.fallbacks,
        );
        run
    }

    #[tokio::test(flavor = "current_thread")]
    async fn two_stacks_sharing_one_quota_in_redis_never_meet_a_429() {
        let (manager, prefix) = (manager().await, prefix());
        let quota = RedisQuota::new(manager.clone(), "upstream").prefix(prefix.as_str());
        let shared = two_stacks(Some(quota)).await;
        // The key expires by itself, a window after the reset it holds.
        let key = format!("{prefix}{{upstream}}");
        let ttl: i64 = redis::cmd("PTTL")
            .arg(&key)
            .query_async(&mut manager.clone())
            .await
            .expect("PTTL");
        assert!(
            ttl > 0 && ttl <= 2 * WINDOW.as_millis() as i64 + 1000,
            "{key}: {ttl} ms"
        );
        assert_eq!(shared.too_many(), 0);
        assert!(shared.per_window().iter().all(|n| *n <= QUOTA));
        assert_eq!(shared.fallbacks, [0, 0], "Redis answered every call");
        assert!(shared.seen.iter().all(|s| s.failed == 0));
        // Most of the quota is used: the three windows of the run, less the
        // first answers' rounding (whole seconds, rounded up).
        let ok: usize = shared.seen.iter().map(|s| s.ok).sum();
        let quota_in_run = (RUN.as_secs() / WINDOW.as_secs() * QUOTA) as usize;
        assert!(ok * 100 >= quota_in_run * 60, "{ok} of {quota_in_run}");

        // The same two stacks, each with its own view alone: together
        // they spend more than the quota.
        let alone = two_stacks(None).await;
        assert!(alone.too_many() > 0, "{:?}", alone.per_window());
    }

    /// The same two stacks sharing the quota on a Redis Cluster (three
    /// nodes this test binary starts on loopback, the server crate's
    /// harness): 0 answers 429, and the quota is one key on one node.
    #[tokio::test(flavor = "current_thread")]
    async fn two_stacks_sharing_one_quota_on_a_redis_cluster_never_meet_a_429() {
        let Some(cluster) = redis_cluster::cluster() else {
            return;
        };
        let prefix = prefix();
        let conn = cluster.connection().await;
        let quota = RedisQuota::cluster(conn, "upstream").prefix(prefix.as_str());
        let run = two_stacks(Some(quota)).await;
        assert_eq!(run.too_many(), 0, "{:?}", run.per_window());
        assert!(run.per_window().iter().all(|n| *n <= QUOTA));
        assert_eq!(run.fallbacks, [0, 0], "the cluster answered every call");
        let ok: usize = run.seen.iter().map(|s| s.ok).sum();
        let quota_in_run = (RUN.as_secs() / WINDOW.as_secs() * QUOTA) as usize;
        assert!(ok * 100 >= quota_in_run * 60, "{ok} of {quota_in_run}");
        let keys: Vec<Vec<String>> = cluster
            .ports()
            .iter()
            .map(|port| cluster.keys_on(*port, &prefix))
            .collect();
        assert_eq!(keys.iter().map(Vec::len).sum::<usize>(), 1, "{keys:?}");
    }
}

/// Two processes, not two stacks in one: this test binary starts itself
/// twice (its `child` test, with the upstream's address and a key prefix
/// in its environment), each child running 5 callers for the run through
/// its own stack, sharing the quota through Redis; the parent serves the
/// upstream and counts what it answered.
mod processes {
    use std::process::{Child, Command, Stdio};

    use super::*;

    const QUOTA: u64 = 20;
    const WINDOW: Duration = Duration::from_secs(2);
    const RUN: Duration = Duration::from_secs(6);
    /// Callers per process: together fewer than the quota, so that their
    /// first calls (which go before any answer has told the quota, and
    /// may start in different windows, as processes start when they do)
    /// cannot spend more than a window holds by themselves.
    const CALLERS: usize = 5;
    const URI: &str = "RESEND_PACE_CHILD_URI";
    const PREFIX: &str = "RESEND_PACE_CHILD_PREFIX";

    fn start(uri: &http::Uri, prefix: &str) -> Child {
        Command::new(std::env::current_exe().expect("this test binary"))
            .args(["--exact", "processes::child", "--ignored", "--nocapture"])
            .env(URI, uri.to_string())
            .env(PREFIX, prefix)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("a child process")
    }

    /// Waits for `child` (polling, so the upstream keeps serving), killing
    /// it (by its own handle: only a process this test started) if it
    /// outlives `limit`; its standard output.
    async fn finish(mut child: Child, limit: Duration) -> String {
        let start = Instant::now();
        loop {
            match child.try_wait().expect("the child's status") {
                Some(status) => {
                    let mut out = String::new();
                    if let Some(mut stdout) = child.stdout.take() {
                        std::io::Read::read_to_string(&mut stdout, &mut out).expect("its output");
                    }
                    assert!(status.success(), "the child failed: {out}");
                    return out;
                }
                None if start.elapsed() > limit => {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!("a child outlived {limit:?}");
                }
                None => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn two_processes_sharing_one_quota_in_redis_never_meet_a_429() {
        let served = Arc::new(Mutex::new(Served::default()));
        let server = upstream(Announce::Ietf, QUOTA, WINDOW, Arc::clone(&served)).await;
        let (uri, prefix) = (server.uri("/"), prefix());
        let children = [start(&uri, &prefix), start(&uri, &prefix)];
        let limit = RUN + Duration::from_secs(30);
        let [a, b] = children;
        let (out_a, out_b) = tokio::join!(finish(a, limit), finish(b, limit));
        let log = std::mem::take(&mut served.lock().unwrap().log);
        let too_many = log.iter().filter(|(_, s)| *s == 429).count();
        let mut per_window = vec![0u64; (RUN.as_secs() / WINDOW.as_secs() + 2) as usize];
        for (at, status) in &log {
            if *status == 200 {
                if let Some(n) = per_window.get_mut((at.as_nanos() / WINDOW.as_nanos()) as usize) {
                    *n += 1;
                }
            }
        }
        eprintln!(
            "two processes: 200s per window {per_window:?}, 429s {too_many}; {out_a} {out_b}"
        );
        let shown: Vec<String> = log
            .iter()
            .map(|(at, s)| format!("{}:{s}", at.as_millis()))
            .collect();
        assert_eq!(too_many, 0, "{per_window:?}: {}", shown.join(" "));
        assert!(per_window.iter().all(|n| *n <= QUOTA), "{per_window:?}");
        for out in [&out_a, &out_b] {
            assert!(out.contains("child: ok="), "{out}");
            assert!(
                out.contains("fallbacks=0"),
                "Redis answered every call: {out}"
            );
        }
        let ok = log.iter().filter(|(_, s)| *s == 200).count();
        let quota_in_run = (RUN.as_secs() / WINDOW.as_secs() * QUOTA) as usize;
        assert!(ok * 100 >= quota_in_run * 60, "{ok} of {quota_in_run}");
    }

    /// One of the two processes: run by the test above, with its
    /// environment; fails on its own.
    #[tokio::test(flavor = "current_thread")]
    #[ignore = "a child process of two_processes_sharing_one_quota_in_redis_never_meet_a_429"]
    async fn child() {
        let uri: http::Uri = std::env::var(URI)
            .expect("run by its parent test, which gives the upstream's address")
            .parse()
            .expect("a URI");
        let prefix = std::env::var(PREFIX).expect("and a key prefix");
        let pace = PaceLayer::new()
            .shared_in(RedisQuota::new(manager().await, "upstream").prefix(prefix.as_str()));
        let stack = common::stack()
            .pace(pace.clone())
            .service(common::transport());
        let seen = load(stack, uri, CALLERS, RUN).await;
        assert_eq!(seen.failed, 0, "{seen:?}");
        println!(
            "child: ok={} refused={} fallbacks={}",
            seen.ok,
            seen.refused,
            pace.stats().fallbacks
        );
    }
}

mod down {
    use super::*;

    const QUOTA: u64 = 100;
    const WINDOW: Duration = Duration::from_secs(10);
    const TIMEOUT: Duration = Duration::from_millis(50);
    const RECHECK: Duration = Duration::from_secs(1);

    /// A connection manager on `127.0.0.1:port`, made without connecting.
    fn lazy_manager(port: u16) -> ConnectionManager {
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).expect("a Redis URL");
        let config = ConnectionManagerConfig::new()
            .set_number_of_retries(0)
            .set_connection_timeout(Some(Duration::from_millis(100)));
        ConnectionManager::new_lazy_with_config(client, config).expect("a lazy manager")
    }

    /// A port where a listener accepts connections and never answers.
    async fn hanging_port() -> u16 {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let port = listener.local_addr().expect("local address").port();
        // (Dropped with the test's runtime.)
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                held.push(socket);
            }
        });
        port
    }

    fn pace(port: u16) -> PaceLayer {
        let quota = RedisQuota::new(lazy_manager(port), "upstream")
            .prefix(prefix())
            .timeout(TIMEOUT)
            .recheck(RECHECK);
        PaceLayer::new().shared_in(quota)
    }

    /// One call: how long it took.
    async fn one_call<S, RB>(stack: &S, uri: &http::Uri) -> Duration
    where
        S: tower::Service<
                http::Request<http_body_util::Full<bytes::Bytes>>,
                Response = http::Response<RB>,
                Error = tower_resend::Error,
            > + Clone,
    {
        let start = Instant::now();
        stack
            .clone()
            .oneshot(common::get(uri.clone()))
            .await
            .expect("the call goes, Redis or not");
        start.elapsed()
    }

    /// Each call waits at most the timeout for Redis, then goes; the calls
    /// of the quiet time after do not ask; then Redis is asked again.
    /// Then 20 callers for 30 s: no 429, paced by the process's own view,
    /// every call a fallback.
    async fn calls_go_paced_by_their_own_view(port: u16) {
        let served = Arc::new(Mutex::new(Served::default()));
        let server = upstream(Announce::Ietf, QUOTA, WINDOW, Arc::clone(&served)).await;
        let uri = server.uri("/");
        let pace = pace(port);
        let stack = common::stack()
            .pace(pace.clone())
            .service(common::transport());

        let first = one_call(&stack, &uri).await;
        assert!(first <= TIMEOUT, "{first:?}");
        assert_eq!(pace.stats().fallbacks, 1);
        let quiet = one_call(&stack, &uri).await;
        assert_eq!(quiet, Duration::ZERO, "not asked in the quiet time");
        assert_eq!(pace.stats().fallbacks, 2);
        tokio::time::sleep(RECHECK).await;
        let again = one_call(&stack, &uri).await;
        assert!(again <= TIMEOUT, "{again:?}");
        assert_eq!(pace.stats().fallbacks, 3);

        let run = Duration::from_secs(30);
        let seen = load(stack, uri, 20, run).await;
        let log = std::mem::take(&mut served.lock().unwrap().log);
        let too_many = log.iter().filter(|(_, s)| *s == 429).count();
        let stats = pace.stats();
        eprintln!(
            "Redis down (port {port}): served {}, 429s {too_many}, callers saw {seen:?}, fallbacks {}, waits {}",
            log.len(),
            stats.fallbacks,
            stats.waits,
        );
        assert_eq!(too_many, 0);
        assert_eq!(seen.failed, 0);
        // Every call, the three first with them, paced by the local view
        // (a call that waited for a reset is decided again after it).
        let calls = (seen.ok + seen.refused + 3) as u64;
        assert!(stats.fallbacks >= calls, "{} of {calls}", stats.fallbacks);
        assert!(stats.fallbacks <= calls + stats.waits, "{stats:?}");
        // Paced, not sent at once: the quota's three windows used, no more.
        let quota_in_run = (run.as_secs() / WINDOW.as_secs() * QUOTA) as usize;
        assert!(seen.ok * 100 >= quota_in_run * 90, "{seen:?}");
        assert!(stats.waits > 0);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn redis_refusing_connections_calls_go_paced_by_their_own_view() {
        common::within(calls_go_paced_by_their_own_view(common::closed_port())).await;
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn redis_never_answering_calls_go_paced_by_their_own_view() {
        let port = hanging_port().await;
        common::within(calls_go_paced_by_their_own_view(port)).await;
    }
}

//! A three-node Redis Cluster on loopback, started by the tests, one per
//! test binary.
//!
//! Three `redis-server` children on free ports (cluster mode, no
//! persistence, their files in a temporary directory of their own), joined
//! by `redis-cli --cluster create` (three primaries, no replicas), ready once
//! every node says `cluster_state:ok`.
//!
//! The cluster lives in a static, which is never dropped: so that the
//! servers end with the test binary however it ends (normally, on a panic,
//! or killed), a small watchdog `sh`, started with them, waits on a pipe
//! from this process; when the pipe closes (this process is gone) it stops
//! the three servers it was given (by the ids of the children started here)
//! and removes the directory. A setup that fails part way kills what it
//! started at once (the guard's `Drop`).
//!
//! Without `redis-server` or `redis-cli`: `None`, with a warning, or a panic
//! when `CI` is set.
#![allow(dead_code, unreachable_pub, clippy::print_stderr)]

use std::io;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use tokio::time::Instant;

/// How long the cluster may take to form.
const READY_BOUND: Duration = Duration::from_secs(20);

/// A running cluster: its nodes' ports.
#[derive(Debug)]
pub struct Cluster {
    ports: [u16; 3],
    _guard: Mutex<Guard>,
}

impl Cluster {
    /// The nodes' ports.
    pub fn ports(&self) -> [u16; 3] {
        self.ports
    }

    /// The nodes' URLs, `redis://127.0.0.1:PORT`.
    pub fn urls(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect()
    }

    /// A blocking connection to one node (not the cluster: no redirections
    /// followed), for looking at what that node holds.
    pub fn node(&self, port: u16) -> redis::Connection {
        redis::Client::open(format!("redis://127.0.0.1:{port}"))
            .unwrap()
            .get_connection_with_timeout(Duration::from_secs(2))
            .unwrap()
    }

    /// The keys that the node on `port` holds under `prefix` (`SCAN` on
    /// the node itself).
    pub fn keys_on(&self, port: u16, prefix: &str) -> Vec<String> {
        let mut node = self.node(port);
        let (mut keys, mut cursor) = (Vec::new(), 0u64);
        loop {
            let (next, found): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{prefix}*"))
                .arg("COUNT")
                .arg(1000)
                .query(&mut node)
                .unwrap();
            keys.extend(found);
            if next == 0 {
                return keys;
            }
            cursor = next;
        }
    }

    /// A cluster connection, on the runtime of the caller (every test has
    /// one of its own).
    pub async fn connection(&self) -> redis::cluster_async::ClusterConnection {
        redis::cluster::ClusterClient::new(self.urls())
            .unwrap()
            .get_async_connection()
            .await
            .unwrap()
    }
}

/// The binary's cluster, started by the first test that asks for it.
/// `None` when there is no Redis to start (and `CI` is not set); a panic
/// in every test that asks, when it did not start.
pub fn cluster() -> Option<&'static Cluster> {
    /// What the first attempt gave: tried once per binary.
    static CLUSTER: OnceLock<Result<Option<Cluster>, String>> = OnceLock::new();
    let cluster = CLUSTER.get_or_init(|| {
        for tool in ["redis-server", "redis-cli"] {
            if !installed(tool) {
                if std::env::var_os("CI").is_some() {
                    return Err(format!("{tool} is not installed, and CI is set"));
                }
                eprintln!("WARNING: {tool} is not installed: Redis Cluster test SKIPPED");
                return Ok(None);
            }
        }
        let started = Instant::now();
        let cluster = start().map_err(|e| format!("Redis Cluster did not start: {e}"))?;
        eprintln!(
            "redis cluster: 3 nodes on 127.0.0.1:{:?}, ready in {:.1?}",
            cluster.ports,
            started.elapsed()
        );
        Ok(Some(cluster))
    });
    match cluster {
        Ok(cluster) => cluster.as_ref(),
        Err(e) => panic!("{e}"),
    }
}

fn installed(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// What this harness started: the servers, the watchdog and the directory.
/// Dropped (setup failed part way), it ends them all.
#[derive(Debug)]
struct Guard {
    dir: PathBuf,
    servers: Vec<Child>,
    watchdog: Option<(Child, ChildStdin)>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        for child in &mut self.servers {
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some((mut child, stdin)) = self.watchdog.take() {
            // Closing the pipe lets the watchdog end too (with nothing left
            // to stop).
            drop(stdin);
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Three distinct free ports `p` whose cluster bus port `p + 10000` is free
/// too, found by binding `127.0.0.1:0` (the listeners held until all three
/// are found).
fn free_ports() -> io::Result<[u16; 3]> {
    let mut held = Vec::new();
    let mut ports = Vec::new();
    for _ in 0..500 {
        let l = TcpListener::bind("127.0.0.1:0")?;
        let port = l.local_addr()?.port();
        let Some(bus) = port.checked_add(10000) else {
            continue;
        };
        let Ok(b) = TcpListener::bind(("127.0.0.1", bus)) else {
            continue;
        };
        held.push((l, b));
        ports.push(port);
        if ports.len() == 3 {
            return Ok([ports[0], ports[1], ports[2]]);
        }
    }
    Err(io::Error::other("no three free port pairs on 127.0.0.1"))
}

fn start() -> Result<Cluster, String> {
    let dir = std::env::temp_dir().join(format!(
        "resend-redis-cluster-{}-{}",
        std::process::id(),
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut guard = Guard {
        dir: dir.clone(),
        servers: Vec::new(),
        watchdog: None,
    };
    let ports = free_ports().map_err(|e| e.to_string())?;
    for port in ports {
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--cluster-enabled", "yes"])
            .arg("--cluster-config-file")
            .arg(dir.join(format!("nodes-{port}.conf")))
            .arg("--dir")
            .arg(&dir)
            .arg("--logfile")
            .arg(dir.join(format!("redis-{port}.log")))
            .args(["--save", ""])
            .args(["--appendonly", "no"])
            .args(["--cluster-node-timeout", "2000"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("redis-server: {e}"))?;
        guard.servers.push(child);
    }
    guard.watchdog = Some(watchdog(&guard)?);
    let deadline = Instant::now() + READY_BOUND;
    for port in ports {
        wait_for(deadline, &mut guard, port, |node| {
            redis::cmd("PING").query::<String>(node).ok().as_deref() == Some("PONG")
        })?;
    }
    let create = Command::new("redis-cli")
        .args(["--cluster", "create"])
        .args(ports.map(|p| format!("127.0.0.1:{p}")))
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("redis-cli: {e}"))?;
    if !create.status.success() {
        return Err(format!(
            "redis-cli --cluster create: {}: {}{}",
            create.status,
            String::from_utf8_lossy(&create.stdout),
            String::from_utf8_lossy(&create.stderr)
        ));
    }
    for port in ports {
        wait_for(deadline, &mut guard, port, |node| {
            redis::cmd("CLUSTER")
                .arg("INFO")
                .query::<String>(node)
                .is_ok_and(|info| info.lines().any(|l| l.trim() == "cluster_state:ok"))
        })?;
    }
    Ok(Cluster {
        ports,
        _guard: Mutex::new(guard),
    })
}

/// The watchdog: `sh`, reading a pipe from this process; at its end (this
/// process is gone), it stops the servers started here and removes their
/// directory.
fn watchdog(guard: &Guard) -> Result<(Child, ChildStdin), String> {
    let pids: Vec<String> = guard.servers.iter().map(|c| c.id().to_string()).collect();
    let script = r#"read _ignored; kill -TERM "$@" 2>/dev/null; sleep 0.5; kill -KILL "$@" 2>/dev/null; rm -rf "$DIR""#;
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(script)
        .arg("resend-redis-cluster-watchdog")
        .args(&pids)
        .env("DIR", &guard.dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("sh (the watchdog): {e}"))?;
    let stdin = child
        .stdin
        .take()
        .ok_or_else(|| "the watchdog has no stdin".to_owned())?;
    Ok((child, stdin))
}

/// Polls `node` on `port` until `ready` says so, or the deadline passes, or
/// a server exited (its log then tells why).
fn wait_for(
    deadline: Instant,
    guard: &mut Guard,
    port: u16,
    ready: impl Fn(&mut redis::Connection) -> bool,
) -> Result<(), String> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}"))
        .map_err(|e| format!("127.0.0.1:{port}: {e}"))?;
    loop {
        if let Ok(mut node) = client.get_connection_with_timeout(Duration::from_millis(500)) {
            if ready(&mut node) {
                return Ok(());
            }
        }
        if let Some(why) = exited(guard) {
            return Err(why);
        }
        if Instant::now() > deadline {
            return Err(format!(
                "127.0.0.1:{port} not ready within {READY_BOUND:?}: {}",
                log_of(&guard.dir, Some(port))
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Which server exited, and the end of its log, if one did.
fn exited(guard: &mut Guard) -> Option<String> {
    let dir = guard.dir.clone();
    guard.servers.iter_mut().find_map(|c| {
        let status = c.try_wait().ok()??;
        Some(format!(
            "a redis-server exited ({status}): {}",
            log_of(&dir, None)
        ))
    })
}

/// The last lines of the log of the server on `port` (or of every server).
fn log_of(dir: &Path, port: Option<u16>) -> String {
    let mut out = String::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let wanted = match port {
            Some(p) => name == format!("redis-{p}.log"),
            None => name.starts_with("redis-") && name.ends_with(".log"),
        };
        if !wanted {
            continue;
        }
        let log = std::fs::read_to_string(entry.path()).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        out.push_str(&format!("[{name}] "));
        out.push_str(&lines[lines.len().saturating_sub(5)..].join(" | "));
        out.push(' ');
    }
    out
}

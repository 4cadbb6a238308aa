//! A server in a child process, for the tests that kill one: this test
//! binary run again with `--ignored --exact <entry>`, told what to do by
//! environment variables. The child says `LISTENING <port>` on stdout once
//! bound; the test waits for that and for any other line the scenario
//! needs (every line is forwarded to stderr), and kills it by its own
//! handle: never a process it did not start.
#![allow(dead_code, unreachable_pub, clippy::print_stdout, clippy::print_stderr)]

use std::io::Write as _;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::mpsc;
use tokio::time::{sleep, timeout};

/// The crash scenarios' timings. The killed server's lease: short, so a
/// killed holder is replaced soon.
pub const A_LEASE: Duration = Duration::from_secs(1);
/// The most a whole scenario may take.
pub const SCENARIO: Duration = Duration::from_secs(15);
/// How long the caller keeps retrying while the dead holder's lease is
/// still there.
pub const RETRY_FOR: Duration = Duration::from_secs(6);
/// The most one wait for a line from a child may take.
pub const LINE_WAIT: Duration = Duration::from_secs(5);
/// The longest a child lives, if nobody kills it and its stdin stays open.
pub const CHILD_LIFE: Duration = Duration::from_secs(60);

/// A child process running a server; killed when dropped, so a failing
/// test leaves nothing behind.
pub struct ChildServer {
    name: &'static str,
    child: Child,
    // Held open: the child exits when it closes.
    _stdin: ChildStdin,
    lines: mpsc::UnboundedReceiver<String>,
    pub port: u16,
}

impl ChildServer {
    /// Runs the ignored test `entry` of this binary as a child with `envs`,
    /// and waits until it listens.
    pub async fn start(name: &'static str, entry: &str, envs: &[(&str, String)]) -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--ignored",
                "--exact",
                entry,
                "--nocapture",
                "--test-threads=1",
            ])
            .envs(envs.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("start the child process");
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        // Every line of the child's stdout: forwarded to stderr, and handed
        // to the test.
        let (tx, lines) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut stdout = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = stdout.next_line().await {
                eprintln!("[{name}] {line}");
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let mut server = Self {
            name,
            child,
            _stdin: stdin,
            lines,
            port: 0,
        };
        let line = server.wait_for("LISTENING ").await;
        server.port = line.trim().parse().expect("LISTENING <port>");
        server
    }

    /// Waits (bounded) for a stdout line containing `marker`, and gives
    /// what follows it.
    pub async fn wait_for(&mut self, marker: &str) -> String {
        let name = self.name;
        let found = async {
            while let Some(line) = self.lines.recv().await {
                // libtest may print on the same line before the marker.
                if let Some(at) = line.find(marker) {
                    return line[at + marker.len()..].to_owned();
                }
            }
            panic!("{name} ended its stdout without saying {marker:?}");
        };
        timeout(LINE_WAIT, found)
            .await
            .unwrap_or_else(|_| panic!("{name} did not say {marker:?} within {LINE_WAIT:?}"))
    }

    /// Kills the process (SIGKILL: no shutdown of any kind) and reaps it.
    pub async fn kill(mut self) {
        let name = self.name;
        timeout(LINE_WAIT, self.child.kill())
            .await
            .unwrap_or_else(|_| panic!("{name}'s process did not die in time"))
            .unwrap_or_else(|e| panic!("kill {name}'s process: {e}"));
    }
}

impl Drop for ChildServer {
    fn drop(&mut self) {
        // Only the child this test started; a no-op once it is reaped.
        if self.child.start_kill().is_err() {
            return;
        }
        // Reaped here (it dies at once), so that a test that fails, and
        // exits, leaves no zombie behind either.
        for _ in 0..100 {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// In the child: exits when the test's end of stdin closes, or at the
/// latest after [`CHILD_LIFE`], so that it never outlives the test.
pub fn exit_with_the_test(name: &'static str) {
    std::thread::spawn(|| {
        let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
        std::process::exit(0);
    });
    tokio::spawn(async move {
        sleep(CHILD_LIFE).await;
        eprintln!("{name}: still alive after {CHILD_LIFE:?}: exiting");
        std::process::exit(1);
    });
}

/// True if `key` is an Idempotency-Key derived from an inbound one (a UUID
/// v5), as a keyed handler's outbound calls carry.
pub fn is_derived(key: &str) -> bool {
    uuid::Uuid::parse_str(key).is_ok_and(|k| k.get_version_num() == 5)
}

/// In the child: one line to the test, on stdout, flushed. Written to the
/// file itself, so it reaches the test whatever libtest captures.
pub fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").unwrap();
    out.flush().unwrap();
}

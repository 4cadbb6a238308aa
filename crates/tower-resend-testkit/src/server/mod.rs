//! The server: [`TestServer`] and its [`Builder`]; what it shares with its
//! tasks is in `state`, how it serves connections and requests in `serve`.

use std::fmt;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use http::Uri;
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::AbortHandle;

use crate::arrival::Arrival;
use crate::script::Script;

mod serve;
mod state;

use serve::{accept_loop, until_shutdown, Exec};
use state::{Record, Shared};

/// The default cap on a request body: 16 MiB.
pub const DEFAULT_BODY_LIMIT: usize = 16 * 1024 * 1024;

/// Which protocols the server speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Protocols {
    Both,
    Http1,
    Http2,
}

/// Configures and starts a [`TestServer`].
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> std::io::Result<()> {
/// use tower_resend_testkit::{Reply, Script, TestServer};
///
/// let server = TestServer::builder()
///     .script(Script::new().then(Reply::status(503)))
///     .http1_only()
///     .start()
///     .await?;
/// # drop(server);
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
#[must_use = "a Builder does nothing until start() is awaited"]
pub struct Builder {
    script: Script,
    protocols: Protocols,
    body_limit: usize,
}

impl Default for Builder {
    fn default() -> Builder {
        Builder {
            script: Script::new(),
            protocols: Protocols::Both,
            body_limit: DEFAULT_BODY_LIMIT,
        }
    }
}

impl Builder {
    /// The script requests follow (default: [`Script::new`], every request
    /// gets `200 OK`).
    pub fn script(mut self, script: Script) -> Builder {
        self.script = script;
        self
    }

    /// Speak only HTTP/1.1 (and 1.0). By default the server speaks HTTP/1.1
    /// and HTTP/2 with prior knowledge (h2c) on the same port.
    pub fn http1_only(mut self) -> Builder {
        self.protocols = Protocols::Http1;
        self
    }

    /// Speak only HTTP/2 with prior knowledge (h2c).
    pub fn http2_only(mut self) -> Builder {
        self.protocols = Protocols::Http2;
        self
    }

    /// The largest request body the server reads, in bytes (default
    /// [`DEFAULT_BODY_LIMIT`]). A larger request is recorded and answered
    /// `413 Payload Too Large` without consulting the script.
    pub fn body_limit(mut self, bytes: usize) -> Builder {
        self.body_limit = bytes;
        self
    }

    /// Binds `127.0.0.1:0` and starts serving on the current tokio runtime.
    ///
    /// # Panics
    ///
    /// If called outside a tokio runtime.
    pub async fn start(self) -> io::Result<TestServer> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        let (shutdown_tx, shutdown) = watch::channel(());

        let mut http = auto::Builder::new(Exec {
            shutdown: shutdown.clone(),
        });
        match self.protocols {
            Protocols::Both => {}
            Protocols::Http1 => http = http.http1_only(),
            Protocols::Http2 => http = http.http2_only(),
        }

        let shared = Arc::new(Shared {
            plan: self.script.compile(),
            record: Mutex::new(Record::default()),
            connections: AtomicUsize::new(0),
            body_limit: self.body_limit,
            shutdown: shutdown.clone(),
        });
        let accept = tokio::spawn(until_shutdown(
            shutdown,
            accept_loop(listener, Arc::new(http), shared.clone()),
        ))
        .abort_handle();

        Ok(TestServer {
            addr,
            shared,
            accept,
            _shutdown: shutdown_tx,
        })
    }
}

/// A scripted, fault-injecting HTTP/1.1 and HTTP/2 server on `127.0.0.1`.
///
/// Start it with [`TestServer::start`] or [`TestServer::builder`]; point a
/// client at [`uri`](TestServer::uri); then assert on what arrived
/// ([`arrivals`](TestServer::arrivals)) and what work was done
/// ([`effects`](TestServer::effects)).
///
/// Dropping it shuts it down: the listener closes and every connection and
/// request task ends (at its next poll), so hung requests do not outlive it.
pub struct TestServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: AbortHandle,
    /// Dropping it tells every task to end.
    _shutdown: watch::Sender<()>,
}

impl fmt::Debug for TestServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let record = self.shared.record();
        f.debug_struct("TestServer")
            .field("addr", &self.addr)
            .field("arrivals", &record.arrival_count)
            .field("effects", &record.total_effects)
            .field("connections", &self.connections())
            .finish_non_exhaustive()
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        // Dropping `_shutdown` right after ends every other task.
        self.accept.abort();
    }
}

impl TestServer {
    /// A [`Builder`] with the default settings.
    pub fn builder() -> Builder {
        Builder::default()
    }

    /// Starts a server following `script` (same as
    /// `TestServer::builder().script(script).start()`).
    ///
    /// # Panics
    ///
    /// If called outside a tokio runtime.
    pub async fn start(script: Script) -> io::Result<TestServer> {
        TestServer::builder().script(script).start().await
    }

    /// The address the server listens on (`127.0.0.1:<port>`).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:<port>` followed by `path_and_query` (a leading `/`
    /// is added if missing).
    ///
    /// # Panics
    ///
    /// If `path_and_query` does not make a valid URI.
    #[track_caller]
    pub fn uri(&self, path_and_query: &str) -> Uri {
        let slash = if path_and_query.starts_with('/') {
            ""
        } else {
            "/"
        };
        let uri = format!("http://{}{slash}{path_and_query}", self.addr);
        match uri.parse() {
            Ok(uri) => uri,
            Err(error) => panic!("TestServer::uri: {uri:?} is not a valid URI: {error}"),
        }
    }

    /// A snapshot of the recorded arrivals, in arrival order.
    pub fn arrivals(&self) -> Vec<Arrival> {
        self.shared.record().arrivals.clone()
    }

    /// Takes the recorded arrivals out, leaving none recorded.
    ///
    /// Counters ([`arrival_count`](TestServer::arrival_count),
    /// [`Arrival::attempt`], effects) are not reset. Long-running benchmarks
    /// can call this now and then to bound memory.
    pub fn take_arrivals(&self) -> Vec<Arrival> {
        std::mem::take(&mut self.shared.record().arrivals)
    }

    /// How many requests have arrived so far (including any taken out with
    /// [`take_arrivals`](TestServer::take_arrivals)).
    pub fn arrival_count(&self) -> usize {
        self.shared.record().arrival_count
    }

    /// How many effects were recorded for requests with this idempotency key
    /// (`None`: for requests without one).
    pub fn effects(&self, key: Option<&str>) -> usize {
        let record = self.shared.record();
        match key {
            None => record.keyless_effects,
            Some(key) => record.keyed_effects.get(key).copied().unwrap_or(0),
        }
    }

    /// How many effects were recorded in all.
    pub fn total_effects(&self) -> usize {
        self.shared.record().total_effects
    }

    /// How many TCP connections the server has accepted so far.
    pub fn connections(&self) -> usize {
        self.shared.connections.load(Ordering::Relaxed)
    }
}

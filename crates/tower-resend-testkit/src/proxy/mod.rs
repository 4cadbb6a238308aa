//! A fault-injecting TCP proxy on loopback: [`FaultProxy`].
//!
//! The proxy listens on `127.0.0.1` (port chosen by the OS) and relays every
//! connection it accepts to a target address. A *plan* picks a [`Fault`] for
//! each connection from its 0-based index, so a test can say "the first
//! connection loses its answer, the rest pass". [`FaultProxy::down`] simulates
//! the target dying (every open connection is reset, every new one is reset
//! as soon as it is accepted) and [`FaultProxy::up`] brings it back: put a
//! Redis or PostgreSQL server behind the proxy to take a store away and give
//! it back.
//!
//! The proxy knows nothing of the protocol it carries: a fault applies to a
//! TCP connection, not to a request. [`Fault::Delay`] and the
//! `DropResponse*` faults act on the first bytes the target sends on the
//! connection; a client that keeps its connections alive needs a fresh
//! connection (a later index in the plan) for the next fault.
//!
//! ```
//! use tower_resend_testkit::proxy::{Fault, FaultProxy};
//! use tokio::io::{AsyncReadExt, AsyncWriteExt};
//! use tokio::net::{TcpListener, TcpStream};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> std::io::Result<()> {
//! // A tiny echo server.
//! let listener = TcpListener::bind("127.0.0.1:0").await?;
//! let echo = listener.local_addr()?;
//! tokio::spawn(async move {
//!     while let Ok((mut stream, _)) = listener.accept().await {
//!         tokio::spawn(async move {
//!             let (mut from, mut to) = stream.split();
//!             let _ = tokio::io::copy(&mut from, &mut to).await;
//!         });
//!     }
//! });
//!
//! // The first connection loses the echo's answer; the others pass.
//! let proxy = FaultProxy::start(echo, |index| match index {
//!     0 => Fault::DropResponseFin,
//!     _ => Fault::Pass,
//! })
//! .await?;
//!
//! let mut first = TcpStream::connect(proxy.addr()).await?;
//! first.write_all(b"ping").await?;
//! let mut answer = Vec::new();
//! first.read_to_end(&mut answer).await?; // EOF, no answer
//! assert!(answer.is_empty());
//!
//! let mut second = TcpStream::connect(proxy.addr()).await?;
//! second.write_all(b"ping").await?;
//! let mut answer = [0; 4];
//! second.read_exact(&mut answer).await?;
//! assert_eq!(&answer, b"ping");
//!
//! assert_eq!(proxy.connections(), 2);
//! # Ok(())
//! # }
//! ```
//!
//! # Resets and ends of stream
//!
//! The proxy *resets* a connection by setting `SO_LINGER` to zero and closing
//! it (a `RST`): the peer's next read or write fails with
//! [`io::ErrorKind::ConnectionReset`] (`ECONNRESET`), and data still in flight
//! is lost. Linux reports the reset once, to whichever call comes first; reads
//! after that one see the end of the stream. It *closes* a connection
//! by shutting down its writing side (a `FIN`): the peer reads the end of the
//! stream (`Ok(0)`). When one side of a [`Fault::Pass`] connection ends its
//! stream, the proxy ends the other one the same way; when one side resets or
//! fails, the proxy resets both.
//!
//! # Time
//!
//! Waiting ([`Fault::Delay`], [`Fault::CutAfter`]) uses `tokio::time`, so the
//! proxy works on tokio's paused clock as well as on a multi-thread runtime.
//! The proxy sets `TCP_NODELAY` on both of its sockets; set it on the client
//! too (see the crate docs).

use std::fmt;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::AbortHandle;

mod power;
mod relay;

pub use relay::Fault;

use power::{Power, Stop};
use relay::{reset, serve};

/// The plan: which [`Fault`] for the connection with this index.
type PlanFn = Box<dyn Fn(u64) -> Fault + Send + Sync>;

/// State shared by the handle and the accept loop.
struct Shared {
    target: SocketAddr,
    plan: PlanFn,
    connections: AtomicU64,
    refused: AtomicU64,
    power: watch::Sender<Power>,
}

/// A fault-injecting TCP proxy on `127.0.0.1` in front of one target address.
///
/// See the [module docs](self) for an example. Dropping the proxy shuts it
/// down: the listener closes and every proxied connection is reset (at its
/// task's next poll), so no task outlives it.
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: AbortHandle,
    /// Dropping it tells every connection task to end.
    _shutdown: watch::Sender<()>,
}

impl fmt::Debug for FaultProxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultProxy")
            .field("addr", &self.addr)
            .field("target", &self.shared.target)
            .field("connections", &self.connections())
            .field("refused", &self.refused())
            .field("down", &self.is_down())
            .finish_non_exhaustive()
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        // Dropping `_shutdown` right after ends every connection task.
        self.accept.abort();
    }
}

impl FaultProxy {
    /// Binds `127.0.0.1:0` and proxies every connection to `target`, with the
    /// fault `plan` returns for the connection's 0-based index (in accepting
    /// order).
    ///
    /// The plan runs on the accept loop and is not asked about connections
    /// refused while the proxy is [down](FaultProxy::down); their indices are
    /// skipped. A plan that panics stops the proxy from accepting.
    ///
    /// # Panics
    ///
    /// If called outside a tokio runtime.
    pub async fn start(
        target: SocketAddr,
        plan: impl Fn(u64) -> Fault + Send + Sync + 'static,
    ) -> io::Result<FaultProxy> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        let (shutdown_tx, shutdown) = watch::channel(());
        let (power, _) = watch::channel(Power {
            down: false,
            generation: 0,
        });
        let shared = Arc::new(Shared {
            target,
            plan: Box::new(plan),
            connections: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            power,
        });
        let accept = tokio::spawn(accept_loop(listener, shared.clone(), shutdown)).abort_handle();
        Ok(FaultProxy {
            addr,
            shared,
            accept,
            _shutdown: shutdown_tx,
        })
    }

    /// Starts a proxy that passes every connection untouched ([`Fault::Pass`]),
    /// to be taken [`down`](FaultProxy::down) and [`up`](FaultProxy::up).
    ///
    /// # Panics
    ///
    /// If called outside a tokio runtime.
    pub async fn pass(target: SocketAddr) -> io::Result<FaultProxy> {
        FaultProxy::start(target, |_| Fault::Pass).await
    }

    /// The address the proxy listens on (`127.0.0.1:<port>`): point clients
    /// here.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The address the proxy relays to.
    pub fn target(&self) -> SocketAddr {
        self.shared.target
    }

    /// How many connections the proxy has accepted so far, including those it
    /// [refused](FaultProxy::refused) while down.
    pub fn connections(&self) -> u64 {
        self.shared.connections.load(Ordering::Relaxed)
    }

    /// How many of the accepted connections were reset at once because the
    /// proxy was [down](FaultProxy::down).
    pub fn refused(&self) -> u64 {
        self.shared.refused.load(Ordering::Relaxed)
    }

    /// Simulates the target dying: resets every open proxied connection, and
    /// from now on resets every new connection as soon as it is accepted,
    /// until [`up`](FaultProxy::up). A client's connection attempt succeeds,
    /// then its first read or write fails with
    /// [`io::ErrorKind::ConnectionReset`]; if the reset arrives before tokio
    /// has seen the connection complete, `TcpStream::connect` itself fails
    /// with it.
    ///
    /// Open connections are reset by their tasks, which wake for it at once;
    /// from the moment this returns, no byte either side sends is relayed.
    pub fn down(&self) {
        self.shared.power.send_if_modified(|power| {
            if power.down {
                return false;
            }
            power.down = true;
            power.generation += 1;
            true
        });
    }

    /// Brings the target back: new connections are proxied again, following
    /// the plan. Connections reset by [`down`](FaultProxy::down) stay reset.
    pub fn up(&self) {
        self.shared.power.send_if_modified(|power| {
            let was_down = power.down;
            power.down = false;
            was_down
        });
    }

    /// Whether the proxy is [down](FaultProxy::down).
    pub fn is_down(&self) -> bool {
        self.shared.power.borrow().down
    }
}

/// Accepts connections until the proxy is dropped.
async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    mut shutdown: watch::Receiver<()>,
) {
    loop {
        let accepted = tokio::select! {
            biased;
            _ = shutdown.changed() => return,
            accepted = listener.accept() => accepted,
        };
        let client = match accepted {
            Ok((client, _)) => client,
            Err(error) => {
                // Out of file descriptors and the like: back off a little.
                tracing::debug!(%error, "tower-resend-testkit: proxy accept failed");
                tokio::time::sleep(Duration::from_millis(1)).await;
                continue;
            }
        };
        let index = shared.connections.fetch_add(1, Ordering::Relaxed);
        // Subscribe before looking, so that a `down()` from now on is seen.
        let mut power = shared.power.subscribe();
        let now = *power.borrow_and_update();
        if now.down {
            shared.refused.fetch_add(1, Ordering::Relaxed);
            reset(client);
            continue;
        }
        let fault = (shared.plan)(index);
        let stop = Stop {
            shutdown: shutdown.clone(),
            power,
            generation: now.generation,
        };
        tokio::spawn(serve(client, shared.target, fault, stop));
    }
}

#[cfg(test)]
mod tests;

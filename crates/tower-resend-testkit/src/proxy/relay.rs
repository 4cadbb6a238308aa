//! One proxied connection: the [`Fault`] it gets, and the relay that
//! connects to the target, copies bytes both ways, applies the fault and ends
//! both sides (a `FIN` or a reset).

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{ReadHalf, WriteHalf};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

use super::power::{Down, Gate, Stop};

/// The size of each of the two relay buffers of a connection.
const BUFFER_SIZE: usize = 16 * 1024;

/// What the proxy does to one connection.
///
/// A [`FaultProxy`](crate::FaultProxy)'s plan picks one for every connection
/// it accepts.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// Relay both ways untouched, for as long as the connection lasts (a
    /// keep-alive connection keeps passing).
    Pass,
    /// Relay the client's bytes to the target; when the target's first bytes
    /// arrive, discard them and close the client's side with a `FIN`. The
    /// client reads the end of the stream with no answer, although the target
    /// got the request: "did the server act on it?".
    ///
    /// The target's side is reset. If the target closes without sending
    /// anything, that end of stream is relayed as under [`Fault::Pass`].
    DropResponseFin,
    /// Like [`Fault::DropResponseFin`], but reset the client's side: the
    /// client's next read fails with [`io::ErrorKind::ConnectionReset`].
    DropResponseRst,
    /// Hold the target's first bytes for this long before relaying them and
    /// everything after them. The client's bytes pass at once.
    Delay(Duration),
    /// Relay both ways, and once the client has sent its first bytes, wait
    /// this long, then reset both sides whatever the target is doing: a
    /// connection cut while the handler runs. A connection that both sides
    /// have closed by then is not touched.
    CutAfter(Duration),
}

/// How the relay of a connection ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    /// Both sides ended their streams, and each end was relayed: close both.
    Done,
    /// The client's side was closed with a `FIN`: reset the target's side and
    /// read the client's side until it closes too.
    Fin,
    /// Reset both sides.
    Reset,
}

impl From<Down> for End {
    fn from(_: Down) -> End {
        End::Reset
    }
}

/// Serves one accepted connection.
pub(super) async fn serve(client: TcpStream, target: SocketAddr, fault: Fault, mut stop: Stop) {
    nodelay(&client);
    let connected = tokio::select! {
        biased;
        () = stop.stopped() => None,
        connected = TcpStream::connect(target) => match connected {
            Ok(upstream) => Some(upstream),
            Err(error) => {
                tracing::debug!(%error, %target, "tower-resend-testkit: proxy could not reach its target");
                None
            }
        },
    };
    let Some(mut upstream) = connected else {
        reset(client);
        return;
    };
    nodelay(&upstream);

    let mut client = client;
    let gate = stop.gate();
    let end = tokio::select! {
        biased;
        () = stop.stopped() => End::Reset,
        end = relay(&mut client, &mut upstream, &fault, &gate) => end,
    };
    match end {
        End::Done => {}
        End::Reset => {
            reset(client);
            reset(upstream);
        }
        End::Fin => {
            reset(upstream);
            let drained = tokio::select! {
                biased;
                () = stop.stopped() => false,
                drained = drain(&mut client) => drained,
            };
            if !drained {
                reset(client);
            }
        }
    }
}

/// Relays between `client` and `upstream` following `fault`.
async fn relay(
    client: &mut TcpStream,
    upstream: &mut TcpStream,
    fault: &Fault,
    gate: &Gate,
) -> End {
    let (mut from_client, mut to_client) = client.split();
    let (mut from_upstream, mut to_upstream) = upstream.split();
    let (sent, first_sent) = oneshot::channel();

    let both = async {
        let requests = relay_requests(&mut from_client, &mut to_upstream, gate, sent);
        let answers = relay_answers(&mut from_upstream, &mut to_client, gate, fault);
        match tokio::try_join!(requests, answers) {
            Ok(((), ())) => End::Done,
            Err(end) => end,
        }
    };
    let cut = async {
        if let Fault::CutAfter(after) = fault {
            if first_sent.await.is_ok() {
                tokio::time::sleep(*after).await;
                return;
            }
        }
        std::future::pending::<()>().await;
    };

    tokio::select! {
        biased;
        end = both => end,
        () = cut => End::Reset,
    }
}

/// Relays the client's bytes to the target, reporting the first ones on
/// `sent`.
async fn relay_requests(
    from: &mut ReadHalf<'_>,
    to: &mut WriteHalf<'_>,
    gate: &Gate,
    sent: oneshot::Sender<()>,
) -> Result<(), End> {
    let mut buffer = vec![0; BUFFER_SIZE];
    let n = read(from, &mut buffer).await?;
    if n == 0 {
        return finish(to, gate).await;
    }
    // Nobody listens unless the fault is `CutAfter`.
    let _ = sent.send(());
    write(to, &buffer[..n], gate).await?;
    copy(from, to, &mut buffer, gate).await
}

/// Relays the target's bytes to the client, applying `fault` to the first
/// ones.
async fn relay_answers(
    from: &mut ReadHalf<'_>,
    to: &mut WriteHalf<'_>,
    gate: &Gate,
    fault: &Fault,
) -> Result<(), End> {
    let mut buffer = vec![0; BUFFER_SIZE];
    match fault {
        Fault::Pass | Fault::CutAfter(_) => {}
        Fault::Delay(delay) => {
            let n = read(from, &mut buffer).await?;
            if n == 0 {
                return finish(to, gate).await;
            }
            tokio::time::sleep(*delay).await;
            write(to, &buffer[..n], gate).await?;
        }
        Fault::DropResponseFin | Fault::DropResponseRst => {
            let n = read(from, &mut buffer).await?;
            if n == 0 {
                return finish(to, gate).await;
            }
            gate.check()?;
            if let Fault::DropResponseRst = fault {
                return Err(End::Reset);
            }
            to.shutdown().await.map_err(broken)?;
            return Err(End::Fin);
        }
    }
    copy(from, to, &mut buffer, gate).await
}

/// Copies `from` to `to` until `from` ends, then ends `to`.
async fn copy(
    from: &mut ReadHalf<'_>,
    to: &mut WriteHalf<'_>,
    buffer: &mut [u8],
    gate: &Gate,
) -> Result<(), End> {
    loop {
        let n = read(from, buffer).await?;
        if n == 0 {
            return finish(to, gate).await;
        }
        write(to, &buffer[..n], gate).await?;
    }
}

async fn read(from: &mut ReadHalf<'_>, buffer: &mut [u8]) -> Result<usize, End> {
    from.read(buffer).await.map_err(broken)
}

async fn write(to: &mut WriteHalf<'_>, bytes: &[u8], gate: &Gate) -> Result<(), End> {
    gate.check()?;
    to.write_all(bytes).await.map_err(broken)
}

/// Relays an end of stream: shuts `to` down for writing (a `FIN`).
async fn finish(to: &mut WriteHalf<'_>, gate: &Gate) -> Result<(), End> {
    gate.check()?;
    to.shutdown().await.map_err(broken)
}

fn broken(error: io::Error) -> End {
    tracing::debug!(%error, "tower-resend-testkit: proxied connection failed");
    End::Reset
}

/// Reads and discards what the client sends until it closes its side: `true`
/// if it did, `false` if its side failed.
async fn drain(client: &mut TcpStream) -> bool {
    let mut buffer = [0; 1024];
    loop {
        match client.read(&mut buffer).await {
            Ok(0) => return true,
            Ok(_) => {}
            Err(_) => return false,
        }
    }
}

fn nodelay(stream: &TcpStream) {
    if let Err(error) = stream.set_nodelay(true) {
        tracing::debug!(%error, "tower-resend-testkit: proxy set_nodelay failed");
    }
}

/// Closes `stream` with a reset (`RST`) instead of a `FIN`.
pub(super) fn reset(stream: TcpStream) {
    if let Err(error) = stream.set_zero_linger() {
        tracing::debug!(%error, "tower-resend-testkit: proxy set_zero_linger failed");
    }
    drop(stream);
}

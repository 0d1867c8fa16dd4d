//! The control API's connections: accepted one by one on the API's own thread, each served
//! by hyper with bounds that keep a hostile client's cost to the job small, and that keep
//! the operator's way in open whatever other clients do.
//!
//! - at most [`MAX_CONNECTIONS`] open at once for anyone: further ones wait in the
//!   kernel's backlog, so the job's own files (sinks, checkpoints) never run out of
//!   descriptors;
//! - [`RESERVED_CONNECTIONS`] more, taken only when those are all held, serve only calls
//!   with the token and health checks (anything else: 503, closed at once), one request
//!   each and a short wait for it: clients that hold every ordinary slot (keep-alive
//!   pollers, pipelined requests never read) cannot keep the operator's savepoint or a
//!   probe out, and none keeps a reserved one;
//! - one peer (an IP address) holds at most [`PEER_SHARE`] of the ordinary connections;
//!   its further ones wait up to [`HEADER_TIMEOUT`] for a reserved one (at most
//!   [`WAITING_CONNECTIONS`] wait at once, further ones are closed): a client that opens
//!   connections from one address leaves the other addresses' clients three quarters of
//!   the slots, and the operator the reserve;
//! - a request's headers must arrive within [`HEADER_TIMEOUT`] of the connection's
//!   start or of the previous response (an idle or half-sent request is closed then);
//! - an answer that the client does not read for [`WRITE_TIMEOUT`] closes the connection
//!   (a client that pipelines requests and never reads holds no slot for long);
//! - at most [`MAX_HEADER_BYTES`] of headers.
//!
//! What a request may do is [`super::guard`]'s.

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Connections served at once for anyone.
pub const MAX_CONNECTIONS: usize = 256;

/// Connections beyond those, for calls with the token and health checks only.
pub const RESERVED_CONNECTIONS: usize = 16;

/// Ordinary connections one peer (IP address) holds at most.
pub const PEER_SHARE: usize = MAX_CONNECTIONS / 4;

/// Connections of peers past their share waiting for a reserved one, at most.
pub const WAITING_CONNECTIONS: usize = 64;

/// How long a request's headers may take to arrive (and a kept-alive connection may sit
/// idle).
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// The same on a reserved connection: its caller is a script or a probe that sends its
/// request at once.
pub const RESERVED_HEADER_TIMEOUT: Duration = Duration::from_secs(1);

/// How long an answer may wait for the client to read it.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// The largest request head (line and headers) read.
pub const MAX_HEADER_BYTES: usize = 16 << 10;

/// Which slot a connection holds (an extension of each of its requests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    Ordinary,
    /// One of the [`RESERVED_CONNECTIONS`]: token holders and health checks only.
    Reserved,
}

/// Serve `app` on `listener` until the process ends.
pub async fn run(listener: tokio::net::TcpListener, app: Router) {
    let ordinary = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let reserved = Arc::new(tokio::sync::Semaphore::new(RESERVED_CONNECTIONS));
    let waiting = Arc::new(tokio::sync::Semaphore::new(WAITING_CONNECTIONS));
    let peers = Arc::new(Peers::default());
    loop {
        // An ordinary slot when one is free, else a reserved one, else the first to free.
        let (permit, slot) = match ordinary.clone().try_acquire_owned() {
            Ok(p) => (p, Slot::Ordinary),
            Err(_) => match reserved.clone().try_acquire_owned() {
                Ok(p) => (p, Slot::Reserved),
                Err(_) => tokio::select! {
                    p = ordinary.clone().acquire_owned() => match p { Ok(p) => (p, Slot::Ordinary), Err(_) => return },
                    p = reserved.clone().acquire_owned() => match p { Ok(p) => (p, Slot::Reserved), Err(_) => return },
                },
            },
        };
        let (stream, peer) = match listener.accept().await {
            Ok((stream, addr)) => (stream, addr.ip()),
            Err(e) => {
                // Out of descriptors, say: wait rather than spin.
                tracing::debug!(error = %e, "control API: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        // A peer past its share of the ordinary slots waits for a reserved one.
        let share = match slot {
            Slot::Ordinary => Peers::hold(&peers, peer),
            Slot::Reserved => None,
        };
        let app = app.clone();
        let (reserved, waiting) = (reserved.clone(), waiting.clone());
        match (slot, share) {
            (Slot::Ordinary, Some(share)) => {
                tokio::spawn(serve(stream, app, Slot::Ordinary, (permit, Some(share))));
            }
            (Slot::Ordinary, None) => {
                drop(permit);
                let Ok(wait) = waiting.try_acquire_owned() else { continue };
                tokio::spawn(async move {
                    let permit = tokio::time::timeout(HEADER_TIMEOUT, reserved.acquire_owned()).await;
                    drop(wait);
                    if let Ok(Ok(permit)) = permit {
                        serve(stream, app, Slot::Reserved, (permit, None)).await;
                    }
                });
            }
            (Slot::Reserved, _) => {
                tokio::spawn(serve(stream, app, Slot::Reserved, (permit, None)));
            }
        }
    }
}

/// Serve one connection in `slot`, holding `held` until it ends.
async fn serve(
    stream: tokio::net::TcpStream,
    app: Router,
    slot: Slot,
    held: (tokio::sync::OwnedSemaphorePermit, Option<PeerHold>),
) {
    let app = match slot {
        Slot::Ordinary => app,
        Slot::Reserved => app.layer(axum::Extension(Slot::Reserved)),
    };
    let service = hyper_util::service::TowerToHyperService::new(app);
    let mut http = hyper::server::conn::http1::Builder::new();
    let wait = if slot == Slot::Reserved { RESERVED_HEADER_TIMEOUT } else { HEADER_TIMEOUT };
    http.timer(TokioTimer::new()).header_read_timeout(wait).max_buf_size(MAX_HEADER_BYTES);
    // A reserved connection serves one request: no client keeps one.
    http.keep_alive(slot == Slot::Ordinary);
    let io = TokioIo::new(WriteDeadline { inner: stream, stalled: None });
    let _ = http.serve_connection(io, service).await;
    drop(held);
}

/// Ordinary connections held per peer.
#[derive(Default)]
struct Peers(std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>);

/// One of a peer's ordinary connections (counted until dropped).
struct PeerHold {
    peers: Arc<Peers>,
    peer: std::net::IpAddr,
}

impl Peers {
    /// One more ordinary connection of `peer`, if it holds fewer than its share.
    fn hold(peers: &Arc<Peers>, peer: std::net::IpAddr) -> Option<PeerHold> {
        let mut held = peers.0.lock().ok()?;
        let n = held.entry(peer).or_insert(0);
        if *n >= PEER_SHARE {
            return None;
        }
        *n += 1;
        Some(PeerHold { peers: peers.clone(), peer })
    }
}

impl Drop for PeerHold {
    fn drop(&mut self) {
        if let Ok(mut held) = self.peers.0.lock() {
            if let Some(n) = held.get_mut(&self.peer) {
                *n -= 1;
                if *n == 0 {
                    held.remove(&self.peer);
                }
            }
        }
    }
}

/// A stream whose writes fail once one has waited [`WRITE_TIMEOUT`] for the client to
/// read (the connection is then closed).
struct WriteDeadline<S> {
    inner: S,
    /// Since when a write has been waiting.
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<S: AsyncWrite + Unpin> WriteDeadline<S> {
    /// `written` as the inner stream gave it; a write pending too long fails.
    fn deadline<T>(&mut self, cx: &mut Context<'_>, written: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        match written {
            Poll::Pending => {
                let stalled = self.stalled.get_or_insert_with(|| Box::pin(tokio::time::sleep(WRITE_TIMEOUT)));
                match stalled.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the client does not read its answers",
                    ))),
                    Poll::Pending => Poll::Pending,
                }
            }
            done => {
                self.stalled = None;
                done
            }
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteDeadline<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.deadline(cx, written)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.deadline(cx, written)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let flushed = Pin::new(&mut self.inner).poll_flush(cx);
        self.deadline(cx, flushed)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

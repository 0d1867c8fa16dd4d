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
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of descriptors, say: wait rather than spin.
                tracing::debug!(error = %e, "control API: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let app = match slot {
            Slot::Ordinary => app.clone(),
            Slot::Reserved => app.clone().layer(axum::Extension(Slot::Reserved)),
        };
        let service = hyper_util::service::TowerToHyperService::new(app);
        tokio::spawn(async move {
            let mut http = hyper::server::conn::http1::Builder::new();
            let wait = if slot == Slot::Reserved { RESERVED_HEADER_TIMEOUT } else { HEADER_TIMEOUT };
            http.timer(TokioTimer::new()).header_read_timeout(wait).max_buf_size(MAX_HEADER_BYTES);
            // A reserved connection serves one request: no client keeps one.
            http.keep_alive(slot == Slot::Ordinary);
            let io = TokioIo::new(WriteDeadline { inner: stream, stalled: None });
            let _ = http.serve_connection(io, service).await;
            drop(permit);
        });
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

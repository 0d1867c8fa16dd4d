//! The control API's connections: accepted one by one on the API's own thread, each served
//! by hyper with bounds that keep a hostile client's cost to the job small.
//!
//! - at most [`MAX_CONNECTIONS`] open at once: further ones wait in the kernel's backlog,
//!   so the job's own files (sinks, checkpoints) never run out of descriptors;
//! - a request's headers must arrive within [`HEADER_TIMEOUT`] of the connection's
//!   start or of the previous response (an idle or half-sent request is closed then);
//! - at most [`MAX_HEADER_BYTES`] of headers.
//!
//! What a request may do is [`super::guard`]'s.

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::sync::Arc;
use std::time::Duration;

/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 256;

/// How long a request's headers may take to arrive (and a kept-alive connection may sit
/// idle).
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// The largest request head (line and headers) read.
pub const MAX_HEADER_BYTES: usize = 16 << 10;

/// Serve `app` on `listener` until the process ends.
pub async fn run(listener: tokio::net::TcpListener, app: Router) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else { return };
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
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let mut http = hyper::server::conn::http1::Builder::new();
            http.timer(TokioTimer::new()).header_read_timeout(HEADER_TIMEOUT).max_buf_size(MAX_HEADER_BYTES);
            let _ = http.serve_connection(TokioIo::new(stream), service).await;
            drop(slot);
        });
    }
}

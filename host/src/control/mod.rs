//! The control API of a running job: an HTTP server (axum, on its own thread and tokio
//! runtime) in front of the job's control port ([`crate::job::commands`]). The job loop
//! stays synchronous: it takes commands between records and publishes its status.
//!
//! `/api/v1`, JSON:
//! - `GET /healthz` (the process answers), `GET /readyz` (the job is running);
//! - `GET /metrics`: the status as OpenMetrics text, for Prometheus ([`metrics`]);
//! - `GET /`: the web UI (`ui.html`, embedded);
//! - `GET /api/v1/job`: state, uptime, counters, watermark and partitions, aggregations,
//!   the newest checkpoints;
//! - `GET /api/v1/checkpoints`: the newest checkpoints (id, when, pause, write time,
//!   status);
//! - `POST /api/v1/savepoints`: write a savepoint now, reply with its path (once it is
//!   durable); `GET /api/v1/savepoints`: the savepoints of this run;
//! - `POST /api/v1/stop?mode=savepoint|drain`: stop with a savepoint (the default), or
//!   after firing every open window;
//! - `POST /api/v1/deployments[?aggregation=NAME]`, the component's bytes as the body: a
//!   live plugin swap ([`crate::job::swap`]); the reply is the deploy's record (the
//!   record it happened at, its rollback savepoint, the checkpoint after it, the pause),
//!   or a 4xx error saying why it was refused (the job goes on unchanged);
//! - `GET /api/v1/deployments`: the deploy history of this run.
//!
//! Calls that change anything need `Authorization: Bearer TOKEN`: the token is `KM0_TOKEN`,
//! or one generated at start into a file only its owner can read (its path is logged). A
//! non-loopback address without `KM0_TOKEN` is refused at start.

pub mod client;
pub mod metrics;

use crate::job::commands::{Command, ControlHandle, StopMode};
use crate::{Error, Result};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// The default address of `km0 run`'s control API.
pub const DEFAULT_ADDR: &str = "127.0.0.1:8081";

/// How long a call waits for the job to act on a command.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(120);

#[derive(Clone)]
struct Api {
    handle: ControlHandle,
    token: Arc<String>,
}

/// The token for mutating calls: `KM0_TOKEN`, else a new one written (0600) to `file`.
/// A non-loopback `addr` needs `KM0_TOKEN`.
pub fn token_for(addr: &SocketAddr, file: &Path) -> Result<String> {
    if let Some(t) = std::env::var("KM0_TOKEN").ok().filter(|t| !t.is_empty()) {
        return Ok(t);
    }
    if !addr.ip().is_loopback() {
        return Err(Error::Usage(format!(
            "the control API would listen on {addr}, beyond this machine, with a generated token: set KM0_TOKEN \
             (or listen on 127.0.0.1, or --http off)"
        )));
    }
    let mut bytes = [0u8; 16];
    use std::io::Read;
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|e| Error::io("read", "/dev/urandom", e))?;
    let token = crate::pipeline::hex(&bytes);
    if let Some(dir) = file.parent() {
        std::fs::create_dir_all(dir).map_err(|e| Error::io("create", dir, e))?;
    }
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(file)
        .map_err(|e| Error::io("create", file, e))?;
    use std::io::Write;
    f.write_all(token.as_bytes()).map_err(|e| Error::io("write", file, e))?;
    tracing::info!(file = %file.display(), "control API token written (or set KM0_TOKEN)");
    Ok(token)
}

/// Bind `addr` now (so that a busy port is an error at start) and serve the API on a
/// thread of its own. Returns the address bound (a port 0 gets a free one).
pub fn serve(addr: SocketAddr, token: String, handle: ControlHandle) -> Result<SocketAddr> {
    let listener = std::net::TcpListener::bind(addr)
        .map_err(|e| Error::Usage(format!("the control API cannot listen on {addr}: {e}")))?;
    let bound = listener.local_addr().map_err(|e| Error::Usage(format!("control API address: {e}")))?;
    listener.set_nonblocking(true).map_err(|e| Error::Usage(format!("control API socket: {e}")))?;
    let api = Api { handle, token: Arc::new(token) };
    std::thread::Builder::new()
        .name("km0-control".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(rt) => rt,
                Err(e) => return tracing::error!(error = %e, "control API runtime"),
            };
            rt.block_on(async move {
                let listener = match tokio::net::TcpListener::from_std(listener) {
                    Ok(l) => l,
                    Err(e) => return tracing::error!(error = %e, "control API listener"),
                };
                if let Err(e) = axum::serve(listener, router(api)).await {
                    tracing::error!(error = %e, "control API stopped");
                }
            })
        })
        .map_err(|e| Error::Usage(format!("control API thread: {e}")))?;
    tracing::info!(address = %bound, "control API listening");
    Ok(bound)
}

fn router(api: Api) -> Router {
    // Larger uploads are refused (413) before they are read whole.
    let max_upload = api.handle.deployer.as_ref().map_or(0, |d| d.max_bytes);
    Router::new()
        .route("/", get(ui))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(prometheus))
        .route("/api/v1/job", get(job))
        .route("/api/v1/checkpoints", get(checkpoints))
        .route("/api/v1/savepoints", post(savepoint).get(savepoints))
        .route("/api/v1/stop", post(stop))
        .route("/api/v1/deployments", post(deploy).get(deployments))
        .layer(axum::extract::DefaultBodyLimit::max(max_upload))
        .with_state(api)
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(serde_json::json!({ "error": message.into() }))).into_response()
}

/// The bearer token matches (compared in constant time).
fn authorized(api: &Api, headers: &HeaderMap) -> bool {
    let Some(given) = headers.get("authorization").and_then(|v| v.to_str().ok()) else { return false };
    let Some(given) = given.strip_prefix("Bearer ") else { return false };
    let (a, b) = (given.as_bytes(), api.token.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

async fn readyz(State(api): State<Api>) -> Response {
    let status = api.handle.status();
    if status.state == "running" {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the job is {}", if status.state.is_empty() { "starting" } else { &status.state }),
        )
    }
}

/// The web UI: one page, its styles and script inside (no network needed), polling
/// `/api/v1/job` every second.
const UI: &str = include_str!("ui.html");

async fn ui() -> Response {
    ([(axum::http::header::CONTENT_TYPE, "text/html; charset=utf-8")], UI).into_response()
}

async fn prometheus(State(api): State<Api>) -> Response {
    let text = metrics::render(&api.handle.status(), crate::metrics::now_ms());
    ([(axum::http::header::CONTENT_TYPE, metrics::CONTENT_TYPE)], text).into_response()
}

async fn job(State(api): State<Api>) -> Response {
    Json(api.handle.status()).into_response()
}

async fn checkpoints(State(api): State<Api>) -> Response {
    Json(api.handle.status().checkpoint_history).into_response()
}

/// Send a command and wait (off the runtime's thread) for the job's reply.
async fn ask<T: Send + 'static>(
    api: &Api,
    make: impl FnOnce(std::sync::mpsc::Sender<std::result::Result<T, String>>) -> Command,
) -> std::result::Result<T, Response> {
    let (tx, rx) = std::sync::mpsc::channel();
    let answering = api.handle.answering.clone();
    answering.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    struct Answered(Arc<std::sync::atomic::AtomicUsize>);
    impl Drop for Answered {
        fn drop(&mut self) {
            self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
    let _answered = Answered(answering);
    if api.handle.sender.send(make(tx)).is_err() {
        return Err(error(StatusCode::SERVICE_UNAVAILABLE, "the job has stopped"));
    }
    let reply = tokio::task::spawn_blocking(move || rx.recv_timeout(COMMAND_TIMEOUT)).await;
    match reply {
        Ok(Ok(Ok(v))) => Ok(v),
        Ok(Ok(Err(e))) => Err(error(StatusCode::INTERNAL_SERVER_ERROR, e)),
        Ok(Err(_)) => {
            Err(error(StatusCode::SERVICE_UNAVAILABLE, "the job did not answer (stopped, or busy)"))
        }
        Err(e) => Err(error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())),
    }
}

async fn savepoint(State(api): State<Api>, headers: HeaderMap) -> Response {
    if !authorized(&api, &headers) {
        return error(StatusCode::UNAUTHORIZED, "a valid `Authorization: Bearer TOKEN` is needed");
    }
    match ask(&api, |reply| Command::Savepoint { reply }).await {
        Ok(path) => Json(serde_json::json!({ "path": path })).into_response(),
        Err(r) => r,
    }
}

#[derive(serde::Deserialize)]
struct StopQuery {
    mode: Option<String>,
}

async fn stop(State(api): State<Api>, headers: HeaderMap, Query(q): Query<StopQuery>) -> Response {
    if !authorized(&api, &headers) {
        return error(StatusCode::UNAUTHORIZED, "a valid `Authorization: Bearer TOKEN` is needed");
    }
    let mode = match q.mode.as_deref() {
        None | Some("savepoint") => StopMode::Savepoint,
        Some("drain") => StopMode::Drain,
        Some(other) => {
            return error(StatusCode::BAD_REQUEST, format!("mode {other:?}: use `savepoint` or `drain`"))
        }
    };
    match ask(&api, |reply| Command::Stop { mode, reply }).await {
        Ok(path) => Json(serde_json::json!({ "stopped": true, "savepoint": path })).into_response(),
        Err(r) => r,
    }
}

async fn savepoints(State(api): State<Api>) -> Response {
    Json(api.handle.status().savepoints).into_response()
}

async fn deployments(State(api): State<Api>) -> Response {
    Json(api.handle.status().deployments).into_response()
}

#[derive(serde::Deserialize)]
struct DeployQuery {
    aggregation: Option<String>,
}

/// A live deploy: prepare the component here (off the job's thread), then hand it to the
/// job, which swaps it in between two records.
async fn deploy(
    State(api): State<Api>,
    headers: HeaderMap,
    Query(q): Query<DeployQuery>,
    body: axum::body::Bytes,
) -> Response {
    use std::sync::atomic::Ordering;
    if !authorized(&api, &headers) {
        return error(StatusCode::UNAUTHORIZED, "a valid `Authorization: Bearer TOKEN` is needed");
    }
    let Some(deployer) = api.handle.deployer.clone() else {
        return error(StatusCode::NOT_IMPLEMENTED, "this job takes no live deploys");
    };
    if body.is_empty() {
        return error(StatusCode::BAD_REQUEST, "send the component's bytes as the request body");
    }
    if api.handle.deploying.swap(true, Ordering::SeqCst) {
        return error(StatusCode::CONFLICT, "another deploy is under way; try again when it has finished");
    }
    struct Done(Arc<std::sync::atomic::AtomicBool>);
    impl Drop for Done {
        fn drop(&mut self) {
            self.0.store(false, Ordering::SeqCst);
        }
    }
    let _done = Done(api.handle.deploying.clone());
    let status = api.handle.status();
    if status.state != "running" {
        return error(StatusCode::SERVICE_UNAVAILABLE, format!("the job is {:?}, not running", status.state));
    }
    let running: Vec<String> = status.aggregations.iter().map(|a| a.plugin.clone()).collect();
    let prepared = tokio::task::spawn_blocking(move || {
        deployer.prepare(body.to_vec(), q.aggregation.as_deref(), &running)
    })
    .await;
    let deployment = match prepared {
        Ok(Ok(d)) => d,
        Ok(Err(refused)) => return refusal(refused),
        Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    };
    let (tx, rx) = std::sync::mpsc::channel();
    if api.handle.sender.send(Command::Deploy { deployment, reply: tx }).is_err() {
        return error(StatusCode::SERVICE_UNAVAILABLE, "the job has stopped");
    }
    match tokio::task::spawn_blocking(move || rx.recv_timeout(COMMAND_TIMEOUT)).await {
        Ok(Ok(Ok(deployed))) => Json(deployed).into_response(),
        Ok(Ok(Err(refused))) => refusal(refused),
        Ok(Err(_)) => error(StatusCode::SERVICE_UNAVAILABLE, "the job did not answer (stopped, or busy)"),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

fn refusal(refused: crate::job::commands::Refused) -> Response {
    let status = StatusCode::from_u16(refused.status).unwrap_or(StatusCode::UNPROCESSABLE_ENTITY);
    error(status, refused.reason)
}

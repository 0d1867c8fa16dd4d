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
//! - `GET /api/v1/deployments`: the deploy history of this run;
//! - `POST /api/v1/deployments?shadow=true`: run the component beside the current plugin
//!   ([`crate::job::shadow`]); `GET /api/v1/shadow`: what it found; `POST
//!   /api/v1/shadow/promote`: swap it in (a deploy's record); `DELETE /api/v1/shadow`: drop
//!   it;
//! - `DELETE /api/v1/quarantine[/AGGREGATION[/KEY]]`: release quarantined keys (all, an
//!   aggregation's, or one); the reply says how many.
//!
//! Calls that change anything need `Authorization: Bearer TOKEN`: the token is `KM0_TOKEN`,
//! or one generated at start into a file only its owner can read (its path is logged). A
//! non-loopback address without `KM0_TOKEN` is refused at start.

pub mod client;
mod guard;
pub mod metrics;
mod server;

pub use guard::{MAX_WAIT, READS_PER_SECOND, READ_BURST};
pub use server::{HEADER_TIMEOUT, MAX_CONNECTIONS, RESERVED_CONNECTIONS, WRITE_TIMEOUT};

use crate::job::commands::{Command, ControlHandle, JobState, JobStatus, Refused, StopMode};
use crate::job::upgrade::Refusal;
use crate::{Error, Result};
use axum::extract::Path as UrlPath;
use axum::extract::{Query, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The default address of `km0 run`'s control API.
pub const DEFAULT_ADDR: &str = "127.0.0.1:8081";

/// How long a call waits for the job to act on a command.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(120);

/// How long a deploy's upload may take.
pub const UPLOAD_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Clone)]
struct Api {
    handle: ControlHandle,
    /// The status as last served, rendered: each published status is written once as
    /// JSON and as metrics, however many clients ask.
    rendered: Arc<Mutex<Rendered>>,
}

#[derive(Default)]
struct Rendered {
    /// The status these were rendered from.
    of: Option<Arc<JobStatus>>,
    json: Option<axum::body::Bytes>,
    /// The metrics, and the wall-clock second they were written in (their lag gauge).
    metrics: Option<(axum::body::Bytes, i64)>,
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
    write_private(file, token.as_bytes())?;
    tracing::info!(file = %file.display(), "control API token written (or set KM0_TOKEN)");
    Ok(token)
}

/// Write `bytes` to `file`, readable by its owner only: into a new file beside it, then
/// renamed over it, so that an existing file's mode or a link at `file` (followed, it would
/// write elsewhere) are not kept.
fn write_private(file: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let dir = file.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| Error::io("create", dir, e))?;
    let name = file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)
        .and_then(|mut f| f.write_all(bytes).and_then(|()| f.sync_all()))
        .and_then(|()| std::fs::rename(&tmp, file));
    written.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::io("write", file, e)
    })
}

/// Bind `addr` now (so that a busy port is an error at start) and serve the API on a
/// thread of its own. Returns the address bound (a port 0 gets a free one).
/// `allowed_hosts`: host names it answers besides IP addresses and `localhost`.
pub fn serve(
    addr: SocketAddr,
    token: String,
    allowed_hosts: Vec<String>,
    handle: ControlHandle,
) -> Result<SocketAddr> {
    let listener = std::net::TcpListener::bind(addr).map_err(|e| Error::Control {
        what: format!("the control API cannot listen on {addr}"),
        source: e,
    })?;
    let bound = listener
        .local_addr()
        .map_err(|e| Error::Control { what: "the control API's address".into(), source: e })?;
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::Control { what: "the control API's socket".into(), source: e })?;
    let guard = Arc::new(guard::Guard::new(token, allowed_hosts, UI));
    let api = Api { handle, rendered: Arc::default() };
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
                server::run(listener, router(api, guard)).await;
            })
        })
        .map_err(|e| Error::Control { what: "the control API's thread".into(), source: e })?;
    tracing::info!(address = %bound, "control API listening");
    Ok(bound)
}

fn router(api: Api, guard: Arc<guard::Guard>) -> Router {
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
        .route("/api/v1/shadow", get(shadow).delete(abandon))
        .route("/api/v1/shadow/promote", post(promote))
        .route("/api/v1/quarantine", delete(release_all))
        .route("/api/v1/quarantine/{aggregation}", delete(release_aggregation))
        .route("/api/v1/quarantine/{aggregation}/{key}", delete(release_key))
        .with_state(api)
        .layer(axum::middleware::from_fn_with_state(guard, guard::check))
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(serde_json::json!({ "error": message.into() }))).into_response()
}

async fn readyz(State(api): State<Api>) -> Response {
    let status = api.handle.status();
    if status.state == JobState::Running {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        error(StatusCode::SERVICE_UNAVAILABLE, format!("the job is {}", status.state))
    }
}

/// The web UI: one page, its styles and script inside (no network needed), polling
/// `/api/v1/job` every second.
const UI: &str = include_str!("ui.html");

async fn ui() -> Response {
    ([(axum::http::header::CONTENT_TYPE, "text/html; charset=utf-8")], UI).into_response()
}

impl Api {
    /// The rendering of the published status that `pick` chooses, made by `make` when
    /// the status has changed since (or, for the metrics, the second).
    fn rendered<T: Clone>(
        &self,
        pick: impl Fn(&mut Rendered) -> Option<T>,
        make: impl FnOnce(&JobStatus, &mut Rendered) -> T,
    ) -> T {
        let status = self.handle.status();
        let mut r = match self.rendered.lock() {
            Ok(r) => r,
            Err(poisoned) => poisoned.into_inner(),
        };
        if !r.of.as_ref().is_some_and(|of| Arc::ptr_eq(of, &status)) {
            *r = Rendered { of: Some(status.clone()), ..Rendered::default() };
        }
        if let Some(v) = pick(&mut r) {
            return v;
        }
        make(&status, &mut r)
    }
}

async fn prometheus(State(api): State<Api>) -> Response {
    let now = crate::metrics::now_ms();
    let text = api.rendered(
        |r| r.metrics.as_ref().filter(|(_, s)| *s == now / 1000).map(|(t, _)| t.clone()),
        |status, r| {
            let text = axum::body::Bytes::from(metrics::render(status, now));
            r.metrics = Some((text.clone(), now / 1000));
            text
        },
    );
    ([(axum::http::header::CONTENT_TYPE, metrics::CONTENT_TYPE)], text).into_response()
}

async fn job(State(api): State<Api>) -> Response {
    let json = api.rendered(
        |r| r.json.clone(),
        |status, r| {
            let json = axum::body::Bytes::from(serde_json::to_vec(status).unwrap_or_default());
            r.json = Some(json.clone());
            json
        },
    );
    ([(axum::http::header::CONTENT_TYPE, "application/json")], json).into_response()
}

async fn checkpoints(State(api): State<Api>) -> Response {
    Json(&api.handle.status().checkpoint_history).into_response()
}

/// A call under way: the process answers it before it exits ([`ControlHandle::close`]).
struct Answering(Arc<std::sync::atomic::AtomicUsize>);

impl Answering {
    fn new(handle: &ControlHandle) -> Answering {
        handle.answering.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Answering(handle.answering.clone())
    }
}

impl Drop for Answering {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Send a command and wait (off the runtime's thread) for the job's reply.
async fn ask<T: Send + 'static>(
    api: &Api,
    make: impl FnOnce(std::sync::mpsc::Sender<std::result::Result<T, Refused>>) -> Command,
) -> std::result::Result<T, Response> {
    use std::sync::atomic::Ordering;
    let (tx, rx) = std::sync::mpsc::channel();
    if api.handle.closed.load(Ordering::SeqCst) || api.handle.sender.send(make(tx)).is_err() {
        return Err(error(StatusCode::CONFLICT, "the job has stopped"));
    }
    let reply = tokio::task::spawn_blocking(move || rx.recv_timeout(COMMAND_TIMEOUT)).await;
    match reply {
        Ok(Ok(Ok(v))) => Ok(v),
        Ok(Ok(Err(refused))) => Err(refusal(refused)),
        Ok(Err(_)) => {
            Err(error(StatusCode::SERVICE_UNAVAILABLE, "the job did not answer (stopped, or busy)"))
        }
        Err(e) => Err(error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())),
    }
}

async fn savepoint(State(api): State<Api>) -> Response {
    let _answering = Answering::new(&api.handle);
    match ask(&api, |reply| Command::Savepoint { reply }).await {
        Ok(path) => Json(serde_json::json!({ "path": path })).into_response(),
        Err(r) => r,
    }
}

#[derive(serde::Deserialize)]
struct StopQuery {
    mode: Option<String>,
}

async fn stop(State(api): State<Api>, Query(q): Query<StopQuery>) -> Response {
    let _answering = Answering::new(&api.handle);
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
    Json(&api.handle.status().savepoints).into_response()
}

async fn deployments(State(api): State<Api>) -> Response {
    Json(&api.handle.status().deployments).into_response()
}

#[derive(serde::Deserialize)]
struct DeployQuery {
    aggregation: Option<String>,
    /// Run it as a shadow of the current plugin instead of swapping it in.
    #[serde(default)]
    shadow: bool,
}

/// A live deploy: read the component (one deploy at a time: a second is refused before
/// its body is read), prepare it here (off the job's thread), then hand it to the job,
/// which swaps it in between two records.
async fn deploy(State(api): State<Api>, Query(q): Query<DeployQuery>, request: Request) -> Response {
    use std::sync::atomic::Ordering;
    let _answering = Answering::new(&api.handle);
    let Some(deployer) = api.handle.deployer.clone() else {
        return error(StatusCode::NOT_IMPLEMENTED, "this job takes no live deploys");
    };
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
    if status.state != JobState::Running || api.handle.closed.load(Ordering::SeqCst) {
        return error(StatusCode::SERVICE_UNAVAILABLE, format!("the job is {}, not running", status.state));
    }
    // Larger uploads are refused (413) before they are read (a length said) or whole.
    let said = request
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if said.is_some_and(|n| n > deployer.max_bytes as u64) {
        return error(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("a component has at most {} bytes", deployer.max_bytes),
        );
    }
    let read = axum::body::to_bytes(request.into_body(), deployer.max_bytes);
    let body = match tokio::time::timeout(UPLOAD_TIMEOUT, read).await {
        Ok(Ok(body)) => body,
        Ok(Err(e)) => {
            let too_large =
                std::error::Error::source(&e).is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
            return if too_large {
                error(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!("a component has at most {} bytes", deployer.max_bytes),
                )
            } else {
                error(StatusCode::BAD_REQUEST, format!("the upload failed: {e}"))
            };
        }
        Err(_) => {
            return error(
                StatusCode::REQUEST_TIMEOUT,
                format!("the upload took more than {} s", UPLOAD_TIMEOUT.as_secs()),
            )
        }
    };
    if body.is_empty() {
        return error(StatusCode::BAD_REQUEST, "send the component's bytes as the request body");
    }
    let running: Vec<String> = status.aggregations.iter().map(|a| a.plugin.clone()).collect();
    let prepared = tokio::task::spawn_blocking(move || {
        deployer.prepare(body.to_vec(), q.aggregation.as_deref(), &running)
    })
    .await;
    let deployment = match prepared {
        Ok(Ok(d)) => d,
        Ok(Err(refused)) => return refusal(refused.into()),
        Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    };
    if q.shadow {
        return match ask(&api, |reply| Command::Shadow { deployment, reply }).await {
            Ok(shadow) => Json(shadow).into_response(),
            Err(r) => r,
        };
    }
    match ask(&api, |reply| Command::Deploy { deployment, reply }).await {
        Ok(deployed) => Json(deployed).into_response(),
        Err(r) => r,
    }
}

async fn shadow(State(api): State<Api>) -> Response {
    match &api.handle.status().shadow {
        Some(s) => Json(s).into_response(),
        None => error(StatusCode::NOT_FOUND, "no shadow runs"),
    }
}

async fn promote(State(api): State<Api>) -> Response {
    let _answering = Answering::new(&api.handle);
    match ask(&api, |reply| Command::Promote { reply }).await {
        Ok(deployed) => Json(deployed).into_response(),
        Err(r) => r,
    }
}

async fn abandon(State(api): State<Api>) -> Response {
    let _answering = Answering::new(&api.handle);
    match ask(&api, |reply| Command::Abandon { reply }).await {
        Ok(shadow) => Json(shadow).into_response(),
        Err(r) => r,
    }
}

/// Release quarantined keys (`key`: the key's fields joined by `|`, a `|` or `\` within a
/// field escaped with `\`, as results and dead letters write keys).
async fn release(api: Api, aggregation: Option<String>, key: Option<String>) -> Response {
    let _answering = Answering::new(&api.handle);
    let key = key.map(|k| split_key(&k));
    match ask(&api, |reply| Command::Release { aggregation, key, reply }).await {
        Ok(n) => Json(serde_json::json!({ "released": n })).into_response(),
        Err(r) => r,
    }
}

async fn release_all(State(api): State<Api>) -> Response {
    release(api, None, None).await
}

async fn release_aggregation(State(api): State<Api>, UrlPath(aggregation): UrlPath<String>) -> Response {
    release(api, Some(aggregation), None).await
}

async fn release_key(
    State(api): State<Api>,
    UrlPath((aggregation, key)): UrlPath<(String, String)>,
) -> Response {
    release(api, Some(aggregation), Some(key)).await
}

/// A key's fields from its text ([`crate::window::operator::push_key_part`] undone).
fn split_key(text: &str) -> Vec<String> {
    let mut fields = vec![String::new()];
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => fields.last_mut().into_iter().for_each(|f| f.extend(chars.next())),
            '|' => fields.push(String::new()),
            c => fields.last_mut().into_iter().for_each(|f| f.push(c)),
        }
    }
    fields
}

/// A refused or failed command as an HTTP answer: the one place where a refusal gets
/// its status.
fn refusal(refused: Refused) -> Response {
    error(status_of(&refused), refused.to_string())
}

fn status_of(refused: &Refused) -> StatusCode {
    match refused {
        Refused::Upgrade(r) => refusal_status(r),
        Refused::Closed(_) => StatusCode::CONFLICT,
        Refused::Failed(_) => StatusCode::INTERNAL_SERVER_ERROR,
        Refused::NotFound(_) => StatusCode::NOT_FOUND,
    }
}

fn refusal_status(r: &Refusal) -> StatusCode {
    match r {
        Refusal::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
        Refusal::NotAPlugin(_) => StatusCode::BAD_REQUEST,
        Refusal::NoAggregation { .. } => StatusCode::NOT_FOUND,
        Refusal::OtherLogic { .. } | Refusal::ReplacesNothing { .. } => StatusCode::CONFLICT,
        Refusal::Starting => StatusCode::SERVICE_UNAVAILABLE,
        Refusal::NotStored(_) => StatusCode::INTERNAL_SERVER_ERROR,
        Refusal::NoState(_)
        | Refusal::OtherPipeline { .. }
        | Refusal::KeyArity { .. }
        | Refusal::KeyFields { .. }
        | Refusal::UnfitRows { .. }
        | Refusal::Migration { .. }
        | Refusal::SchemaChanged { .. }
        | Refusal::Configure { .. }
        | Refusal::Fields(_)
        | Refusal::InTasks { .. } => StatusCode::UNPROCESSABLE_ENTITY,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_keys_text_splits_into_its_fields() {
        assert_eq!(super::split_key("queso"), ["queso"]);
        assert_eq!(super::split_key("queso|girona"), ["queso", "girona"]);
        // `\|` and `\\` are a field's own characters (as results write them).
        assert_eq!(super::split_key(r"queso\|curado|a\\b"), [r"queso|curado", r"a\b"]);
        assert_eq!(super::split_key(""), [""]);
    }
}

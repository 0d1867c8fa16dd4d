//! What every request to the control API passes before its handler, in order:
//!
//! 1. **Host.** The `Host` header must name an IP address, `localhost`, or a host of
//!    `[control] allowed_hosts`: a page on another site that rebinds its own name to this
//!    machine (DNS rebinding) is refused (421), so it cannot read the status.
//! 2. **Token.** A call that changes anything (any method but GET and HEAD) needs
//!    `Authorization: Bearer TOKEN` (the scheme in any case, RFC 9110): without it the
//!    answer is 401 before a byte of its body is read (no `100 Continue` either).
//! 3. **Rate.** Calls without a valid token share [`READS_PER_SECOND`] (bursts of
//!    [`READ_BURST`]): past it a call waits for its turn, up to [`MAX_WAIT`], and gets 429
//!    beyond that, so that pollers flat out cost the server no more than that rate of
//!    answers (and the job, which shares the cores, little). Health checks (`/healthz`,
//!    `/readyz`: a few bytes each) are outside the budget: a probe must not time out
//!    because pollers spent it.
//!
//! A request with two `Host` headers is refused (400, RFC 9110). On a reserved connection
//! ([`super::server`]) only calls with the token and health checks are answered (503
//! otherwise).
//!
//! Every answer carries headers that keep the UI out of frames and other sites' scripts
//! (`Content-Security-Policy`, `X-Frame-Options`, `X-Content-Type-Options`,
//! `Referrer-Policy`).

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Calls without a token answered per second, on average.
pub const READS_PER_SECOND: f64 = 200.0;

/// How many such calls may come at once, above the average.
pub const READ_BURST: f64 = 400.0;

/// How long a call past the rate waits for its turn before it is refused (429).
pub const MAX_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// What the guard checks against.
pub struct Guard {
    token: String,
    allowed_hosts: Vec<String>,
    /// Tokens left in the bucket, and when it was last filled.
    bucket: Mutex<(f64, Instant)>,
    /// The UI's `Content-Security-Policy` (its one inline script by its hash).
    policy: HeaderValue,
}

impl Guard {
    pub fn new(token: String, allowed_hosts: Vec<String>, ui: &str) -> Guard {
        Guard { token, allowed_hosts, bucket: Mutex::new((READ_BURST, Instant::now())), policy: policy(ui) }
    }

    /// The bearer token matches (compared in constant time).
    pub fn authorized(&self, headers: &HeaderMap) -> bool {
        let Some(given) = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) else {
            return false;
        };
        let Some((scheme, given)) = given.trim().split_once(' ') else { return false };
        if !scheme.eq_ignore_ascii_case("bearer") {
            return false;
        }
        let (a, b) = (given.trim_start().as_bytes(), self.token.as_bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
    }

    /// The request's `Host` is one this API answers to.
    fn host_allowed(&self, headers: &HeaderMap) -> bool {
        // HTTP/1.1 requires a Host; an HTTP/1.0 request without one names no other site.
        let Some(host) = headers.get(header::HOST) else { return true };
        let Ok(host) = host.to_str() else { return false };
        let name = match host.strip_prefix('[') {
            // `[::1]:8081`
            Some(v6) => {
                return v6.split_once(']').is_some_and(|(ip, _)| ip.parse::<std::net::Ipv6Addr>().is_ok())
            }
            None => host.rsplit_once(':').map_or(host, |(name, port)| {
                if port.bytes().all(|b| b.is_ascii_digit()) {
                    name
                } else {
                    host
                }
            }),
        };
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        name.parse::<std::net::Ipv4Addr>().is_ok()
            || name == "localhost"
            || self.allowed_hosts.contains(&name)
    }

    /// Take a turn from the bucket: how long to wait for it (zero: now), or None when
    /// that would be more than [`MAX_WAIT`] (no turn taken).
    fn turn(&self) -> Option<std::time::Duration> {
        let Ok(mut b) = self.bucket.lock() else { return Some(std::time::Duration::ZERO) };
        let now = Instant::now();
        let (tokens, at) = *b;
        // Below zero: turns given out ahead, each waiting for its share of the rate.
        let tokens = (tokens + now.duration_since(at).as_secs_f64() * READS_PER_SECOND).min(READ_BURST) - 1.0;
        let wait = std::time::Duration::from_secs_f64((-tokens).max(0.0) / READS_PER_SECOND);
        if wait > MAX_WAIT {
            *b = (tokens + 1.0, now);
            return None;
        }
        *b = (tokens, now);
        Some(wait)
    }
}

/// The UI's policy: its own origin only, its one inline script by hash, inline styles, no
/// frames around it.
fn policy(ui: &str) -> HeaderValue {
    use sha2::{Digest, Sha256};
    let script = ui
        .split_once("<script>")
        .and_then(|(_, rest)| rest.split_once("</script>"))
        .map_or("", |(script, _)| script);
    let hash = base64(&Sha256::digest(script.as_bytes()));
    let text = format!(
        "default-src 'none'; script-src 'sha256-{hash}'; style-src 'unsafe-inline'; connect-src 'self'; \
         img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    );
    HeaderValue::from_str(&text).unwrap_or(HeaderValue::from_static("default-src 'none'"))
}

/// Standard base64 with padding (RFC 4648 §4), as CSP hashes are written.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk.iter().enumerate().fold(0u32, |n, (i, &b)| n | (b as u32) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// A refusal that closes the connection: whatever the client still sends (a body not
/// read) is not waited for.
fn refuse(status: StatusCode, message: &str) -> Response {
    let mut r = super::error(status, message);
    r.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    r
}

/// The middleware: see the module's text.
pub async fn check(State(guard): State<Arc<Guard>>, request: Request, next: Next) -> Response {
    let headers = request.headers();
    let reserved = request.extensions().get::<super::server::Slot>() == Some(&super::server::Slot::Reserved);
    let health = matches!(request.uri().path(), "/healthz" | "/readyz")
        && matches!(*request.method(), Method::GET | Method::HEAD);
    let mut response = if reserved && !health && !guard.authorized(headers) {
        // Every ordinary slot is held: the reserved ones are the operator's and probes'.
        refuse(StatusCode::SERVICE_UNAVAILABLE, "the control API is busy; try again")
    } else if headers.get_all(header::HOST).iter().nth(1).is_some() {
        refuse(StatusCode::BAD_REQUEST, "a request has one `Host` header (RFC 9110)")
    } else if !guard.host_allowed(headers) {
        refuse(StatusCode::MISDIRECTED_REQUEST, "this API answers requests for its IP address or localhost")
    } else if matches!(*request.method(), Method::GET | Method::HEAD) {
        // Health checks answer at once, whatever the pollers: a probe that times out
        // restarts the job.
        let turn =
            if health || guard.authorized(headers) { Some(std::time::Duration::ZERO) } else { guard.turn() };
        match turn {
            Some(wait) => {
                if !wait.is_zero() {
                    tokio::time::sleep(wait).await;
                }
                next.run(request).await
            }
            None => {
                let mut r =
                    super::error(StatusCode::TOO_MANY_REQUESTS, "too many requests; try again in a second");
                r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                r
            }
        }
    } else if guard.authorized(headers) {
        next.run(request).await
    } else {
        refuse(StatusCode::UNAUTHORIZED, "a valid `Authorization: Bearer TOKEN` is needed")
    };
    let h = response.headers_mut();
    h.insert(header::CONTENT_SECURITY_POLICY, guard.policy.clone());
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    response.into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn the_bearer_scheme_is_case_insensitive_and_the_token_exact() {
        let g = Guard::new("s3cret".into(), vec![], "");
        for ok in ["Bearer s3cret", "bearer s3cret", "BEARER s3cret", "  Bearer   s3cret "] {
            assert!(g.authorized(&headers(&[("authorization", ok)])), "{ok}");
        }
        for bad in ["Bearer s3cre", "Bearer s3crett", "Basic s3cret", "s3cret", "Bearers3cret", ""] {
            assert!(!g.authorized(&headers(&[("authorization", bad)])), "{bad}");
        }
        assert!(!g.authorized(&HeaderMap::new()));
    }

    #[test]
    fn only_addresses_localhost_and_allowed_names_are_answered() {
        let g = Guard::new("t".into(), vec!["km0.internal".into()], "");
        for ok in [
            "127.0.0.1:8081",
            "127.0.0.1",
            "localhost:8081",
            "LOCALHOST",
            "[::1]:8081",
            "10.1.2.3:80",
            "km0.internal:8081",
        ] {
            assert!(g.host_allowed(&headers(&[("host", ok)])), "{ok}");
        }
        for bad in [
            "evil.example:8081",
            "evil.example",
            "localhost.evil.example",
            "[evil]:80",
            "127.0.0.1.evil.example",
        ] {
            assert!(!g.host_allowed(&headers(&[("host", bad)])), "{bad}");
        }
    }

    #[test]
    fn base64_is_rfc_4648() {
        // RFC 4648 §10's vectors.
        for (i, o) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(i.as_bytes()), o);
        }
    }

    #[test]
    fn the_bucket_lets_a_burst_through_then_spaces_turns_then_refuses() {
        let g = Guard::new("t".into(), vec![], "");
        let turns: Vec<Option<std::time::Duration>> = (0..1000).map(|_| g.turn()).collect();
        let now = turns.iter().filter(|t| t.is_some_and(|w| w.is_zero())).count();
        let waiting = turns.iter().filter(|t| t.is_some_and(|w| !w.is_zero())).count();
        let refused = turns.iter().filter(|t| t.is_none()).count();
        // By hand: the burst at once (plus the few the clock adds), then 2 s of turns at
        // 200 a second, each 5 ms after the one before, then refusals.
        assert!((400..420).contains(&now), "{now}");
        assert!((395..=401).contains(&waiting), "{waiting}");
        assert_eq!(now + waiting + refused, 1000);
        let waits: Vec<f64> =
            turns.iter().flatten().filter(|w| !w.is_zero()).map(|w| w.as_secs_f64()).collect();
        assert!(waits.windows(2).all(|p| (p[1] - p[0] - 0.005).abs() < 0.001), "5 ms apart");
        assert!(*waits.last().unwrap() <= MAX_WAIT.as_secs_f64());
    }
}

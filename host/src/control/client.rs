//! A small HTTP/1.1 client for `km0 status|savepoint|stop --job URL` (loopback or plain
//! HTTP addresses; one request per connection).

use crate::{Error, Result};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// Send `method path` to the job at `url` (`http://host:port`); returns the status code
/// and the body.
pub fn call(url: &str, method: &str, path: &str, token: Option<&str>) -> Result<(u16, String)> {
    send(url, method, path, token, &[])
}

/// [`call`] with a request body (`application/octet-stream`).
pub fn send(url: &str, method: &str, path: &str, token: Option<&str>, body: &[u8]) -> Result<(u16, String)> {
    let host = url.trim_end_matches('/').strip_prefix("http://").ok_or_else(|| {
        Error::Usage(format!("--job {url}: give the job's control address as http://HOST:PORT"))
    })?;
    let fail =
        |e: std::io::Error| Error::Control { what: format!("the job at {url} does not answer"), source: e };
    let mut stream = TcpStream::connect(host).map_err(fail)?;
    stream.set_read_timeout(Some(Duration::from_secs(180))).map_err(fail)?;
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\n{auth}Content-Type: application/octet-stream\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .map_err(fail)?;
    // A server that refuses early (a wrong token, too large) may close before it has read
    // the whole body: its answer is still there to read.
    let sent = stream.write_all(body);
    let mut raw = Vec::new();
    if let Err(e) = stream.read_to_end(&mut raw) {
        if raw.is_empty() {
            return Err(fail(sent.err().unwrap_or(e)));
        }
    }
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| Error::Usage(format!("the job at {url} answered something that is not HTTP")))?;
    Ok((code, body.to_string()))
}

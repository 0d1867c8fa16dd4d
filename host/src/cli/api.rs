//! Calls to a running job's control API: its status, a savepoint, a stop; and what every
//! call needs (the token of calls that change something, the reply or its error).

use super::report::print_status;
use anyhow::Result;
use km0::control::client;

/// `km0 status`: the job's status, as JSON or readable.
pub fn status(job: &str, json: bool) -> Result<()> {
    let mut v = api_reply(job, client::call(job, "GET", "/api/v1/job", None)?)?;
    if json {
        println!("{v}");
    } else {
        // Names of partitions, tasks, files and keys come from the input: shown as text,
        // never as terminal commands.
        km0::text::printable_json(&mut v);
        print_status(&v);
    }
    Ok(())
}

/// `km0 savepoint`: prints the savepoint's path.
pub fn savepoint(job: &str, token: Option<String>) -> Result<()> {
    let token = api_token(token);
    let v = api_reply(job, client::call(job, "POST", "/api/v1/savepoints", token.as_deref())?)?;
    println!("{}", v["path"].as_str().unwrap_or(""));
    Ok(())
}

/// `km0 stop`: with a savepoint (its path printed) or draining the windows.
pub fn stop(job: &str, drain: bool, token: Option<String>) -> Result<()> {
    let token = api_token(token);
    let path = if drain { "/api/v1/stop?mode=drain" } else { "/api/v1/stop?mode=savepoint" };
    let v = api_reply(job, client::call(job, "POST", path, token.as_deref())?)?;
    if let Some(sp) = v["savepoint"].as_str() {
        println!("{sp}");
    }
    Ok(())
}

/// A query string value, percent-encoded.
pub(super) fn query_escape(v: &str) -> String {
    v.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The token for the control API's calls that change something.
pub(super) fn api_token(token: Option<String>) -> Option<String> {
    token.or_else(|| std::env::var("KM0_TOKEN").ok()).filter(|t| !t.is_empty())
}

/// A control API reply's JSON, or its error.
pub(super) fn api_reply(url: &str, (code, body): (u16, String)) -> Result<serde_json::Value> {
    let value: serde_json::Value =
        serde_json::from_str(&body).unwrap_or(serde_json::json!({ "error": body.trim() }));
    if code != 200 {
        let why = value["error"].as_str().unwrap_or("").to_string();
        return Err(km0::Error::Usage(format!("the job at {url} answered {code}: {why}")).into());
    }
    Ok(value)
}

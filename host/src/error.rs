//! The library's error type: every failure says what it was doing and on what.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The pipeline file is wrong; the message names the field.
    #[error("pipeline {path}: {message}")]
    Pipeline { path: PathBuf, message: String },

    #[error("{action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The component could not be loaded, does not implement the contract, or trapped.
    #[error("plugin {plugin}: {message}")]
    Plugin { plugin: String, message: String },

    /// The plugin refused or returned something the host cannot use.
    #[error("plugin {plugin} {call}: {message}")]
    PluginCall { plugin: String, call: &'static str, message: String },

    /// A savepoint is unreadable, corrupt or does not fit this job.
    #[error("savepoint {path}: {message}")]
    Savepoint { path: PathBuf, message: String },

    /// A new plugin version cannot take over the savepoint's state.
    #[error("deploy refused: {0}")]
    Deploy(String),

    /// A Kafka client could not do its part (connect, read, write, commit).
    #[error("kafka ({brokers}): {message}")]
    Kafka { brokers: String, message: String },

    /// The PostgreSQL sink could not do its part.
    #[error("postgres sink ({table}): {message}")]
    Postgres { table: String, message: String },

    /// Bad command-line or runtime usage.
    #[error("{0}")]
    Usage(String),
}

impl Error {
    pub fn io(action: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { action, path: path.into(), source }
    }
}

/// An error and its causes on one line, `outer: cause: ...`, as `{:#}` prints an
/// `anyhow` chain, but without a cause that the message before it already ends with
/// ([`Error::Io`] says its cause, and keeps it as its source too: a plain chain said
/// "No such file or directory (os error 2)" twice).
pub fn chain_text<'a>(mut chain: impl Iterator<Item = &'a (dyn std::error::Error + 'static)>) -> String {
    let mut text = chain.next().map(ToString::to_string).unwrap_or_default();
    for cause in chain {
        let cause = cause.to_string();
        if !text.ends_with(&cause) {
            text.push_str(": ");
            text.push_str(&cause);
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(e: &(dyn std::error::Error + 'static)) -> String {
        chain_text(std::iter::successors(Some(e), |e| e.source()))
    }

    #[test]
    fn a_cause_the_message_says_is_not_said_again() {
        let missing = std::io::Error::from(std::io::ErrorKind::NotFound);
        let e = Error::io("read plugin", "/no/such.wasm", missing);
        let cause = std::io::Error::from(std::io::ErrorKind::NotFound).to_string();
        assert_eq!(chain(&e), format!("read plugin /no/such.wasm: {cause}"));
    }

    #[test]
    fn a_cause_the_message_does_not_say_is_added() {
        let e = anyhow::Error::new(Error::Usage("no input".into())).context("run stock-alert");
        assert_eq!(chain_text(e.chain()), "run stock-alert: no input");
        let inner = std::io::Error::other("disk full");
        let e = anyhow::Error::new(Error::io("write results", "out.jsonl", inner)).context("job stock-alert");
        assert_eq!(chain_text(e.chain()), "job stock-alert: write results out.jsonl: disk full");
    }
}

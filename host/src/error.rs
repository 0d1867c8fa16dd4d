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

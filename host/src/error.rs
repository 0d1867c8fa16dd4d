//! The library's error types: every failure says what it was doing and on what, and a
//! [`Refusal`] why a plugin or a savepoint cannot take a job's state.

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
    Deploy(#[source] Box<Refusal>),

    /// A plugin the pipeline cannot run as configured.
    #[error(transparent)]
    Refused(Box<Refusal>),

    /// A savepoint's state does not fit this job (its pipeline or plugins).
    #[error("savepoint {path}: {refusal}")]
    Unfit {
        path: PathBuf,
        #[source]
        refusal: Box<Refusal>,
    },

    /// Another process took a task's checkpoint store (it owns the task now): this one
    /// must not write there any more.
    #[error("checkpoint store {store}: {message}")]
    Fenced { store: String, message: String },

    /// The job stopped itself (a live deploy's circuit breaker tripped, and the pipeline
    /// says to stop): with the savepoint it wrote, from which it can be deployed again.
    #[error("{reason} (savepoint: {})", savepoint.as_deref().map_or_else(|| "none".to_string(), |p| p.display().to_string()))]
    Halted { reason: String, savepoint: Option<PathBuf> },

    /// A Kafka client could not do its part (connect, read, write, commit).
    #[error("kafka ({brokers}): {message}")]
    Kafka { brokers: String, message: String },

    /// The PostgreSQL sink could not do its part.
    #[error("postgres sink ({table}): {message}")]
    Postgres { table: String, message: String },

    /// A socket of the control API: its own (listen), or a job's it calls.
    #[error("{what}: {source}")]
    Control {
        what: String,
        #[source]
        source: std::io::Error,
    },

    /// The RocksDB state backend could not do its part.
    #[error("RocksDB {what} {path}: {source}")]
    Rocks {
        what: String,
        path: PathBuf,
        #[source]
        source: rocksdb::Error,
    },

    /// An address that does not parse.
    #[error("{flag} {addr}: not an address (HOST:PORT): {source}")]
    Address {
        flag: &'static str,
        addr: String,
        #[source]
        source: std::net::AddrParseError,
    },

    /// Bad command-line or runtime usage.
    #[error("{0}")]
    Usage(String),
}

/// Why a plugin, a component or a savepoint's state was not taken.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// Another plugin (by name) would take an aggregation's state.
    #[error(
        "aggregation {aggregation:?} holds state of plugin {held:?}; plugin {offered:?} is different logic \
         and cannot take it"
    )]
    OtherLogic { aggregation: String, held: String, offered: String },

    /// A deployed plugin replaces none of the aggregations.
    #[error(
        "the state is held by plugin(s) {held:?}; plugin {offered:?} is different logic and cannot take it"
    )]
    ReplacesNothing { held: Vec<String>, offered: String },

    /// A deploy named an aggregation the job does not have.
    #[error("no aggregation {name:?}; the job has {known:?}")]
    NoAggregation { name: String, known: Vec<String> },

    /// The savepoint holds no state for one of the pipeline's aggregations.
    #[error("holds no state for aggregation {0:?}")]
    NoState(String),

    /// The savepoint was taken from a pipeline whose state is laid out otherwise.
    #[error(
        "was taken from pipeline {saved:?} with other keys, windows, event-time field or filter; its state \
         does not fit pipeline {pipeline:?}"
    )]
    OtherPipeline { saved: String, pipeline: String },

    /// A saved key does not have as many fields as the pipeline's key.
    #[error("key {fields:?} does not have {want} fields")]
    KeyArity { fields: Vec<String>, want: usize },

    /// The plugin reads more key fields than the pipeline's key has.
    #[error(
        "aggregation {aggregation:?}: plugin {plugin} reads {reads} key fields from every group, but the \
         pipeline's key {key:?} has {}",
        key.len()
    )]
    KeyFields { aggregation: String, plugin: String, reads: u32, key: Vec<String> },

    /// Rows held for an ordered plugin do not fit the new plugin's fields.
    #[error(
        "aggregation {aggregation:?}: {rows} rows are held that plugin {plugin} must take in order, with \
         {values} values each (the first: {first}), but its fields are [{}]: a plugin whose fields \
         change cannot take them; deploy it when no rows are held (after the input ends), or keep its \
         fields",
        fields.join(", ")
    )]
    UnfitRows {
        aggregation: String,
        rows: usize,
        plugin: String,
        values: usize,
        first: String,
        fields: Vec<String>,
    },

    /// The new plugin could not migrate the accumulators of the old state schema.
    #[error("{plugin} (state schema {to}) cannot take the state of {from_plugin} (schema {from}): {source}")]
    Migration {
        plugin: String,
        to: u32,
        from_plugin: String,
        from: u32,
        #[source]
        source: Box<Error>,
    },

    /// A resume (not a deploy) with a plugin of another state schema.
    #[error(
        "the savepoint's accumulators have state schema {from} but {plugin} uses schema {to}: deploy it with \
         `km0 deploy PLUGIN.wasm --from-savepoint {savepoint}` to migrate"
    )]
    SchemaChanged { from: u32, to: u32, plugin: String, savepoint: String },

    /// The component is larger than a live deploy takes.
    #[error("the component has {bytes} bytes; at most {max}")]
    TooLarge { bytes: usize, max: usize },

    /// The bytes are not a component that implements the contract.
    #[error("not a km0 plugin: {0}")]
    NotAPlugin(#[source] Box<Error>),

    /// The new component could not be stored with the job's checkpoints.
    #[error("the component could not be stored with the checkpoints: {0}")]
    NotStored(#[source] Box<Error>),

    /// The plugin refused an aggregation's configuration (or could not be instantiated).
    #[error("aggregation {aggregation:?}: {source}")]
    Configure {
        aggregation: String,
        #[source]
        source: Box<Error>,
    },

    /// The plugins' fields cannot be decoded from the pipeline's records.
    #[error("{0}")]
    Fields(#[source] Box<Error>),

    /// The job has not started its loop yet.
    #[error("the job is starting; try again")]
    Starting,

    /// Tasks of a job of several refused a deploy (each with why), so none swapped it in.
    #[error("tasks refused the new plugin, so no task swapped it in: {}", tasks.join("; "))]
    InTasks { tasks: Vec<String> },
}

impl From<Refusal> for Error {
    fn from(r: Refusal) -> Error {
        Error::Refused(Box::new(r))
    }
}

impl Error {
    /// A deploy that was refused.
    pub fn deploy(r: Refusal) -> Self {
        Error::Deploy(Box::new(r))
    }

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

//! The PostgreSQL sink: results upserted into a table (`INSERT ... ON CONFLICT (key) DO
//! UPDATE`; a retraction deletes its key), committed at every checkpoint barrier in one
//! database transaction together with the job's progress, so results and progress are
//! never apart: exactly-once.
//!
//! Progress is a row per committed barrier in `km0_sink_epochs` (job, table, epoch, the
//! ordinal of the last result committed, the results written in the epoch, and the
//! barrier's lineage: the id of the snapshot taken at it, the id of the snapshot before
//! it, and the fingerprint of what determines the job's results). A run that starts from
//! snapshot `S` with result ordinal `O` compares its lineage with the table's last epoch:
//!
//! - the epoch was committed at `S` itself: the table holds exactly the results up to
//!   `O`, and everything after is written;
//! - the epoch is the one right after `S` (a crash between the barrier's commit and the
//!   checkpoint becoming durable), with the same fingerprint: km0's replays are
//!   deterministic, so results up to that epoch's ordinal are the same ones and are
//!   skipped (the log says how many);
//! - anything else (a fresh run of a job the table already has results of, a savepoint
//!   behind the table's progress, another lineage, a changed configuration replaying an
//!   epoch) is refused with the SQL that starts over, never skipped silently.
//!
//! The table is `key TEXT PRIMARY KEY, value JSONB, epoch BIGINT, updated_at`; km0
//! creates it (and `km0_sink_epochs`) when missing. A table belongs to one job.

use crate::{Error, Result};
use tokio_postgres::{Client, NoTls};

/// Rows per upsert statement.
const CHUNK: usize = 5_000;

/// Barrier ids that end a bounded run start with this.
pub const END_PREFIX: &str = "end-";

/// A checkpoint barrier as the sink records it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Barrier {
    /// Id of the snapshot taken at this barrier (or of the end of a bounded run).
    pub id: String,
    /// Id of the snapshot before it in the job's lineage ("" for a fresh start).
    pub parent: String,
    /// Fingerprint of what determines the results (pipeline, plugins, their config).
    pub fingerprint: String,
}

/// Where a run starts from, for the sink's progress check.
#[derive(Debug, Clone)]
pub struct StartPoint {
    /// The snapshot restored (None: a fresh start).
    pub snapshot: Option<String>,
    /// Results the job had emitted at that snapshot.
    pub ordinal: u64,
    pub fingerprint: String,
    /// A fresh start reads the same records as the fresh start before it (a file, a Kafka
    /// topic from its earliest offsets), so its first epoch can be replayed.
    pub replayable: bool,
}

/// The table's last committed epoch of a job.
struct Progress {
    epoch: i64,
    upto: i64,
    checkpoint: Option<String>,
    parent: Option<String>,
    fingerprint: Option<String>,
}

/// Who may commit a task's epochs: the newest generation of the task's owners (a job
/// shared with a consumer group, [`fence`]).
const OWNERS_TABLE: &str = "CREATE TABLE IF NOT EXISTS km0_sink_owners (
    job TEXT NOT NULL, sink_table TEXT NOT NULL, generation BIGINT NOT NULL,
    PRIMARY KEY (job, sink_table))";

/// The advisory lock that table creation holds (any number: km0's own).
const CREATE_LOCK: i64 = 0x6b6d_3020_7462_6c73;

pub struct PostgresSink {
    rt: tokio::runtime::Runtime,
    client: Client,
    table: String,
    job: String,
    /// The generation this task's owner claimed (a job shared with a consumer group):
    /// an epoch commits only while no newer owner has taken the task.
    owner: Option<i64>,
    /// Results up to this ordinal are already committed.
    committed: u64,
    /// The next epoch to commit.
    epoch: i64,
    keys: Vec<String>,
    /// A value per key; `None` deletes the key.
    values: Vec<Option<String>>,
}

impl PostgresSink {
    /// Connect, create the tables if needed, read the job's progress and check it against
    /// where this run starts.
    pub fn open(
        url: &str,
        table: &str,
        job: &str,
        start: &StartPoint,
        owner: Option<u64>,
    ) -> Result<PostgresSink> {
        let err = |m: String| Error::Postgres { table: table.to_string(), message: m };
        let (rt, client) = connect(url, table)?;
        let client = rt.block_on(async {
            client
                // Tasks of a job (and processes) open their sinks at once: `IF NOT EXISTS`
                // races in PostgreSQL, so the creation holds a lock of km0's own.
                .batch_execute(&format!(
                    "BEGIN;
                     SELECT pg_advisory_xact_lock({CREATE_LOCK});
                     CREATE TABLE IF NOT EXISTS {table} (
                         key TEXT PRIMARY KEY, value JSONB NOT NULL, epoch BIGINT NOT NULL,
                         updated_at TIMESTAMPTZ NOT NULL DEFAULT now());
                     CREATE TABLE IF NOT EXISTS km0_sink_epochs (
                         job TEXT NOT NULL, sink_table TEXT NOT NULL, epoch BIGINT NOT NULL,
                         results_upto BIGINT NOT NULL, results BIGINT NOT NULL,
                         committed_at TIMESTAMPTZ NOT NULL DEFAULT now(),
                         PRIMARY KEY (job, sink_table, epoch));
                     ALTER TABLE km0_sink_epochs ADD COLUMN IF NOT EXISTS checkpoint_id TEXT,
                         ADD COLUMN IF NOT EXISTS parent_id TEXT,
                         ADD COLUMN IF NOT EXISTS fingerprint TEXT;
                     {OWNERS_TABLE};
                     COMMIT;"
                ))
                .await
                .map_err(|e| err(format!("create the tables: {}", db_message(&e))))?;
            Ok::<_, Error>(client)
        })?;
        let owner = owner.map(|g| g as i64);
        if let Some(g) = owner {
            take_over(&rt, &client, table, job, g)?;
        }
        let mut sink = PostgresSink {
            rt,
            client,
            table: table.to_string(),
            job: job.to_string(),
            owner,
            committed: start.ordinal,
            epoch: 1,
            keys: Vec::new(),
            values: Vec::new(),
        };
        if let Some(last) = sink.last_epoch()? {
            sink.epoch = last.epoch + 1;
            sink.committed = sink.check_progress(&last, start)?;
        }
        Ok(sink)
    }

    /// Where the table's progress leaves a run that starts at `start`: the ordinal up to
    /// which results are already in the table, or a refusal that says how to start over.
    fn check_progress(&self, last: &Progress, start: &StartPoint) -> Result<u64> {
        let (job, table) = (&self.job, &self.table);
        let start_over = format!(
            "to start over, run: TRUNCATE {table}; DELETE FROM km0_sink_epochs WHERE job = '{job}' AND sink_table = '{table}';"
        );
        // A fresh start is the empty snapshot: its first barrier's parent is "".
        let snapshot = start.snapshot.as_deref().unwrap_or("");
        if last.checkpoint.is_none() && start.snapshot.is_some() {
            // Progress written by km0 before lineages: the rule of then (results up to the
            // committed ordinal are in the table).
            tracing::warn!(
                epoch = last.epoch,
                table = %table,
                "postgres: the table's progress predates checkpoint lineages; resuming after result {}",
                last.upto
            );
            return Ok(start.ordinal.max(last.upto.max(0) as u64));
        }
        if start.snapshot.is_some() && last.checkpoint.as_deref() == Some(snapshot) {
            return Ok(start.ordinal);
        }
        // The epoch right after the starting point, committed before a failure, with the
        // same configuration and (for a fresh start) the same input: the replay gives the
        // same results. Not the epoch that ended a bounded run: that run went to its end.
        let ended = last.checkpoint.as_deref().is_some_and(|c| c.starts_with(END_PREFIX));
        if last.parent.as_deref() == Some(snapshot)
            && last.fingerprint.as_deref() == Some(start.fingerprint.as_str())
            && !ended
            && (start.snapshot.is_some() || start.replayable)
        {
            let skipped = (last.upto.max(0) as u64).saturating_sub(start.ordinal);
            tracing::info!(
                epoch = last.epoch,
                skipped,
                table = %table,
                "postgres: the epoch after the restored checkpoint was committed before the failure; \
                 its results replay identically and are not written again"
            );
            return Ok(last.upto.max(0) as u64);
        }
        if start.snapshot.is_none() {
            return Err(self.err(format!(
                "already holds results of job {job:?} (up to epoch {}, result {}), and this run starts \
                 afresh: it would skip or rewrite them. Resume from the job's checkpoints or a savepoint, \
                 or {start_over}",
                last.epoch, last.upto
            )));
        }
        if ended
            && last.parent.as_deref() == Some(snapshot)
            && last.fingerprint.as_deref() == Some(start.fingerprint.as_str())
        {
            return Err(self.err(format!(
                "holds the last results of job {job:?}: the run from this state already went to the end of \
                 its input (epoch {}, result {}). Nothing is left to do; to run it again, {start_over}",
                last.epoch, last.upto
            )));
        }
        let at = self.epoch_of(snapshot)?;
        let rewind = match at {
            Some(e) => format!(
                "to continue from this state and rewrite what came after it, delete the later epochs: \
                 DELETE FROM km0_sink_epochs WHERE job = '{job}' AND sink_table = '{table}' AND epoch > {e}; or {start_over}"
            ),
            None => start_over,
        };
        let why = if last.parent.as_deref() == Some(snapshot) {
            "the epoch after this run's starting point was committed with another configuration or plugin"
        } else {
            "the table's progress is ahead of, or apart from, the state this run starts from"
        };
        Err(self.err(format!(
            "holds results of job {job:?} up to epoch {} (result {}): {why}; resuming would skip or rewrite \
             results. Resume from the newest checkpoint, or {rewind}",
            last.epoch, last.upto
        )))
    }

    fn err(&self, m: String) -> Error {
        Error::Postgres { table: self.table.clone(), message: m }
    }

    /// The job's last committed epoch.
    fn last_epoch(&self) -> Result<Option<Progress>> {
        let row = self
            .rt
            .block_on(self.client.query_opt(
                "SELECT epoch, results_upto, checkpoint_id, parent_id, fingerprint FROM km0_sink_epochs \
                 WHERE job = $1 AND sink_table = $2 ORDER BY epoch DESC LIMIT 1",
                &[&self.job, &self.table],
            ))
            .map_err(|e| self.err(format!("read progress: {}", db_message(&e))))?;
        let Some(r) = row else { return Ok(None) };
        let col = |e: tokio_postgres::Error| self.err(format!("km0_sink_epochs: {e}"));
        Ok(Some(Progress {
            epoch: r.try_get(0).map_err(col)?,
            upto: r.try_get(1).map_err(col)?,
            checkpoint: r.try_get(2).map_err(col)?,
            parent: r.try_get(3).map_err(col)?,
            fingerprint: r.try_get(4).map_err(col)?,
        }))
    }

    /// The epoch committed at a snapshot, if the table has it.
    fn epoch_of(&self, snapshot: &str) -> Result<Option<i64>> {
        let row = self
            .rt
            .block_on(self.client.query_opt(
                "SELECT epoch FROM km0_sink_epochs WHERE job = $1 AND sink_table = $2 AND checkpoint_id = $3",
                &[&self.job, &self.table, &snapshot],
            ))
            .map_err(|e| self.err(format!("read progress: {}", db_message(&e))))?;
        row.map(|r| r.try_get(0)).transpose().map_err(|e| self.err(format!("km0_sink_epochs.epoch: {e}")))
    }

    /// Take result number `ordinal` (`None`: retract the key).
    pub fn write(&mut self, key: &str, value: Option<&str>, ordinal: u64) -> Result<()> {
        if ordinal > self.committed {
            self.keys.push(key.to_string());
            self.values.push(value.map(str::to_string));
        }
        Ok(())
    }

    /// Commit the results taken so far (up to result `upto`) and the barrier's progress in
    /// one transaction. Every barrier is recorded, with or without results, so the
    /// table's last epoch always names the job's last snapshot.
    pub fn commit(&mut self, upto: u64, barrier: &Barrier) -> Result<()> {
        let results = self.keys.len() as i64;
        // A key may be updated twice in one epoch (a late update): keep its last value.
        let mut last = std::collections::HashMap::with_capacity(self.keys.len());
        for (i, k) in self.keys.iter().enumerate() {
            last.insert(k.as_str(), i);
        }
        let mut order: Vec<usize> = last.into_values().collect();
        order.sort_unstable();
        let (mut keys, mut values, mut deleted) = (Vec::new(), Vec::new(), Vec::new());
        for &i in &order {
            match &self.values[i] {
                Some(v) => {
                    keys.push(self.keys[i].as_str());
                    values.push(v.as_str());
                }
                None => deleted.push(self.keys[i].as_str()),
            }
        }
        let (epoch, upto_i) = (self.epoch, upto as i64);
        let upsert = format!(
            "INSERT INTO {} (key, value, epoch)
             SELECT k, v::jsonb, $3 FROM unnest($1::text[], $2::text[]) AS u(k, v)
             ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value, epoch = EXCLUDED.epoch, updated_at = now()",
            self.table
        );
        let delete = format!("DELETE FROM {} WHERE key = ANY($1::text[])", self.table);
        let (job, table, owner) = (self.job.clone(), self.table.clone(), self.owner);
        let client = &mut self.client;
        let mut newer = None;
        let done: std::result::Result<(), tokio_postgres::Error> = self.rt.block_on(async {
            let tx = client.transaction().await?;
            if let Some(g) = owner {
                // The owner row is locked until the commit: a newer owner's take-over waits
                // for this epoch, or this epoch sees it and writes nothing.
                let row = tx
                    .query_opt(
                        "SELECT generation FROM km0_sink_owners WHERE job = $1 AND sink_table = $2 FOR UPDATE",
                        &[&job, &table],
                    )
                    .await?;
                let current: i64 = row.map(|r| r.try_get(0)).transpose()?.unwrap_or(g);
                if current > g {
                    newer = Some(current);
                    return tx.rollback().await;
                }
            }
            // Bounded statements, however large the epoch: one transaction all the same.
            if !keys.is_empty() {
                let upsert = tx.prepare(&upsert).await?;
                for (k, v) in keys.chunks(CHUNK).zip(values.chunks(CHUNK)) {
                    tx.execute(&upsert, &[&k, &v, &epoch]).await?;
                }
            }
            for d in deleted.chunks(CHUNK) {
                tx.execute(&delete, &[&d]).await?;
            }
            tx.execute(
                "INSERT INTO km0_sink_epochs (job, sink_table, epoch, results_upto, results, checkpoint_id, \
                 parent_id, fingerprint) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
                &[
                    &job,
                    &table,
                    &epoch,
                    &upto_i,
                    &results,
                    &barrier.id,
                    &barrier.parent,
                    &barrier.fingerprint,
                ],
            )
            .await?;
            tx.commit().await
        });
        done.map_err(|e| self.err(format!("commit epoch {epoch}: {}", db_message(&e))))?;
        if let Some(current) = newer {
            return Err(Error::Fenced {
                store: format!("postgres table {}", self.table),
                message: format!(
                    "another process took task {} (generation {current} after this one's {}): epoch {epoch} \
                     is not written (fenced)",
                    self.job,
                    owner.unwrap_or_default()
                ),
            });
        }
        self.epoch += 1;
        self.committed = upto;
        self.keys.clear();
        self.values.clear();
        Ok(())
    }
}

/// A client of `url` and the runtime it runs on.
fn connect(url: &str, table: &str) -> Result<(tokio::runtime::Runtime, Client)> {
    let err = |m: String| Error::Postgres { table: table.to_string(), message: m };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| err(format!("start the client runtime: {e}")))?;
    let client = rt.block_on(async {
        let (client, connection) =
            tokio_postgres::connect(url, NoTls).await.map_err(|e| err(format!("connect: {e}")))?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::error!(error = %e, "postgres connection");
            }
        });
        Ok::<_, Error>(client)
    })?;
    Ok((rt, client))
}

/// Record that generation `g` of task `job`'s owners writes `table` from now on: an owner
/// of an older generation commits nothing more (a process the consumer group moved the
/// task away from, still running it for a moment). Refused if a newer owner took it.
fn take_over(rt: &tokio::runtime::Runtime, client: &Client, table: &str, job: &str, g: i64) -> Result<()> {
    let current: i64 = rt
        .block_on(async {
            client
                .batch_execute(&format!(
                    "BEGIN; SELECT pg_advisory_xact_lock({CREATE_LOCK}); {OWNERS_TABLE}; COMMIT;"
                ))
                .await?;
            client
                .query_one(
                    "INSERT INTO km0_sink_owners (job, sink_table, generation) VALUES ($1, $2, $3)
                     ON CONFLICT (job, sink_table)
                     DO UPDATE SET generation = GREATEST(km0_sink_owners.generation, EXCLUDED.generation)
                     RETURNING generation",
                    &[&job, &table, &g],
                )
                .await?
                .try_get(0)
        })
        .map_err(|e| Error::Postgres {
            table: table.into(),
            message: format!("take over: {}", db_message(&e)),
        })?;
    if current > g {
        return Err(Error::Fenced {
            store: format!("postgres table {table}"),
            message: format!(
                "another process took task {job} (generation {current} after this one's {g}) (fenced)"
            ),
        });
    }
    Ok(())
}

/// Fence task `job`'s older owners out of `table` before this one restores the task (see
/// [`take_over`]): what they commit from now on is refused, so the table's progress stays
/// within one epoch of the newest complete checkpoint.
pub fn fence(url: &str, table: &str, job: &str, generation: u64) -> Result<()> {
    let (rt, client) = connect(url, table)?;
    take_over(&rt, &client, table, job, generation as i64)
}

/// Take the table of task `job` back to where it stood at `snapshot` (a rollback of a live
/// deploy: the job goes on from that snapshot with the plugin it ran before): the epochs
/// committed after the snapshot's are deleted, and so are the rows they wrote, in one
/// transaction; the run that goes on from the snapshot writes again what its plugin
/// writes. Nothing to do when the snapshot's epoch is the table's last. Returns the rows
/// deleted.
pub fn rewind(url: &str, table: &str, job: &str, snapshot: &str) -> Result<u64> {
    let err = |m: String| Error::Postgres { table: table.to_string(), message: m };
    let (rt, mut client) = connect(url, table)?;
    let delete_rows = format!("DELETE FROM {table} WHERE epoch > $1");
    let deleted: std::result::Result<Option<u64>, tokio_postgres::Error> = rt.block_on(async {
        let tx = client.transaction().await?;
        let at = tx
            .query_opt(
                "SELECT epoch FROM km0_sink_epochs WHERE job = $1 AND sink_table = $2 AND checkpoint_id = $3",
                &[&job, &table, &snapshot],
            )
            .await?;
        let Some(at) = at else { return Ok(None) };
        let epoch: i64 = at.try_get(0)?;
        let rows = tx.execute(&delete_rows, &[&epoch]).await?;
        tx.execute(
            "DELETE FROM km0_sink_epochs WHERE job = $1 AND sink_table = $2 AND epoch > $3",
            &[&job, &table, &epoch],
        )
        .await?;
        tx.commit().await?;
        Ok(Some(rows))
    });
    match deleted.map_err(|e| err(format!("rewind to snapshot {snapshot}: {}", db_message(&e))))? {
        Some(rows) => {
            tracing::info!(table, job, rows, snapshot, "postgres: rewound to the rollback point");
            Ok(rows)
        }
        None => Err(err(format!(
            "cannot rewind job {job:?} to snapshot {snapshot}: the table has no epoch committed at it"
        ))),
    }
}

/// Why PostgreSQL cannot store a result, if it cannot: `text` and `jsonb` hold no NUL
/// character (a JSON value can only carry one as the escape `\u0000`, in a string).
pub fn refuses(key: &str, value: Option<&str>) -> Option<String> {
    let nul = key.contains('\0') || value.is_some_and(escapes_nul);
    nul.then(|| "PostgreSQL cannot store the NUL character (\\u0000) in a key or a JSON value".to_string())
}

/// Whether JSON text holds the escape `\u0000` (and not an escaped backslash followed by
/// `u0000`).
fn escapes_nul(json: &str) -> bool {
    let b = json.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' {
            if b[i + 1..].starts_with(b"u0000") {
                return true;
            }
            i += 2; // the escaped character, whatever it is
        } else {
            i += 1;
        }
    }
    false
}

/// The database's own message (with its detail) when there is one: tokio-postgres'
/// Display says only "db error".
pub fn db_message(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => match db.detail() {
            Some(d) => format!("{}: {} ({d})", db.severity(), db.message()),
            None => format!("{}: {}", db.severity(), db.message()),
        },
        None => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::refuses;

    #[test]
    fn only_a_real_nul_is_refused() {
        assert!(refuses("a\0b", None).is_some());
        assert!(refuses("k", Some(r#"{"s":"x\u0000y"}"#)).is_some());
        assert!(refuses("k", Some(r#"{"s":"\\\u0000"}"#)).is_some(), "an escaped backslash, then a NUL");
        assert!(refuses("k", Some(r#"{"s":"\\u0000"}"#)).is_none(), "a backslash and the text u0000");
        assert!(refuses("k", Some(r#"{"s":"\u00e9"}"#)).is_none());
        assert!(refuses("k", None).is_none());
    }
}

//! The PostgreSQL sink: results upserted into a table (`INSERT ... ON CONFLICT (key) DO
//! UPDATE`), committed at every checkpoint barrier in one database transaction together
//! with the job's progress, so results and progress are never apart: exactly-once.
//!
//! Progress is a row per committed epoch in `km0_sink_epochs` (job, table, epoch, the
//! ordinal of the last result committed, the results written in the epoch). After a
//! failure the job replays from its last checkpoint; km0's replays are deterministic, so
//! a result is identified by its ordinal (the job numbers its results, and the count is
//! part of every checkpoint), and the sink drops those at or before the last committed
//! ordinal: each result is written once, in one epoch.
//!
//! The table is `key TEXT PRIMARY KEY, value JSONB, epoch BIGINT, updated_at`; km0
//! creates it (and `km0_sink_epochs`) when missing. A table belongs to one job: to start
//! over, truncate it and delete the job's rows in `km0_sink_epochs`.

use crate::{Error, Result};
use tokio_postgres::{Client, NoTls};

/// Rows per upsert statement.
const CHUNK: usize = 5_000;

pub struct PostgresSink {
    rt: tokio::runtime::Runtime,
    client: Client,
    table: String,
    job: String,
    /// Results up to this ordinal are already committed.
    committed: u64,
    /// The next epoch to commit.
    epoch: i64,
    keys: Vec<String>,
    values: Vec<String>,
}

impl PostgresSink {
    /// Connect, create the tables if needed and read the job's progress.
    pub fn open(url: &str, table: &str, job: &str) -> Result<PostgresSink> {
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
            client
                .batch_execute(&format!(
                    "CREATE TABLE IF NOT EXISTS {table} (
                         key TEXT PRIMARY KEY, value JSONB NOT NULL, epoch BIGINT NOT NULL,
                         updated_at TIMESTAMPTZ NOT NULL DEFAULT now());
                     CREATE TABLE IF NOT EXISTS km0_sink_epochs (
                         job TEXT NOT NULL, sink_table TEXT NOT NULL, epoch BIGINT NOT NULL,
                         results_upto BIGINT NOT NULL, results BIGINT NOT NULL,
                         committed_at TIMESTAMPTZ NOT NULL DEFAULT now(),
                         PRIMARY KEY (job, sink_table, epoch));"
                ))
                .await
                .map_err(|e| err(format!("create the tables: {e}")))?;
            Ok::<_, Error>(client)
        })?;
        let mut sink = PostgresSink {
            rt,
            client,
            table: table.to_string(),
            job: job.to_string(),
            committed: 0,
            epoch: 1,
            keys: Vec::new(),
            values: Vec::new(),
        };
        if let Some((epoch, upto)) = sink.last_epoch()? {
            sink.epoch = epoch + 1;
            sink.committed = upto.max(0) as u64;
            tracing::info!(
                epoch,
                results = upto,
                table,
                "postgres sink resumes after its last committed epoch"
            );
        }
        Ok(sink)
    }

    fn err(&self, m: String) -> Error {
        Error::Postgres { table: self.table.clone(), message: m }
    }

    /// The job's last committed epoch and the ordinal of its last result.
    fn last_epoch(&self) -> Result<Option<(i64, i64)>> {
        let row = self
            .rt
            .block_on(self.client.query_opt(
                "SELECT epoch, results_upto FROM km0_sink_epochs WHERE job = $1 AND sink_table = $2 \
                 ORDER BY epoch DESC LIMIT 1",
                &[&self.job, &self.table],
            ))
            .map_err(|e| self.err(format!("read progress: {e}")))?;
        match row {
            None => Ok(None),
            Some(r) => {
                let epoch = r.try_get(0).map_err(|e| self.err(format!("km0_sink_epochs.epoch: {e}")))?;
                let upto =
                    r.try_get(1).map_err(|e| self.err(format!("km0_sink_epochs.results_upto: {e}")))?;
                Ok(Some((epoch, upto)))
            }
        }
    }

    /// Take result number `ordinal`.
    pub fn write(&mut self, key: &str, value: &str, ordinal: u64) -> Result<()> {
        if ordinal > self.committed {
            self.keys.push(key.to_string());
            self.values.push(value.to_string());
        }
        Ok(())
    }

    /// Commit the results taken so far (up to result `upto`) and the progress in one
    /// transaction.
    pub fn commit(&mut self, upto: u64) -> Result<()> {
        if self.keys.is_empty() {
            return Ok(());
        }
        let results = self.keys.len() as i64;
        // A key may be updated twice in one epoch (a late update): keep its last value.
        let mut last = std::collections::HashMap::with_capacity(self.keys.len());
        for (i, k) in self.keys.iter().enumerate() {
            last.insert(k.as_str(), i);
        }
        let mut order: Vec<usize> = last.into_values().collect();
        order.sort_unstable();
        let keys: Vec<&str> = order.iter().map(|&i| self.keys[i].as_str()).collect();
        let values: Vec<&str> = order.iter().map(|&i| self.values[i].as_str()).collect();
        let (epoch, upto_i) = (self.epoch, upto as i64);
        let upsert = format!(
            "INSERT INTO {} (key, value, epoch)
             SELECT k, v::jsonb, $3 FROM unnest($1::text[], $2::text[]) AS u(k, v)
             ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value, epoch = EXCLUDED.epoch, updated_at = now()",
            self.table
        );
        let (job, table) = (self.job.clone(), self.table.clone());
        let client = &mut self.client;
        let done: std::result::Result<(), tokio_postgres::Error> = self.rt.block_on(async {
            let tx = client.transaction().await?;
            // Bounded statements, however large the epoch: one transaction all the same.
            let upsert = tx.prepare(&upsert).await?;
            for (k, v) in keys.chunks(CHUNK).zip(values.chunks(CHUNK)) {
                tx.execute(&upsert, &[&k, &v, &epoch]).await?;
            }
            tx.execute(
                "INSERT INTO km0_sink_epochs (job, sink_table, epoch, results_upto, results) VALUES ($1, $2, $3, $4, $5)",
                &[&job, &table, &epoch, &upto_i, &results],
            )
            .await?;
            tx.commit().await
        });
        done.map_err(|e| self.err(format!("commit epoch {epoch}: {e}")))?;
        self.epoch += 1;
        self.committed = upto;
        self.keys.clear();
        self.values.clear();
        Ok(())
    }
}

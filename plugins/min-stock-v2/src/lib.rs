//! Low-stock alert, version 2: as version 1, and also the net stock movement (sum of
//! `delta`) of the window. Its accumulator layout is state schema 2; `migrate` reads
//! schema 1, whose windows carry no deltas yet, so the migrated window reports the sum
//! over the updates it has seen since the upgrade (`actualizaciones_con_delta`).

use km0_plugin::{decode, Aggregate, Config, Events, Field, Group, Output};
use serde::{Deserialize, Serialize};

/// State schema 1, as written by min-stock 0.1.
#[derive(Default, Deserialize)]
struct AccV1 {
    min: Option<i64>,
    count: u64,
}

/// State schema 2.
#[derive(Default, Serialize, Deserialize)]
pub struct Acc {
    min: Option<i64>,
    count: u64,
    delta_sum: i64,
    delta_count: u64,
}

pub struct MinStock {
    threshold: i64,
}

#[derive(Serialize)]
struct Alert<'a> {
    ventana_inicio: i64,
    ventana_fin: i64,
    producto: &'a str,
    mercado: &'a str,
    stock_minimo: i64,
    actualizaciones: u64,
    suma_delta: i64,
    actualizaciones_con_delta: u64,
}

impl Aggregate for MinStock {
    const NAME: &'static str = "min-stock";
    const STATE_SCHEMA: u32 = 2;
    const FIELDS: &'static [Field] = &[Field::int("stock_actual"), Field::int("delta")];
    const KEY_FIELDS: u32 = 2;
    type Acc = Acc;

    fn configure(config: &Config) -> Result<Self, String> {
        config.only(&["threshold"])?;
        Ok(MinStock { threshold: config.int_or("threshold", 10)? })
    }

    fn add(&self, acc: &mut Acc, _group: &Group<'_>, events: &Events<'_>) {
        let stock = events.ints(0);
        if let Some(&m) = stock.iter().min() {
            acc.min = Some(acc.min.map_or(m, |a| a.min(m)));
        }
        acc.count += stock.len() as u64;
        acc.delta_sum += events.ints(1).iter().sum::<i64>();
        acc.delta_count += stock.len() as u64;
    }

    fn merge(&self, acc: &mut Acc, other: Acc) {
        acc.min = match (acc.min, other.min) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        acc.count += other.count;
        acc.delta_sum += other.delta_sum;
        acc.delta_count += other.delta_count;
    }

    fn finish(&self, acc: &Acc, group: &Group<'_>, out: &mut Output) {
        if let Some(min) = acc.min.filter(|m| *m < self.threshold) {
            out.emit(&Alert {
                ventana_inicio: group.window_start,
                ventana_fin: group.window_end,
                producto: group.key(0),
                mercado: group.key(1),
                stock_minimo: min,
                actualizaciones: acc.count,
                suma_delta: acc.delta_sum,
                actualizaciones_con_delta: acc.delta_count,
            });
        }
    }

    fn migrate(&self, from_schema: u32, bytes: &[u8]) -> Result<Acc, String> {
        match from_schema {
            1 => {
                let old: AccV1 = decode(bytes)?;
                Ok(Acc { min: old.min, count: old.count, delta_sum: 0, delta_count: 0 })
            }
            other => Err(format!("min-stock 2 reads state schema 1 or 2, not {other}")),
        }
    }
}

km0_plugin::export_plugin!(MinStock);

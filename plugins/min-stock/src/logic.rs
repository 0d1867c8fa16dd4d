// The low-stock alert's logic, shared by `min-stock` and `min-stock-strict` (include!d
// with MARGIN defined: the alert fires when the minimum is below `threshold + MARGIN`).

use km0_plugin::{Aggregate, Config, Events, Field, Group, Output};
use serde::{Deserialize, Serialize};

/// State schema 1: the minimum seen and how many updates.
#[derive(Default, Serialize, Deserialize)]
pub struct Acc {
    min: Option<i64>,
    count: u64,
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
}

impl Aggregate for MinStock {
    const NAME: &'static str = "min-stock";
    const STATE_SCHEMA: u32 = 1;
    const FIELDS: &'static [Field] = &[Field::int("stock_actual")];
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
    }

    fn merge(&self, acc: &mut Acc, other: Acc) {
        acc.min = match (acc.min, other.min) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        acc.count += other.count;
    }

    fn finish(&self, acc: &Acc, group: &Group<'_>, out: &mut Output) {
        if let Some(min) = acc.min.filter(|m| *m < self.threshold + MARGIN) {
            out.emit(&Alert {
                ventana_inicio: group.window_start,
                ventana_fin: group.window_end,
                producto: group.key(0),
                mercado: group.key(1),
                stock_minimo: min,
                actualizaciones: acc.count,
            });
        }
    }
}


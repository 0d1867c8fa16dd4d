//! A broken release of min-stock, for the host's live deploy tests: state schema 3, and a
//! `migrate` that traps on the first accumulator it reads. Deploying it must be refused
//! with the job's state and plugin left as they were.

use km0_plugin::{Aggregate, Config, Events, Field, Group, Output};
use serde::{Deserialize, Serialize};

#[derive(Default, Serialize, Deserialize)]
pub struct Acc {
    min: Option<i64>,
}

pub struct MinStockBroken;

impl Aggregate for MinStockBroken {
    const NAME: &'static str = "min-stock";
    const STATE_SCHEMA: u32 = 3;
    const FIELDS: &'static [Field] = &[Field::int("stock_actual")];
    const KEY_FIELDS: u32 = 2;
    type Acc = Acc;

    fn configure(_config: &Config) -> Result<Self, String> {
        Ok(MinStockBroken)
    }

    fn add(&self, acc: &mut Acc, _group: &Group<'_>, events: &Events<'_>) {
        acc.min = events.ints(0).iter().copied().chain(acc.min).min();
    }

    fn merge(&self, acc: &mut Acc, other: Acc) {
        acc.min = acc.min.into_iter().chain(other.min).min();
    }

    fn finish(&self, _acc: &Acc, _group: &Group<'_>, _out: &mut Output) {}

    fn migrate(&self, from_schema: u32, _bytes: &[u8]) -> Result<Acc, String> {
        panic!("min-stock-broken cannot read state schema {from_schema}")
    }
}

km0_plugin::export_plugin!(MinStockBroken);

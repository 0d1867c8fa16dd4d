//! A bad release of min-stock, for the host's automatic rollback tests: the same name,
//! fields and state schema as `min-stock`, so a live deploy takes it, but every call of
//! its logic panics. km0 must roll it back by itself.

use km0_plugin::{Aggregate, Config, Events, Field, Group, Output};
use serde::{Deserialize, Serialize};

#[derive(Default, Serialize, Deserialize)]
pub struct Acc {
    min: Option<i64>,
    count: u64,
}

pub struct MinStockTrap;

impl Aggregate for MinStockTrap {
    const NAME: &'static str = "min-stock";
    const STATE_SCHEMA: u32 = 1;
    const FIELDS: &'static [Field] = &[Field::int("stock_actual")];
    const KEY_FIELDS: u32 = 2;
    type Acc = Acc;

    fn configure(config: &Config) -> Result<Self, String> {
        config.only(&["threshold"])?;
        Ok(MinStockTrap)
    }

    fn add(&self, _acc: &mut Acc, _group: &Group<'_>, _events: &Events<'_>) {
        panic!("min-stock 1.1.0 is broken: add panics on every call")
    }

    fn merge(&self, _acc: &mut Acc, _other: Acc) {
        panic!("min-stock 1.1.0 is broken: merge panics on every call")
    }

    fn finish(&self, _acc: &Acc, _group: &Group<'_>, _out: &mut Output) {
        panic!("min-stock 1.1.0 is broken: finish panics on every call")
    }
}

km0_plugin::export_plugin!(MinStockTrap);

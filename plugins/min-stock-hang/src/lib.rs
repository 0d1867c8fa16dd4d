//! A hanging release of the low-stock alert, for the host's shadow budget test: the same
//! name, fields and state as `min-stock`, but `add` never returns (it spins until the
//! host stops the call).

mod logic {
    const MARGIN: i64 = 0;
    include!("../../min-stock/src/logic.rs");
}
use km0_plugin::{Aggregate, Config, Events, Field, Group, Output};

pub struct MinStockHang(logic::MinStock);

impl Aggregate for MinStockHang {
    const NAME: &'static str = "min-stock";
    const STATE_SCHEMA: u32 = 1;
    const FIELDS: &'static [Field] = &[Field::int("stock_actual")];
    const KEY_FIELDS: u32 = 2;
    type Acc = logic::Acc;

    fn configure(config: &Config) -> Result<Self, String> {
        logic::MinStock::configure(config).map(MinStockHang)
    }

    fn add(&self, acc: &mut logic::Acc, group: &Group<'_>, events: &Events<'_>) {
        let mut spins = 0u64;
        // Never true: the loop ends only when the host interrupts the call.
        while std::hint::black_box(spins) != u64::MAX {
            spins = spins.wrapping_add(1) % (u64::MAX - 1);
        }
        self.0.add(acc, group, events)
    }

    fn merge(&self, acc: &mut logic::Acc, other: logic::Acc) {
        self.0.merge(acc, other)
    }

    fn finish(&self, acc: &logic::Acc, group: &Group<'_>, out: &mut Output) {
        self.0.finish(acc, group, out)
    }
}

km0_plugin::export_plugin!(MinStockHang);

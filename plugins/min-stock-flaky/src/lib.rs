//! A flaky release of the low-stock alert, for the host's circuit breaker and rollback
//! tests: the same name, fields and state as `min-stock`; it alerts when the minimum is
//! below `threshold + 5` (results min-stock never writes), but `add` panics for the
//! products whose name's bytes add up to 0..=5 modulo 10 (most of them).

mod logic {
    const MARGIN: i64 = 5;
    include!("../../min-stock/src/logic.rs");
}
use km0_plugin::{Aggregate, Config, Events, Field, Group, Output};

pub struct MinStockFlaky(logic::MinStock);

/// Whether the plugin fails on `product`.
fn fails_on(product: &str) -> bool {
    product.bytes().map(u32::from).sum::<u32>() % 10 < 6
}

impl Aggregate for MinStockFlaky {
    const NAME: &'static str = "min-stock";
    const STATE_SCHEMA: u32 = 1;
    const FIELDS: &'static [Field] = &[Field::int("stock_actual")];
    const KEY_FIELDS: u32 = 2;
    type Acc = logic::Acc;

    fn configure(config: &Config) -> Result<Self, String> {
        logic::MinStock::configure(config).map(MinStockFlaky)
    }

    fn add(&self, acc: &mut logic::Acc, group: &Group<'_>, events: &Events<'_>) {
        if fails_on(group.key(0)) {
            panic!("min-stock 0.1.2 fails on product {}", group.key(0));
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

km0_plugin::export_plugin!(MinStockFlaky);

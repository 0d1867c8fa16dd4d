//! For km0's deploy tests: the `distance` logic's next version reads a third field,
//! `altitud`. A savepoint of `distance` holds rows of two fields for its ordered panes;
//! this plugin cannot take them, so deploying it must be refused before anything runs.

use km0_plugin::{Aggregate, Config, Events, Field, Group, Output};
use serde::{Deserialize, Serialize};

/// The same accumulator layout as distance 0.1 (state schema 1).
#[derive(Default, Serialize, Deserialize)]
pub struct Acc {
    positions: u64,
    first: Option<(i64, f64, f64)>,
    last: Option<(i64, f64, f64)>,
    metres: f64,
}

pub struct Distance3d;

impl Aggregate for Distance3d {
    const NAME: &'static str = "distance";
    const STATE_SCHEMA: u32 = 1;
    const FIELDS: &'static [Field] = &[Field::float("lat"), Field::float("lon"), Field::float("altitud")];
    const KEY_FIELDS: u32 = 1;
    const ORDERED_INPUT: bool = true;
    type Acc = Acc;

    fn configure(config: &Config) -> Result<Self, String> {
        config.only(&[])?;
        Ok(Distance3d)
    }

    fn add(&self, acc: &mut Acc, _group: &Group<'_>, events: &Events<'_>) {
        acc.positions += events.len() as u64;
    }

    fn merge(&self, acc: &mut Acc, later: Acc) {
        acc.positions += later.positions;
    }

    fn finish(&self, acc: &Acc, group: &Group<'_>, out: &mut Output) {
        out.emit(&serde_json::json!({ "repartidor": group.key(0), "posiciones": acc.positions }));
    }
}

km0_plugin::export_plugin!(Distance3d);

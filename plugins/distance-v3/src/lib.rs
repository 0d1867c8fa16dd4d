//! For km0's live deploy tests: a release of `distance` with the same fields, ordered
//! input and accumulator layout (state schema 1), but other logic: it counts positions
//! and adds no distance. A pane it rebuilt from its positions reports 0 metres; a pane
//! whose accumulator distance 0.1 left behind does not. So a test can tell whether the
//! panes held at a live swap were handed to the new release again.

use km0_plugin::{Aggregate, Config, Events, Field, Group, Output};
use serde::{Deserialize, Serialize};

/// distance 0.1's layout (state schema 1).
#[derive(Default, Serialize, Deserialize)]
pub struct Acc {
    positions: u64,
    first: Option<(i64, f64, f64)>,
    last: Option<(i64, f64, f64)>,
    metres: f64,
}

pub struct PositionCount;

#[derive(Serialize)]
struct Panel<'a> {
    repartidor: &'a str,
    ventana_inicio: i64,
    ventana_fin: i64,
    distancia_m: f64,
    posiciones: u64,
}

impl Aggregate for PositionCount {
    const NAME: &'static str = "distance";
    const STATE_SCHEMA: u32 = 1;
    const FIELDS: &'static [Field] = &[Field::float("lat"), Field::float("lon")];
    const KEY_FIELDS: u32 = 1;
    const ORDERED_INPUT: bool = true;
    type Acc = Acc;

    fn configure(config: &Config) -> Result<Self, String> {
        config.only(&[])?;
        Ok(PositionCount)
    }

    fn add(&self, acc: &mut Acc, _group: &Group<'_>, events: &Events<'_>) {
        acc.positions += events.len() as u64;
    }

    fn merge(&self, acc: &mut Acc, later: Acc) {
        acc.metres += later.metres;
        acc.positions += later.positions;
    }

    fn finish(&self, acc: &Acc, group: &Group<'_>, out: &mut Output) {
        out.emit(&Panel {
            repartidor: group.key(0),
            ventana_inicio: group.window_start,
            ventana_fin: group.window_end,
            distancia_m: acc.metres,
            posiciones: acc.positions,
        });
    }
}

km0_plugin::export_plugin!(PositionCount);

//! {{name}}: a km0 aggregate plugin. Per key and window, the number of events and the
//! largest `value`; a record for every window with at least `min_count` events.
//!
//! Build with `km0 plugin build .`, check with `km0 plugin test .` (runs `test/`).

use km0_plugin::{Aggregate, Config, Events, Field, Group, Output};
use serde::{Deserialize, Serialize};

/// The accumulator (state schema 1). Bump `STATE_SCHEMA` when it changes and read the
/// old layout in `migrate`, so savepoints taken with this version stay deployable.
#[derive(Default, Serialize, Deserialize)]
pub struct Acc {
    count: u64,
    max: Option<i64>,
}

pub struct Plugin {
    min_count: u64,
}

#[derive(Serialize)]
struct Record<'a> {
    window_start: i64,
    window_end: i64,
    key: Vec<&'a str>,
    count: u64,
    max: Option<i64>,
}

impl Aggregate for Plugin {
    const NAME: &'static str = "{{name}}";
    const STATE_SCHEMA: u32 = 1;
    const FIELDS: &'static [Field] = &[Field::int("value")];
    type Acc = Acc;

    fn configure(config: &Config) -> Result<Self, String> {
        config.only(&["min_count"])?;
        let min_count = config.int_or("min_count", 1)?;
        let min_count =
            u64::try_from(min_count).map_err(|_| format!("config `min_count` must be >= 0, got {min_count}"))?;
        Ok(Plugin { min_count })
    }

    fn add(&self, acc: &mut Acc, _group: &Group<'_>, events: &Events<'_>) {
        acc.count += events.len() as u64;
        if let Some(&m) = events.ints(0).iter().max() {
            acc.max = Some(acc.max.map_or(m, |a| a.max(m)));
        }
    }

    fn merge(&self, acc: &mut Acc, other: Acc) {
        acc.count += other.count;
        acc.max = acc.max.max(other.max);
    }

    fn finish(&self, acc: &Acc, group: &Group<'_>, out: &mut Output) {
        if acc.count >= self.min_count {
            out.emit(&Record {
                window_start: group.window_start,
                window_end: group.window_end,
                key: (0..group.key_arity()).map(|j| group.key(j)).collect(),
                count: acc.count,
                max: acc.max,
            });
        }
    }
}

km0_plugin::export_plugin!(Plugin);
